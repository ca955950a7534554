from pflseg.nets.unet import NETS, build_net, build_unet, fit_to_sites

__all__ = ["NETS", "build_net", "build_unet", "fit_to_sites"]
