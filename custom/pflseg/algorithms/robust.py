"""Robustness of the server's aggregation against one site that lies (issue 23 item 2).

Every answer a site sends passes exact checks on arrival (keys, shapes, dtypes, finite numbers, n_k a
positive integer under ``max_n_samples``; ``pflseg.flare.controllers.base``). A site can still send finite
values of any size and any n_k under the cap. The functions here bound what such a site can do:

    weight bound   n_k <- min(n_k, c_n * median_{j != k} n_j)                      (``bounded_weights``)
    clip           u_k <- u_k * min(1, c_c * median_{j != k} ||u_j|| / ||u_k||)     (``clip_updates``)
                   (before any weighting, whatever the method: one site moves an average by at most its
                   weight x c_c honest updates; a state within the bound is passed on as it came)
                   the same rule (``clip_factors``) for what is not a model update:
                   summed gradients  ``clip_updates`` from zero (FedSM's epoch-mode selector gradients: a site
                                     adds at most c_c x the others' median gradient to the sum, whatever its n_k)
                   LDA statistics    x <- M + f_m (m_k - M) + f_s (x - m_k) for each of site k's features, M the
                                     sites' median mean, f_m bounding ||m_k - M|| (against the others' RMS distance
                                     from M), f_s its features' RMS distance from m_k and their RMS along its widest
                                     direction (``clip_statistics``: FedSM's and FedSM-extra's selector fit)
                   LC-Fed's coarse heads and IOP-FL's published P_k are states: ``clip_updates`` against the
                   site's previous head / the bundle's global model
    norm bound     leave k out if ||u_k|| > c_u * median_{j != k} ||u_j|| > 0       (``norm_outliers``)
                   (the whole update u_k = answer - what was sent, and each tensor of it that was sent;
                   the caller may skip keys: honest sites' Adam second moments differ by 1000x and more)
    aggregation    mean:          sum_k p_k w_k                  (``fedavg.weighted_average``, the default)
                   median:        coordinate-wise median of the w_k, unweighted
                   trimmed_mean:  per coordinate drop the b lowest and b highest values,
                                  b = min(ceil(trim * K), (K - 1) // 2), plain mean of the rest

The medians are over the OTHER sites (leave-one-out), so with K = 2 each site is bounded by the other: a
site cannot raise the median it is judged by. The robust rules ignore the weights: a weight is a site's own
claim, and a robust rule assumes any site may lie (weighted, two colluders of five claiming n_k 99x kept one
of them among the survivors with almost all of the weight: issue 39 F5). They need K >= 3 to differ from the
mean (K = 2: median = mean, nothing trimmed).

Plus the checks that keep one bad number from spreading: ``check_moments`` (FedSM's selector Adam moments:
exp_avg_sq >= 0, |exp_avg| <= ``ADAM_RATIO`` sqrt(exp_avg_sq), step in its range; ``bound_moments`` on their
aggregate) and ``first_nonfinite`` (an aggregate or a received model holding NaN /
Inf or an absurd magnitude). Pure torch; no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch

from pflseg.algorithms.fedavg import BLOCK, normalized_weights, weighted_average

State = Mapping[str, torch.Tensor]

RULES = ("mean", "median", "trimmed_mean")

#: A received or aggregated value beyond this magnitude is refused: its square overflows float32 (about
#: 3.4e38), so no trained weight or normalisation statistic of a segmentation net is this large.
MAX_ABS = 1e18


def check_rule(rule: str, trim: float) -> None:
    """ValueError naming the bad argument: ``rule`` one of ``RULES``, ``trim`` in [0, 0.5)."""
    if rule not in RULES:
        raise ValueError(f"aggregation rule: unknown value {rule!r}; known: {', '.join(RULES)}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must lie in [0, 0.5), got {trim}")


def trim_count(k: int, trim: float) -> int:
    """Values dropped at EACH end of a coordinate by ``trimmed_mean`` over ``k`` sites.

    The count is ceil(trim * k): at least one when trim > 0, and at most (k - 1) // 2 so that at least one
    value (two for even k) is kept.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return min(math.ceil(trim * k - 1e-9), (k - 1) // 2)


def combine_rows(block: torch.Tensor, weights: Sequence[float], rule: str = "mean", trim: float = 0.0) -> torch.Tensor:
    """Combine K rows coordinate by coordinate.

    Args:
        block: (K, P) values, one row per site (float64 recommended).
        weights: K non-negative weights (normalised here); used by ``mean`` only (``median`` and
            ``trimmed_mean`` are unweighted: a weight is a site's own claim).
        rule: ``mean`` | ``median`` | ``trimmed_mean``.
        trim: fraction trimmed at each end (``trimmed_mean``), see ``trim_count``.

    Returns:
        (P,) tensor in ``block``'s dtype.
    """
    check_rule(rule, trim)
    if block.dim() != 2 or block.shape[0] != len(weights):
        raise ValueError(f"block: expected (K={len(weights)}, P), got {tuple(block.shape)}")
    k = block.shape[0]
    p = torch.tensor(normalized_weights(weights), dtype=block.dtype)
    if rule == "mean":
        return p @ block
    values = torch.sort(block, dim=0).values
    if rule == "median":
        lo, hi = (k - 1) // 2, k // 2
        return (values[lo] + values[hi]) / 2
    b = trim_count(k, trim)
    return values[b:k - b].mean(dim=0)  # unweighted: a weight is a site's own claim (issue 39 F5)


def aggregate(states: Sequence[State], weights: Sequence[float], keys: Sequence[str] | None = None,
              rule: str = "mean", trim: float = 0.0) -> dict:
    """``rule``'s combination of ``states`` key by key (see the module docstring).

    ``mean`` is ``fedavg.weighted_average`` itself (same numbers, bit for bit); ``median`` / ``trimmed_mean``
    combine each coordinate over the K states (``combine_rows``, in float64), integer keys rounded back.
    Same argument checks as ``weighted_average``; inputs are never modified.
    """
    check_rule(rule, trim)
    if rule == "mean":
        return weighted_average(states, weights, keys)
    if len(states) != len(weights):
        raise ValueError(f"states/weights: {len(states)} states but {len(weights)} weights")
    normalized_weights(weights)  # the same refusals as the mean
    keys = list(states[0].keys()) if keys is None else list(keys)
    mean = weighted_average(states, weights, keys)  # checks keys, shapes and dtypes; gives each key's dtype
    out = {}
    for key in keys:
        ref = mean[key]
        block = torch.stack([s[key].detach().to("cpu", torch.float64).reshape(-1) for s in states])
        value = combine_rows(block, weights, rule, trim).reshape(ref.shape)
        out[key] = value.round().to(ref.dtype) if not ref.is_floating_point() else value.to(ref.dtype)
    return out


def _median_of_others(values: Sequence[float], i: int) -> float:
    others = [v for j, v in enumerate(values) if j != i]
    if not others:  # callers pass two values or more
        raise ValueError(f"the median of the values other than #{i} needs at least two values, got {len(values)}")
    return statistics.median(others)


def bounded_weights(weights: Sequence[float], ratio: float) -> list[float]:
    """Each weight capped at ``ratio`` times the median of the OTHER weights.

    With ``ratio`` 0 (or a single weight) the weights are returned unchanged. A weight within the bound is
    returned as given, so an honest round is unchanged.
    """
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 (0 = no bound), got {ratio}")
    w = list(weights)
    if ratio == 0 or len(w) < 2:
        return w
    out = []
    for i, x in enumerate(w):
        cap = ratio * _median_of_others(w, i)
        out.append(x if x <= cap else cap)
    return out


def squared_norm(value: torch.Tensor, base: torch.Tensor | None = None) -> float:
    """sum((value - base)^2) in float64; without ``base``, sum(value^2).

    Block by block (``BLOCK`` elements): each block's difference taken and squared in float64 and summed by
    torch, the blocks' sums added in float64, so the value is the whole-tensor float64 sum up to its rounding order
    (identical for a tensor of one block). One float64 temporary for the whole tensor cost 4x as much: a fresh
    allocation per tensor, out of cache (docs/speed.md).
    """
    v = value.detach().reshape(-1).to("cpu")
    b = None if base is None else base.detach().reshape(-1).to("cpu")
    total = 0.0
    for i in range(0, v.numel(), BLOCK):
        u = v[i:i + BLOCK].to(torch.float64, copy=True)
        if b is not None:
            u.sub_(b[i:i + BLOCK])  # a float32 base is promoted exactly, element by element
        total += float(u.mul_(u).sum())
    return total


def _float_keys(base: State, state: State, keys: Sequence[str] | None) -> list[str]:
    """The keys of ``state`` whose update is a difference: floating, in ``base`` with the same shape."""
    names = list(state) if keys is None else list(keys)
    return [k for k in names if k in base and k in state and state[k].is_floating_point()
            and tuple(base[k].shape) == tuple(state[k].shape)]


def clip_factors(norms: Sequence[float], ratio: float) -> tuple[list[float], list[float]]:
    """Each norm's clip factor at ``ratio`` times the median of the OTHER norms: ``(factors, ratios)``.

    ``factors[k]`` = min(1, ratio * median_{j != k} norms[j] / norms[k]) (1.0 where that median is 0, ``ratio`` is 0
    or there are fewer than 2 norms); ``ratios[k]`` = norms[k] / that median (0.0 where it is 0). The one rule
    behind every clip of this module: whatever is clipped, a site is judged by the others, so it cannot raise its
    own bound.
    """
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 (0 = no clipping), got {ratio}")
    factors, ratios = [1.0] * len(norms), [0.0] * len(norms)
    if len(norms) < 2:
        return factors, ratios
    for i, norm in enumerate(norms):
        med = _median_of_others(norms, i)
        ratios[i] = norm / med if med > 0 else 0.0
        bound = ratio * med
        if bound > 0 and norm > bound:
            factors[i] = bound / norm
    return factors, ratios


#: key endings of normalisation layers' running statistics (torch's BatchNorm / InstanceNorm buffers)
NORM_STATISTICS = ("running_mean", "running_var")


def clip_updates(bases: Sequence[State], states: Sequence[State], ratio: float, keys: Sequence[str] | None = None,
                 known: Sequence[Mapping[str, float]] | None = None) -> tuple[list[State], list[float], list[float]]:
    """Each state's update clipped at ``ratio`` times the median of the OTHER states' update norms.

    The update of state k is ``states[k] - bases[k]`` over ``keys`` (default: every key) that are floating and
    in ``bases[k]`` with the same shape (other keys, integer counters included, are passed on unchanged); its
    norm is taken in float64 over all those keys together. Where it exceeds ``ratio * median_{j != k}`` (> 0),
    the state becomes ``base + f * update`` with f = bound / norm, cast back to each key's dtype, except its
    normalisation statistics (``NORM_STATISTICS``: running means and variances), which keep the base's values: a
    lying update scaled back is an extrapolation of the site's own change, and a variance extrapolated below its
    base turns negative (one clipped 99x update at a demo site gave the global model negative running variances and
    a validation Dice of 0 in the next round).

    Args:
        bases: K states the updates are taken from (what each site was sent), or one state for all.
        states: K states (what the sites sent back).
        ratio: the multiple c (0 = no clipping; fewer than 2 states are never clipped).
        keys: the keys judged and clipped together.
        known: per state, update norms by key that the caller has already (``update_norms``' ``per_key``, taken
            against the same bases); the keys found there are not computed again.

    Returns:
        ``(states, factors, ratios)``: a state within the bound is the SAME object (so an honest round is
        unchanged bit for bit), a clipped one a new dict; ``factors[k]`` is f (1.0 where nothing was clipped);
        ``ratios[k]`` its update norm / the median of the others' (0 where that median is 0 or K < 2).
    """
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 (0 = no clipping), got {ratio}")
    bases = [bases] * len(states) if isinstance(bases, Mapping) else list(bases)
    if len(bases) != len(states):
        raise ValueError(f"bases/states: {len(bases)} bases but {len(states)} states")
    out, factors, ratios = list(states), [1.0] * len(states), [0.0] * len(states)
    if len(states) < 2:
        return out, factors, ratios
    judged = [_float_keys(b, s, keys) for b, s in zip(bases, states)]
    known = known or [{}] * len(states)
    norms = [math.sqrt(sum(kn[k] ** 2 if k in kn else squared_norm(s[k], b[k]) for k in ks))
             for b, s, ks, kn in zip(bases, states, judged, known)]
    factors, ratios = clip_factors(norms, ratio)
    for i, (base, state, ks, f) in enumerate(zip(bases, states, judged, factors)):
        if f >= 1.0:
            continue
        new = dict(state)
        for key in ks:
            if key.endswith(NORM_STATISTICS):
                new[key] = base[key]
                continue
            b = base[key].detach().to("cpu", torch.float64)
            new[key] = (b + f * (state[key].detach().to("cpu", torch.float64) - b)).to(state[key].dtype)
        out[i] = new
    return out, factors, ratios


def _moments(stats: Mapping[str, torch.Tensor]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(n, feature sum (D,), Gram (D, D))`` of one site's class statistics, float64."""
    count, sums, gram = (stats[k].detach().to("cpu", torch.float64) for k in ("count", "sum", "gram"))
    return float(count.sum()), sums.sum(0), gram


def _spread(n: float, total: torch.Tensor, gram: torch.Tensor) -> tuple[float, float]:
    """The RMS distance of a site's n features from their own mean, and their RMS along their widest direction.

    sqrt(tr W / n) and sqrt(lambda_max(W) / n), W = sum_i (x_i - m)(x_i - m)^T = gram - n m m^T, m = total / n.
    """
    w = gram - torch.outer(total, total) / n
    w = (w + w.T) / 2
    top = float(torch.linalg.eigvalsh(w)[-1]) if w.numel() else 0.0
    return math.sqrt(max(float(torch.trace(w)), 0.0) / n), math.sqrt(max(top, 0.0) / n)


def clip_statistics(stats: Sequence[Mapping[str, torch.Tensor]], ratio: float) -> tuple[list, list[float],
                                                                                        list[float]]:
    """Each site's LDA class statistics clipped: its feature mean and its features' spread about that mean.

    The statistics are ``count`` (C,), ``sum`` (C, D) and ``gram`` (D, D) (``pflseg.algorithms.fedsm``) of a site's
    n_k features x_i, their mean m_k. Judged against the OTHER sites' median (``clip_factors``), each:

    - where: ||m_k - M||, M the coordinate-wise median of the K sites' means (one site cannot move M beyond the
      others' values, K >= 3), against the others' RMS distance of their features from M (their own spread
      included: a site that sits on M, or one liar that copies a site onto it, gives no scale of zero);
    - spread: the RMS distance of its features from m_k, sqrt(tr W_k / n_k), and their RMS along its widest
      direction, sqrt(lambda_max(W_k) / n_k), W_k = sum_i (x_i - m_k)(x_i - m_k)^T (from its sums and Gram matrix;
      the site's class means lie inside it: their spread about m_k is part of W_k).

    Where one exceeds ``ratio`` times the others' median, the site's features are moved, x -> M + f_m (m_k - M)
    + f_s (x - m_k) (f_m the factor of the mean, f_s the smaller of the two spreads'): counts kept, class sums
    n_c a + f_s s_c and Gram n a a^T + f_s (a t^T + t a^T) + f_s^2 G, with a = M + f_m (m_k - M) - f_s m_k and t the
    site's feature sum. These are the statistics of real (moved) features, so they pass ``check_statistics`` as
    before. Then the site's mean lies within ``ratio`` x the others' median RMS distance of M, each of its class means
    within sqrt(n_k / n_kc) x ``ratio`` x their median spread of its mean, and its part of the pooled covariance, in
    total and along any one direction, within ``ratio``^2 x theirs per sample (times its count, which
    ``bounded_weights`` caps).

    Returns:
        ``(stats, factors, ratios)`` as ``clip_updates``: statistics within the bound are the SAME object (an honest
        round is unchanged bit for bit), moved ones a new dict (float64); ``factors[k]`` the smaller of f_m and f_s,
        ``ratios[k]`` the largest of its three ratios to the others' median.
    """
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 (0 = no clipping), got {ratio}")
    out, k = list(stats), len(stats)
    if k < 2:
        return out, [1.0] * k, [0.0] * k
    moments = [_moments(st) for st in stats]
    if any(not n > 0 for n, _, _ in moments):
        raise ValueError(f"every site's class counts must sum to > 0, got {[n for n, _, _ in moments]}")
    means = torch.stack([t / n for n, t, _ in moments])
    center = combine_rows(means, [1.0] * k, "median")
    spreads = [_spread(n, total, gram) for n, total, gram in moments]
    offsets = [float((m - center).norm()) for m in means]
    scales = [math.hypot(o, s[0]) for o, s in zip(offsets, spreads)]  # RMS distance of a site's features from M
    f_mean, r_mean = [1.0] * k, [0.0] * k
    for i, offset in enumerate(offsets):
        med = _median_of_others(scales, i)
        r_mean[i] = offset / med if med > 0 else 0.0
        if ratio > 0 and med > 0 and offset > ratio * med:
            f_mean[i] = ratio * med / offset
    f_rms, r_rms = clip_factors([s[0] for s in spreads], ratio)
    f_top, r_top = clip_factors([s[1] for s in spreads], ratio)
    factors, ratios = [], []
    for i, (n, total, gram) in enumerate(moments):
        f_m, f_s = f_mean[i], min(f_rms[i], f_top[i])
        factors.append(min(f_m, f_s))
        ratios.append(max(r_mean[i], r_rms[i], r_top[i]))
        if f_m >= 1.0 and f_s >= 1.0:
            continue
        count, sums = (stats[i][key].detach().to("cpu", torch.float64) for key in ("count", "sum"))
        a = center + f_m * (means[i] - center) - f_s * means[i]
        out[i] = {**stats[i], "count": count, "sum": count[:, None] * a + f_s * sums,
                  "gram": n * torch.outer(a, a) + f_s * (torch.outer(a, total) + torch.outer(total, a))
                  + f_s * f_s * gram}
    return out, factors, ratios


def update_norms(answers: Mapping[str, State], sent: Mapping[str, State]) -> tuple[dict, dict]:
    """Norms of each site's update: ``(whole, per_key)``.

    ``whole[site]`` is the L2 norm over every key and ``per_key[key][site]`` each tensor's. The update of a key
    is the answer minus what the site was sent under that key (same shape), else the answer itself (what the
    task did not send: statistics, gradients, ...). Computed in float64 (a finite float32 of any size has a
    finite float64 square).
    """
    whole: dict[str, float] = {}
    per_key: dict[str, dict[str, float]] = {}
    for site, params in answers.items():
        given = sent.get(site, {})
        total = 0.0
        for key, value in params.items():
            base = given.get(key)
            sq = squared_norm(value, base if base is not None and tuple(base.shape) == tuple(value.shape) else None)
            per_key.setdefault(key, {})[site] = math.sqrt(sq)
            total += sq
        whole[site] = math.sqrt(total)
    return whole, per_key


def _judged(key: str, site: str, sent: Mapping[str, State], skip: Sequence[str]) -> bool:
    """Whether ``key`` of ``site``'s update is bounded on its own.

    It is when the site was sent that tensor (its update is a difference), the key is not under a ``skip`` prefix
    and it is not a normalisation statistic (``NORM_STATISTICS``): an honest site's running variance can move far
    more than the others' where its images differ (measured: 167x in round 2 of the demo's LC-Fed, which refused the
    largest site and stopped the job); statistics count in the whole update, and a clipped site's keep the base's.
    """
    return key in sent.get(site, {}) and not key.startswith(tuple(skip)) and not key.endswith(NORM_STATISTICS)


#: a tensor's update is judged against at least this fraction of the other sites' whole-update norm (measured: an
#: honest site's conv-bias update 0.0114 was 200x the others' 5.5e-5 in the demo's IOP-FL round 2)
TENSOR_FLOOR = 0.01


def norm_outliers(answers: Mapping[str, State], sent: Mapping[str, State], ratio: float,
                  skip: Sequence[str] = (), norms: tuple[dict, dict] | None = None) -> dict[str, str]:
    """Sites whose update is beyond ``ratio`` times the median of the OTHER sites': ``{site: reason}``.

    Judged are the whole update and each tensor the site was sent whose key is not under a ``skip`` prefix.
    With ``ratio`` 0 or fewer than 2 answers the result is {}. Where the others' median is 0 (most sites sent
    back what they were sent: no training, a frozen part) there is no scale to judge by and nothing is left out
    for that norm; sites that train never send a zero update. ``norms``: ``update_norms(answers, sent)`` when the
    caller has it already.
    """
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 (0 = no bound), got {ratio}")
    if ratio == 0 or len(answers) < 2:
        return {}
    whole, per_key = update_norms(answers, sent) if norms is None else norms
    sites = list(answers)
    out = {}
    for i, site in enumerate(sites):
        med = _median_of_others([whole[s] for s in sites], i)
        if med > 0 and whole[site] > ratio * med:
            top = max((k for k in per_key if site in per_key[k]), key=lambda k: per_key[k][site])
            out[site] = (f"update norm {whole[site]:.3g} exceeds {ratio:g} x the median of the other sites' "
                         f"update norms ({med:.3g}); its largest part: '{top}' ({per_key[top][site]:.3g})")
            continue
        for key, by_site in per_key.items():
            if site not in by_site or not _judged(key, site, sent, skip):
                continue
            others = [by_site[s] for s in sites if s != site and s in by_site]
            med = statistics.median(others) if others else 0.0
            # a tensor the others barely move (a conv bias before batch norm: ~1e-5) gives no scale of its own:
            # judge it against TENSOR_FLOOR x the others' whole update
            med = max(med, TENSOR_FLOOR * _median_of_others([whole[s] for s in sites], i)) if med > 0 else 0.0
            if med > 0 and by_site[site] > ratio * med:
                out[site] = (f"update of '{key}' has norm {by_site[site]:.3g}, beyond {ratio:g} x the median of the "
                             f"other sites' ({med:.3g})")
                break
    return out


def norm_ratios(answers: Mapping[str, State], sent: Mapping[str, State], skip: Sequence[str] = (),
                norms: tuple[dict, dict] | None = None) -> tuple[float, float, str]:
    """The largest ratio of a site's update norm to the median of the other sites', and that tensor's key.

    Ratios are taken for the whole update and for any tensor with a non-zero median: what ``norm_outliers``
    compares with its bound, for a log line that shows how far an honest round is from it (``norms``: as there).
    """
    whole, per_key = update_norms(answers, sent) if norms is None else norms
    sites = list(answers)
    worst_whole, worst_key, key_name = 0.0, 0.0, ""
    for i, site in enumerate(sites):
        med = _median_of_others([whole[s] for s in sites], i)
        if med:
            worst_whole = max(worst_whole, whole[site] / med)
        for key, by_site in per_key.items():
            others = [by_site[s] for s in sites if s != site and s in by_site]
            med = statistics.median(others) if others else 0.0
            if med > 0 and site in by_site and _judged(key, site, sent, skip) and by_site[site] / med > worst_key:
                worst_key, key_name = by_site[site] / med, key
    return worst_whole, worst_key, key_name


#: torch.optim.Adam's default betas, which the FedSM selector uses (``pflseg.algorithms.fedsm.pooled_adam_step`` and
#: the sites' selector optimizer)
ADAM_BETAS = (0.9, 0.999)


def adam_ratio(betas: tuple[float, float] = ADAM_BETAS) -> float:
    """The largest |exp_avg| / sqrt(exp_avg_sq) any sequence of gradients gives Adam (coordinate by coordinate).

    m_t = (1 - b1) sum_j b1^j g_(t-j), v_t = (1 - b2) sum_j b2^j g_(t-j)^2; Cauchy-Schwarz with the weights
    (b1^2 / b2)^j gives |m_t| <= (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) sqrt(v_t), from zero moments and from
    any moments that satisfy it; a weighted mean of moments that satisfy it satisfies it (sqrt is concave).
    About 7.27 for the defaults.
    """
    b1, b2 = betas
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))


