from pflseg.nets.unet import build_net, build_unet

__all__ = ["build_net", "build_unet"]
