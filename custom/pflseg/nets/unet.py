"""MONAI 2D UNet built from a config dict (the project's segmentation network)."""

from __future__ import annotations

from collections.abc import Mapping

from monai.networks.nets import UNet
from torch import nn

from pflseg.nets.lcfed import build_lcfed

UNET_DEFAULTS = {
    "in_channels": 1,
    "out_channels": 1,
    "channels": [16, 32, 64, 128],
    "strides": [2, 2, 2],
    "num_res_units": 1,
    "norm": "batch",
    "dropout": 0.0,
}


#: keys of the project's net config that only the LC-Fed net reads
LCFED_ONLY = {"n_sites", "embed_dim", "pcs"}


def build_unet(cfg: Mapping) -> nn.Module:
    """Build ``monai.networks.nets.UNet(spatial_dims=2, ...)`` from ``cfg`` (keys of UNET_DEFAULTS).

    Output: raw logits (B, out_channels, H, W); one sigmoid channel per foreground class.
    """
    unknown = set(cfg) - set(UNET_DEFAULTS) - {"name"} - LCFED_ONLY
    if unknown:
        raise ValueError(f"net: unknown key(s) {sorted(unknown)}; known: {sorted(UNET_DEFAULTS)}")
    args = {**UNET_DEFAULTS, **{k: v for k, v in cfg.items() if k in UNET_DEFAULTS}}
    if len(args["strides"]) != len(args["channels"]) - 1:
        raise ValueError(
            f"net: strides needs len(channels) - 1 = {len(args['channels']) - 1} entries, got {args['strides']}"
        )
    return UNet(
        spatial_dims=2,
        in_channels=args["in_channels"],
        out_channels=args["out_channels"],
        channels=tuple(args["channels"]),
        strides=tuple(args["strides"]),
        num_res_units=args["num_res_units"],
        norm=args["norm"],
        dropout=args["dropout"],
    )


#: the networks ``build_net`` makes (``net.name``)
NETS = ("unet", "lcfed")


def build_net(cfg: Mapping) -> nn.Module:
    """Factory over the project's networks; ``cfg["name"]`` selects (default ``unet``).

    ``unet``: :func:`build_unet`; ``lcfed``: :func:`pflseg.nets.lcfed.build_lcfed` (LC-Fed net with PCS
    and HC; ``forward(image)`` gives the coarse logits of site ``net.site``, ``parts(image, site)`` a dict).
    """
    name = cfg.get("name", "unet")
    if name == "unet":
        return build_unet(cfg)
    if name == "lcfed":
        return build_lcfed(cfg)
    raise ValueError(f"net.name: unknown network '{name}'; known: {', '.join(NETS)}")


def fit_to_sites(cfg: dict, sites: list[str]) -> None:
    """Size a net config to the federation's ``sites``, in place. The LC-Fed net has one site embedding per site
    (whatever method trains it): ``n_sites: 0`` becomes the number of sites; fewer than the sites is an error."""
    if cfg.get("name", "unet") != "lcfed":
        return
    if cfg["n_sites"] == 0:
        cfg["n_sites"] = len(sites)
    elif cfg["n_sites"] < len(sites):
        raise ValueError(f"net.n_sites={cfg['n_sites']} but {len(sites)} sites joined ({sites}); "
                         "set net.n_sites: 0 (one site embedding per connected site)")
