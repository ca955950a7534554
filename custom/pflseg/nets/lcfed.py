"""LC-Fed network: a 2D U-shaped net with personalized channel selection (PCS) and head calibration (HC).

Built from MONAI blocks (``ResidualUnit`` stages, transposed ``Convolution`` upsampling). The encoder has
``len(channels)`` stages (five by default), stage 0 at full resolution and every further stage
downsampling by its stride; PCS sits after the last encoder stage; the decoder mirrors the encoder with
skip connections and ends in a feature map (B, channels[0], H, W). Two 1x1 convolution heads read that
feature: ``head`` (coarse prediction) and ``calib_head`` (HC, the calibrated prediction). Both heads are
personal; everything else (PCS included) is shared. The split is given by :func:`personal_keys` /
:func:`shared_keys`, built from the module structure (``LCFedNet.PERSONAL_MODULES``).

See pflseg/algorithms/METHODS.md, section "LC-Fed", and ``pflseg.algorithms.lcfed`` for the training math.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from monai.networks.blocks import Convolution, ResidualUnit
from torch import nn
from torch.func import functional_call

from pflseg.algorithms.lcfed import calibrate

LCFED_DEFAULTS = {
    "in_channels": 1,
    "out_channels": 1,
    "channels": [16, 32, 64, 128, 256],
    "strides": [2, 2, 2, 2],
    "num_res_units": 1,
    "norm": "batch",
    "dropout": 0.0,
    "n_sites": 0,  # required (> 0): the number of sites of the federation (the server fills it in)
    "embed_dim": 32,
    "pcs": True,  # False: no PCS module (the plain U-shaped net, e.g. for FedRep / FT / FedAvg on this backbone)
}


def _site_indices(site_index: int | torch.Tensor, batch: int, n_sites: int, device: torch.device) -> torch.Tensor:
    """(B,) long tensor of site indices from an int or a (B,) / scalar tensor; checks the range."""
    idx = torch.as_tensor(site_index, dtype=torch.long, device=device)
    if idx.dim() == 0:
        idx = idx.expand(batch)
    if idx.shape != (batch,):
        raise ValueError(f"site_index: expected an int or a ({batch},) tensor, got shape {tuple(idx.shape)}")
    if bool(((idx < 0) | (idx >= n_sites)).any()):
        raise ValueError(f"site_index: values must lie in [0, {n_sites}), got {idx.tolist()}")
    return idx


class PCS(nn.Module):
    """Personalized channel selection.

    The site embedding e_k = one-hot(k) (length ``n_sites``) is widened by
    Linear -> LayerNorm -> ReLU -> Linear to ``embed_dim`` values (LayerNorm normalises the single vector
    over its features, i.e. instance normalisation of one sample, so it works with batch 1). The channel
    descriptor is the global average of the feature; ``[descriptor; widened e_k] -> Linear -> sigmoid``
    gives a channel factor h (the gate, values in (0, 1)) and ``x <- x * h + x``.

    Args:
        channels: C, channels of the feature it acts on.
        n_sites: K, number of sites (length of the one-hot vector).
        embed_dim: E, length of the widened embedding.
    """

    def __init__(self, channels: int, n_sites: int, embed_dim: int = 32):
        super().__init__()
        for name, value in (("channels", channels), ("n_sites", n_sites), ("embed_dim", embed_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.n_sites = n_sites
        self.channels = channels
        self.widen = nn.Sequential(
            nn.Linear(n_sites, embed_dim), nn.LayerNorm(embed_dim), nn.ReLU(), nn.Linear(embed_dim, embed_dim)
        )
        self.fc = nn.Linear(channels + embed_dim, channels)

    def embed(self, site_index: torch.Tensor) -> torch.Tensor:
        """Widened embeddings of sites ``site_index`` ((N,) long) -> (N, E)."""
        onehot = F.one_hot(site_index, self.n_sites).to(self.fc.weight.dtype)
        return self.widen(onehot)

    def gate(self, descriptor: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Channel factor h = sigmoid(fc([descriptor; embedding])): (B, C) and (B, E) -> (B, C) in (0, 1)."""
        return torch.sigmoid(self.fc(torch.cat([descriptor, embedding], dim=1)))

    def site_gates(self, descriptor: torch.Tensor, site_index: torch.Tensor) -> torch.Tensor:
        """The gates every sample would get under each of M sites' embeddings.

        Args:
            descriptor: (B, C) channel descriptors (global averages of the feature).
            site_index: (M,) long site indices.

        Returns:
            (B, M, C): entry [b, m] is the gate of sample b computed with site ``site_index[m]``'s one-hot.
        """
        b, m = descriptor.shape[0], site_index.shape[0]
        emb = self.embed(site_index)  # (M, E)
        desc = descriptor[:, None, :].expand(b, m, descriptor.shape[1]).reshape(b * m, -1)
        return self.gate(desc, emb[None].expand(b, m, emb.shape[1]).reshape(b * m, -1)).reshape(b, m, -1)

    def own_gate(self, descriptor: torch.Tensor, site_index: torch.Tensor) -> torch.Tensor:
        """The gate of each sample for its site, differentiable ONLY in the first widening layer's weight.

        Same value as :meth:`gate` of the site's embedding; every other parameter (the rest of the
        widening, ``fc``) and the descriptor enter detached. A one-hot input reads one column of that
        weight, so the gradient reaches site k's own column only, which no other site's gate depends on
        (the site-contrast term uses this: ``pflseg.algorithms.lcfed.site_contrast``).

        Args:
            descriptor: (B, C) channel descriptors.
            site_index: (B,) long site indices.

        Returns:
            (B, C) gates in (0, 1).
        """
        params = {n: (p if n == "0.weight" else p.detach()) for n, p in self.widen.named_parameters()}
        onehot = F.one_hot(site_index, self.n_sites).to(self.fc.weight.dtype)
        emb = functional_call(self.widen, params, (onehot,))
        z = F.linear(torch.cat([descriptor.detach(), emb], dim=1), self.fc.weight.detach(), self.fc.bias.detach())
        return torch.sigmoid(z)

    def select(self, x: torch.Tensor, site_index: int | torch.Tensor) -> dict:
        """Args: x (B, C, H, W); site_index int or (B,).

        Returns:
            ``{"output": x * h + x (B, C, H, W), "embedding": widened e_k (B, E), "gate": h (B, C),
            "descriptor": GAP(x) (B, C)}``.
        """
        idx = _site_indices(site_index, x.shape[0], self.n_sites, x.device)
        emb = self.embed(idx)
        desc = x.mean(dim=(2, 3))
        h = self.gate(desc, emb)
        return {"output": x * h[:, :, None, None] + x, "embedding": emb, "gate": h, "descriptor": desc}

    def forward(self, x: torch.Tensor, site_index: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x (B, C, H, W); site_index int or (B,). Returns (x * h + x (B, C, H, W), embedding (B, E))."""
        out = self.select(x, site_index)
        return out["output"], out["embedding"]


class LCFedNet(nn.Module):
    """U-shaped net with PCS after the last encoder stage and two personal 1x1 heads.

    Args:
        in_channels: image channels.
        out_channels: C, one sigmoid channel per foreground class.
        channels: channels of the encoder stages (stage 0 at full resolution).
        strides: downsampling stride into each further stage (``len(channels) - 1`` entries); H and W
            must be divisible by their product.
        n_sites: K, number of sites of the federation.
        embed_dim: length of PCS's widened site embedding.
        pcs: build PCS (False: ``self.pcs`` is None and no embedding is produced).
        num_res_units: subunits per ``ResidualUnit``.
        norm, dropout: passed to the MONAI blocks.
    """

    PERSONAL_MODULES = ("head", "calib_head")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        channels: Sequence[int],
        strides: Sequence[int],
        n_sites: int,
        embed_dim: int = 32,
        num_res_units: int = 1,
        norm: str = "batch",
        dropout: float = 0.0,
        pcs: bool = True,
    ):
        super().__init__()
        channels, strides = list(channels), list(strides)
        if len(channels) < 2:
            raise ValueError(f"channels: need at least two stages, got {channels}")
        if len(strides) != len(channels) - 1:
            raise ValueError(f"strides: need len(channels) - 1 = {len(channels) - 1} entries, got {strides}")
        block = dict(spatial_dims=2, subunits=max(1, num_res_units), norm=norm, dropout=dropout)
        self.encoder = nn.ModuleList()
        c_in = in_channels
        for i, c in enumerate(channels):
            self.encoder.append(ResidualUnit(in_channels=c_in, out_channels=c, strides=1 if i == 0 else strides[i - 1],
                                             **block))
            c_in = c
        self.pcs = PCS(channels[-1], n_sites, embed_dim) if pcs else None
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for i in range(len(channels) - 2, -1, -1):
            self.up.append(Convolution(
                spatial_dims=2, in_channels=channels[i + 1], out_channels=channels[i], strides=strides[i],
                kernel_size=3, is_transposed=True, norm=norm, dropout=dropout,
            ))
            self.decoder.append(ResidualUnit(in_channels=2 * channels[i], out_channels=channels[i], strides=1, **block))
        self.head = nn.Conv2d(channels[0], out_channels, kernel_size=1)
        self.calib_head = nn.Conv2d(channels[0], out_channels, kernel_size=1)
        self.n_sites = n_sites
        self.feature_channels = channels[0]
        self.site = 0  # the site index plain ``forward`` uses (a site sets its own); not part of the state

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Coarse logits (B, C, H, W) for site ``self.site``: the net as a plain segmentation model (the
        project's training loop and evaluation call this)."""
        return self.parts(image, self.site)["coarse"]

    def parts(self, image: torch.Tensor, site_index: int | torch.Tensor | None = None) -> dict:
        """Args:
            image: (B, in_channels, H, W).
            site_index: the site's index (int) or one per sample ((B,) long); None = ``self.site``.

        Returns:
            ``{"feature": (B, F, H, W) decoder feature before the heads, "coarse": (B, C, H, W) coarse
            logits, and PCS's "embedding": (B, E) widened site embedding, "gate": (B, C_last) channel
            factor h in (0, 1), "descriptor": (B, C_last) GAP of the last encoder stage's output — each
            None without PCS}``.
        """
        skips = []
        x = image
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        pcs = {"embedding": None, "gate": None, "descriptor": None}
        if self.pcs is not None:
            sel = self.pcs.select(x, self.site if site_index is None else site_index)
            x = sel.pop("output")
            pcs.update(sel)
        for up, dec, skip in zip(self.up, self.decoder, reversed(skips[:-1])):
            x = dec(torch.cat([up(x), skip], dim=1))
        return {"feature": x, "coarse": self.head(x), **pcs}

    def calibrated_logits(self, feature: torch.Tensor, umap: torch.Tensor) -> torch.Tensor:
        """HC: calibrated logits (B, C, H, W) from the feature (B, F, H, W) and a disagreement map
        (B, 1 or C, H, W) (see :func:`pflseg.algorithms.lcfed.calibrate`)."""
        return self.calib_head(calibrate(feature, umap))


def personal_keys(model: LCFedNet) -> list[str]:
    """State-dict keys of the personal modules (``LCFedNet.PERSONAL_MODULES``: coarse head and HC)."""
    if not hasattr(model, "PERSONAL_MODULES"):
        raise TypeError(f"model: expected an LCFedNet, got {type(model).__name__}")
    keys = set()
    for name in model.PERSONAL_MODULES:
        keys.update(f"{name}.{k}" for k in model.get_submodule(name).state_dict().keys())
    return [k for k in model.state_dict().keys() if k in keys]


def shared_keys(model: LCFedNet) -> list[str]:
    """State-dict keys aggregated by LC-Fed: all but :func:`personal_keys` (PCS included)."""
    personal = set(personal_keys(model))
    return [k for k in model.state_dict().keys() if k not in personal]


def build_lcfed(cfg: Mapping) -> LCFedNet:
    """Build an :class:`LCFedNet` from ``cfg`` (keys of LCFED_DEFAULTS plus ``name``; ``n_sites`` required)."""
    unknown = set(cfg) - set(LCFED_DEFAULTS) - {"name"}
    if unknown:
        raise ValueError(f"net: unknown key(s) {sorted(unknown)}; known: {sorted(LCFED_DEFAULTS)}")
    args = {**LCFED_DEFAULTS, **{k: v for k, v in cfg.items() if k != "name"}}
    if not isinstance(args["n_sites"], int) or args["n_sites"] < 1:
        raise ValueError(f"net.n_sites: required for name 'lcfed' (the number of sites of the federation, >= 1), "
                         f"got {args['n_sites']!r}")
    return LCFedNet(**args)
