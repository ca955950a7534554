"""Server workflows, one module per method (FedProx uses the FedAvg workflow); the registry is
``pflseg.flare.methods``."""
