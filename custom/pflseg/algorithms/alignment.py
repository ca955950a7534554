"""Feature-alignment losses for GRACE's client side (local features vs the frozen global model's).

Every pixel of a feature map (B, d, H, W) is one sample in R^d: the map becomes X (N, d), N = B H W.

CORAL (Sun & Saenko, 2016), GRACE's default:

    L_coral = || Cov(X_local) - Cov(X_global) ||_F^2 / (4 d^2),
    Cov(X)  = (X - mean X)^T (X - mean X) / (N - 1)

MMD (Gretton et al., 2012) with a sum of Gaussian kernels k(x, y) = sum_s exp(-||x - y||^2 / (2 s^2)),
biased (V-statistic) estimate, so it is >= 0 and exactly 0 for identical samples:

    MMD^2 = mean k(X_l, X_l) + mean k(X_g, X_g) - 2 mean k(X_l, X_g)

The bandwidths s are on the raw feature scale. The pixels are subsampled (without replacement, from a
seeded generator) to at most ``max_samples`` per side, which bounds the cost at O(max_samples^2 d).

Adversarial (Ganin & Lempitsky, 2015): a domain discriminator tells local from global features; the
local features reach it through a gradient-reversal layer, so minimising the discriminator's BCE trains
the discriminator and, reversed, pushes the feature extractor to make the two indistinguishable.

See pflseg/algorithms/METHODS.md, section "GRACE" (L_align options).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: Values of ``grace.align``: ``coral``, ``mmd``, ``adv`` (``adversarial_alignment``).
ALIGNMENTS = ("coral", "mmd", "adv")


def pixel_samples(features: torch.Tensor, name: str = "features") -> torch.Tensor:
    """(B, d, H, W) -> (B H W, d): every pixel one sample. A 2-D (N, d) input is returned as is."""
    if features.dim() == 2:
        return features
    if features.dim() < 3:
        raise ValueError(f"{name}: expected (B, d, *spatial) or (N, d), got shape {tuple(features.shape)}")
    d = features.shape[1]
    return features.movedim(1, -1).reshape(-1, d)


def _pair(f_local: torch.Tensor, f_global: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = pixel_samples(f_local, "f_local"), pixel_samples(f_global, "f_global")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"f_local/f_global: channel counts differ ({x.shape[1]} vs {y.shape[1]})")
    return x, y.to(x.dtype)


def covariance(x: torch.Tensor) -> torch.Tensor:
    """Unbiased covariance (d, d) of samples x (N, d), N >= 2."""
    if x.shape[0] < 2:
        raise ValueError(f"covariance needs at least 2 samples, got {x.shape[0]}")
    xc = x - x.mean(0, keepdim=True)
    return xc.T @ xc / (x.shape[0] - 1)


def coral(f_local: torch.Tensor, f_global: torch.Tensor) -> torch.Tensor:
    """CORAL loss ||Cov(F_l) - Cov(F_g)||_F^2 / (4 d^2).

    Args:
        f_local: (B, d, H, W) features (or (N, d) samples); gradients flow through it.
        f_global: (B', d, H', W') features of the reference model (or (N', d)).

    Returns:
        Scalar tensor, >= 0, zero for identical features.
    """
    x, y = _pair(f_local, f_global)
    d = x.shape[1]
    diff = covariance(x) - covariance(y)
    return diff.pow(2).sum() / (4.0 * d * d)


def _subsample(x: torch.Tensor, max_samples: int, generator: torch.Generator) -> torch.Tensor:
    if x.shape[0] <= max_samples:
        return x
    idx = torch.randperm(x.shape[0], generator=generator)[:max_samples]
    return x[idx.to(x.device)]


def _sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances (n, m) without an (n, m, d) intermediate."""
    return (a.pow(2).sum(1)[:, None] + b.pow(2).sum(1)[None, :] - 2.0 * a @ b.T).clamp_min(0.0)


