"""Site-side differential privacy of a model update: clip its L2 norm, then add Gaussian noise.

This is DP-SGD's mechanism applied once per round to the whole update, as in DP-FedAvg with local noise.

For the update Delta of a site (what it trained minus what it received; a dict of tensors)::

    Delta_clipped = Delta * min(1, C / ||Delta||_2)                (norm over every float coordinate at once)
    Delta_private = Delta_clipped + N(0, (sigma C)^2 I)            (per float coordinate)

C is ``clip``, sigma the ``noise_multiplier``. Integer tensors (batch norm's ``num_batches_tracked``) are
neither counted in the norm nor changed. Abadi et al., "Deep Learning with Differential Privacy", CCS 2016
(clip + Gaussian noise); McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018
(the whole update of a participant clipped and noised).

Privacy of one round: the released update is a Gaussian mechanism whose L2 sensitivity is 2C when any change
of the site's data counts as neighbouring (both updates have norm <= C), C for "the site's data or none"
(``sensitivity`` below, in units of C). T rounds compose in zero-concentrated DP: rho = T s^2 / (2 sigma^2),
giving (rho + 2 sqrt(rho ln(1/delta)), delta)-DP (Bun and Steinke, TCC 2016, Prop. 1.3 and Lemma 2.5 / 3.5).
The guarantee holds only while the noise is secret and drawn once: its seed must not be derivable by whoever sees
the update or chose the round's inputs (``fresh_generator``: fresh OS randomness at every release), and one round
released twice with fresh noise counts twice (the site refuses it: ``pflseg.flare.privacy.Releases``). DP runs are
therefore not reproducible; runs without noise are.

Pure tensors: no FLARE, no files.
"""

from __future__ import annotations

import math
import secrets

import torch


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded with 63 bits of the OS's randomness (``secrets``).

    A new, unpredictable noise source for every release: neither the server nor a rerun of the job can regenerate it.
    """
    return torch.Generator().manual_seed(secrets.randbits(63))


def float_keys(update: dict[str, torch.Tensor]) -> list[str]:
    """The keys of ``update`` holding floating-point tensors, sorted (a fixed order for the noise draws)."""
    return sorted(k for k, v in update.items() if torch.is_tensor(v) and v.is_floating_point())


def update_norm(update: dict[str, torch.Tensor]) -> float:
    """L2 norm of the float coordinates of ``update`` taken together (float64 sums)."""
    return math.sqrt(sum(float(update[k].detach().double().pow(2).sum()) for k in float_keys(update)))


def clip_update(update: dict[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """``update`` with its float coordinates scaled by ``min(1, clip / norm)``; integer tensors as they are.

    Args:
        update: key -> tensor (any shapes).
        clip: C > 0, the bound of the returned update's L2 norm.

    Returns:
        (clipped update, the norm before clipping).
    """
    if not clip > 0:
        raise ValueError(f"clip={clip!r}: the norm bound C must be > 0")
    norm = update_norm(update)
    scale = 1.0 if norm <= clip else clip / norm
    out = dict(update)
    for k in float_keys(update):
        out[k] = update[k] * scale if scale != 1.0 else update[k].clone()
    return out, norm


def add_noise(update: dict[str, torch.Tensor], std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``update`` plus N(0, std^2) drawn from ``generator`` (CPU) for every float coordinate.

    The keys are drawn in sorted order, so a seed gives the same noise whatever the dict's order. Integer
    tensors stay as they are.
    """
    if std < 0:
        raise ValueError(f"std={std!r}: the noise standard deviation must be >= 0")
    out = dict(update)
    if std == 0:
        return out
    for k in float_keys(update):
        value = update[k]
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * std
        out[k] = (value.double() + noise.to(value.device)).to(value.dtype)
    return out


def privatize(update: dict[str, torch.Tensor], clip: float | None, noise_multiplier: float,
              generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """Clip ``update``'s L2 norm to ``clip``, then add N(0, (noise_multiplier x clip)^2) per float coordinate.

    ``clip`` None means no clipping. Integer tensors are untouched.

    Args:
        update: key -> tensor, a site's model update (trained minus received).
        clip: C > 0, or None (only with ``noise_multiplier`` 0: the noise is scaled by C).
        noise_multiplier: sigma >= 0.
        generator: the noise's source (required when sigma > 0): ``fresh_generator()`` for a release; a fixed
            seed only in tests.

    Returns:
        (private update, the norm before clipping: stays at the site).
    """
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be >= 0")
    if clip is None:
        if noise_multiplier > 0:
            raise ValueError("noise_multiplier > 0 needs a clip C (the noise's scale is noise_multiplier x C)")
        return dict(update), update_norm(update)
    out, norm = clip_update(update, clip)
    if noise_multiplier > 0:
        if generator is None:
            raise ValueError("noise_multiplier > 0 needs a generator (fresh_generator(): fresh randomness of the site)")
        out = add_noise(out, noise_multiplier * clip, generator)
    return out, norm


def floor_at(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], keys, low: float = 0.0) -> dict:
    """``update`` changed so that ``reference[k] + update[k] >= low`` for each of ``keys``.

    Used for e.g. batch norm's running variances, which noise could make negative. This is post-processing of
    the private update with public ``reference`` values, so it costs no privacy.
    """
    out = dict(update)
    for k in keys:
        if k in update and k in reference:
            out[k] = torch.maximum(update[k], (low - reference[k]).to(update[k].dtype))
    return out


def zcdp_epsilon(noise_multiplier: float, rounds: int, delta: float, sensitivity: float = 2.0) -> float:
    """Epsilon of (epsilon, delta)-DP after ``rounds`` releases of a site's clipped, noised update.

    Args:
        noise_multiplier: sigma (> 0; 0 gives infinity).
        rounds: T, the number of updates the site released.
        delta: in (0, 1).
        sensitivity: the L2 sensitivity in units of C: 2 (default) when any change of the site's data set is
            neighbouring, 1 for a site's data set against none.

    Returns:
        rho + 2 sqrt(rho ln(1/delta)) with rho = T sensitivity^2 / (2 sigma^2).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must lie in (0, 1)")
    if rounds < 0 or sensitivity <= 0:
        raise ValueError(f"rounds={rounds!r} must be >= 0 and sensitivity={sensitivity!r} > 0")
    if noise_multiplier <= 0:
        return math.inf
    rho = rounds * sensitivity ** 2 / (2 * noise_multiplier ** 2)
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))