#: ``adam_ratio()`` with a margin for float32 rounding: an honest site's moments always satisfy the bound
ADAM_RATIO = adam_ratio() * (1 + 1e-4)


def bound_moments(combined: Mapping[str, torch.Tensor], moments: Sequence[Mapping[str, torch.Tensor]]) -> dict:
    """The aggregate of K sites' Adam moments, with each ``exp_avg`` coordinate bounded by the sites' own ratios.

    Per coordinate |m| <= r * sqrt(v), with v the aggregate's ``exp_avg_sq`` and r the median over the K sites of
    |m_k| / sqrt(v_k) (0 where v_k = 0), at most ``ADAM_RATIO``. The ratio m / sqrt(v) is what sets the next
    Adam step of every site that starts from these moments; one site can no longer make it larger than the
    honest sites' own ratios (with K >= 3; with K = 2, the larger of the two). A mean of honest moments whose
    ratios agree is unchanged. Returns a new dict (other keys as they are).
    """
    out = dict(combined)
    for key in combined:
        if not key.endswith(".exp_avg"):
            continue
        sq_key = key[: -len("exp_avg")] + "exp_avg_sq"
        if sq_key not in combined:
            continue
        ratios = []
        for site in moments:
            v = site[sq_key].detach().to("cpu", torch.float64).clamp(min=0).sqrt()
            a = site[key].detach().to("cpu", torch.float64).abs()
            ratios.append(torch.where(v > 0, a / torch.where(v > 0, v, torch.ones_like(v)), torch.zeros_like(v)))
        block = torch.stack([r.reshape(-1) for r in ratios])
        r = combine_rows(block, [1.0] * len(moments), "median").reshape(combined[key].shape).clamp(max=ADAM_RATIO)
        limit = r * combined[sq_key].detach().to("cpu", torch.float64).clamp(min=0).sqrt()
        mean = combined[key].detach().to("cpu", torch.float64)
        out[key] = torch.maximum(torch.minimum(mean, limit), -limit).to(combined[key].dtype)
    return out


