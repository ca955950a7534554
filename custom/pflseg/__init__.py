"""pflseg: personalized federated segmentation of medical images on NVIDIA FLARE."""

__version__ = "0.1.0"
