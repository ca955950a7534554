"""The site side of each method: ``base.Site`` (the round skeleton) and one module per method."""