def check_moments(moments: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor] | None,
                  max_steps: int) -> str | None:
    """Why a site's selector Adam moments cannot be averaged, or None.

    The moments are flat (``"<i>.exp_avg"``, ``"<i>.exp_avg_sq"``, ``"<i>.step"``). Every ``exp_avg_sq`` must
    be >= 0 (its square root is taken), every |``exp_avg``| at most ``ADAM_RATIO`` x sqrt(``exp_avg_sq``) (what
    Adam itself can produce: ``adam_ratio``; a large mean over a zero second moment steers every site's next step
    otherwise), every ``step`` >= 1 (Adam's bias correction divides by
    1 - beta^step) and at most the step the site was sent (0 if none) plus ``max_steps`` (the steps this round
    can take). Finiteness is checked on arrival.
    """
    for key, value in moments.items():
        if key.endswith(".exp_avg_sq") and (value < 0).any():
            return f"moment '{key}' has a negative entry ({float(value.min()):.3g}): exp_avg_sq must be >= 0"
    for key, value in moments.items():
        sq = moments.get(key[: -len("exp_avg")] + "exp_avg_sq") if key.endswith(".exp_avg") else None
        if sq is not None and tuple(sq.shape) == tuple(value.shape):
            excess = value.detach().double().abs() - ADAM_RATIO * sq.detach().double().clamp(min=0).sqrt()
            if (excess > 1e-12).any():
                return (f"moment '{key}' exceeds {ADAM_RATIO:.3g} x sqrt(exp_avg_sq) (by up to "
                        f"{float(excess.max()):.3g}): no sequence of gradients gives Adam such moments")
        if key.endswith(".step"):
            step = float(value.reshape(-1)[0]) if value.numel() else float("nan")
            start = float(sent[key].reshape(-1)[0]) if sent and key in sent and sent[key].numel() else 0.0
            if not start + 1 - 1e-6 <= step <= start + max_steps + 1e-6:
                return (f"moment '{key}' = {step:g} is outside [{start + 1:g}, {start + max_steps:g}] (the step sent "
                        f"{start:g} plus 1 .. {max_steps} steps of this round)")
    return None


def first_nonfinite(obj, prefix: str = "", max_abs: float = MAX_ABS) -> str | None:
    """What is wrong with the first floating tensor or number that is NaN, Inf or beyond ``max_abs``.

    The message names its key (the dotted path through nested dicts); None if every value is fine.
    """
    if torch.is_tensor(obj):
        if obj.is_floating_point() or obj.is_complex():
            if not torch.isfinite(obj).all():
                return f"'{prefix}' holds NaN or Inf"
            if obj.numel() and float(obj.abs().max()) > max_abs:
                return f"'{prefix}' holds a value of magnitude {float(obj.abs().max()):.3g} (> {max_abs:g})"
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) and abs(obj) <= max_abs else f"'{prefix}' is {obj!r}"
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            reason = first_nonfinite(value, f"{prefix}.{key}" if prefix else str(key), max_abs)
            if reason:
                return reason
    return None