def mmd(
    f_local: torch.Tensor,
    f_global: torch.Tensor,
    sigmas: Sequence[float] = (1.0, 2.0, 4.0, 8.0, 16.0),
    max_samples: int = 1024,
    seed: int = 0,
) -> torch.Tensor:
    """Squared MMD with a sum of Gaussian kernels (biased estimate) between the pixel samples.

    Args:
        f_local: (B, d, H, W) features (or (N, d) samples).
        f_global: (B', d, H', W') features (or (N', d)).
        sigmas: kernel bandwidths (> 0), on the raw feature scale.
        max_samples: at most this many pixels per side, drawn without replacement.
        seed: seed of the subsampling generator (same seed and sizes -> same pixels on both sides).

    Returns:
        Scalar tensor >= 0 (up to rounding); 0 for identical samples.
    """
    if not sigmas or any(not (s > 0) for s in sigmas):
        raise ValueError(f"sigmas must be a non-empty list of positive bandwidths, got {sigmas}")
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    x, y = _pair(f_local, f_global)
    x = _subsample(x, max_samples, torch.Generator().manual_seed(seed))
    y = _subsample(y, max_samples, torch.Generator().manual_seed(seed))
    gammas = [1.0 / (2.0 * float(s) ** 2) for s in sigmas]

    def kernel_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d2 = _sq_dists(a, b)
        return sum((torch.exp(-g * d2) for g in gammas), torch.zeros_like(d2)).mean()

    return kernel_mean(x, x) + kernel_mean(y, y) - 2.0 * kernel_mean(x, y)


class GradReverse(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``-lam``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
        """``x`` unchanged (any shape); ``lam`` is kept for the backward pass."""
        ctx.lam = float(lam)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """``-lam * grad`` (the shape of ``x``) for ``x``, no gradient for ``lam``."""
        return -ctx.lam * grad, None


def grad_reverse(x: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """Gradient-reversal layer: ``x`` forward, ``-lam * grad`` backward."""
    return GradReverse.apply(x, lam)


class DomainDiscriminator(nn.Module):
    """Tells local from global feature maps: 1x1 convs, global average pooling, linear head.

    Args:
        in_channels: d, channels of the feature maps.
        hidden: channels of the hidden 1x1 convolutions.

    Input (B, d, H, W) -> logits (B, 1) (positive = "local").
    """

    def __init__(self, in_channels: int, hidden: int = 32):
        super().__init__()
        if in_channels < 1 or hidden < 1:
            raise ValueError(f"in_channels and hidden must be >= 1, got {in_channels}, {hidden}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, hidden, kernel_size=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(hidden, hidden, kernel_size=1),
            nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Feature maps (B, d, H, W) -> logits (B, 1), positive = "local"."""
        if x.dim() != 4:
            raise ValueError(f"DomainDiscriminator expects (B, d, H, W), got shape {tuple(x.shape)}")
        return self.head(self.features(x))


def adversarial_alignment(
    disc: nn.Module, f_local: torch.Tensor, f_global: torch.Tensor, lam: float = 1.0
) -> torch.Tensor:
    """Domain-adversarial alignment loss.

    Both feature maps pass through gradient reversal, then ``disc``; the loss is the BCE of local
    (label 1) vs global (label 0). Its gradient trains ``disc`` normally and reaches the feature
    extractor multiplied by ``-lam``. The caller owns the update of ``disc``'s parameters (e.g. as a
    parameter group of the same optimizer: its gradients are filled by the same backward).

    Args:
        disc: e.g. :class:`DomainDiscriminator`, (B, d, H, W) -> (B, 1) logits.
        f_local: (B, d, H, W) local features.
        f_global: (B', d, H', W') features of the frozen global model.
        lam: gradient-reversal strength.

    Returns:
        Scalar BCE (mean over the B + B' images).
    """
    z_local = disc(grad_reverse(f_local, lam)).reshape(-1)
    z_global = disc(grad_reverse(f_global.to(f_local.dtype), lam)).reshape(-1)
    logits = torch.cat([z_local, z_global])
    target = torch.cat([torch.ones_like(z_local), torch.zeros_like(z_global)])
    return F.binary_cross_entropy_with_logits(logits, target)
