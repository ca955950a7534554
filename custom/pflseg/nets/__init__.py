from pflseg.nets.unet import build_net, build_unet, fit_to_sites

__all__ = ["build_net", "build_unet", "fit_to_sites"]
