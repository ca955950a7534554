"""FedAvg, the site's side: train the received global model, send the whole trained model back.

The site's model is the server's global model (``personalized = False``); the site still keeps its best
received model by validation Dice (the final table reports the server's selected global model).
"""

from __future__ import annotations

from pflseg.flare.sites.base import Site


class FedAvgSite(Site):
    personalized = False
