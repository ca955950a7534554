"""SoftPull (Xu et al., CVPR 2022, FedSM): each personalized model is pulled softly towards the others.

    w_p,k <- lam * w_p,k + (1 - lam) / (K - 1) * sum_{k' != k} w_p,k',   lam in [1/K, 1]

Written as one K x K mixing matrix M applied to the stacked personalized states, key by key:

    M[k, k] = lam,   M[k, k'] = (1 - lam) / (K - 1) for k' != k,   every row of M sums to 1,

so ``W_new = M @ W`` with W the (K, numel) stack of one key. ``lam = 1`` is M = I (pure local
training); ``lam = 1/K`` makes every entry 1/K, i.e. every site gets the unweighted mean of the
personalized models (FedAvg's hard averaging with equal weights). Applied on the server to the
post-training personalized models of one round, after the global model and the selector were averaged.
See pflseg/algorithms/METHODS.md, section "FedSM with SoftPull".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

State = Mapping[str, torch.Tensor]

# Slack when comparing lam with 1/K, so that lam = 1 / K computed in float is accepted.
_LAM_TOL = 1e-12


def check_lam(lam: float, num_sites: int) -> float:
    """Return ``float(lam)`` after checking it lies in [1/K, 1] (K = ``num_sites``).

    With a single site (K = 1) there is nothing to pull towards, and any lam in [0, 1] is accepted.

    Raises:
        ValueError: naming ``lam`` and ``K`` when lam is out of range or not finite, or ``K`` when K < 1.
    """
    if isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1:
        raise ValueError(f"K (number of personalized models) must be an int >= 1, got {num_sites!r}")
    lam = float(lam)
    low = 1.0 / num_sites if num_sites >= 2 else 0.0
    if not (low - _LAM_TOL <= lam <= 1.0 + _LAM_TOL):
        raise ValueError(f"lam must be in [1/K, 1] = [{low:.6g}, 1] for K = {num_sites} sites, got lam = {lam}")
    return lam


def mixing_matrix(num_sites: int, lam: float) -> torch.Tensor:
    """The SoftPull mixing matrix.

    Args:
        num_sites: K >= 1, the number of personalized models.
        lam: weight a model keeps of itself, in [1/K, 1].

    Returns:
        float64 tensor (K, K): ``lam`` on the diagonal, ``(1 - lam) / (K - 1)`` elsewhere. The diagonal is
        computed as ``1 - (row's off-diagonal sum)``, so every row sums to 1 by construction. For K = 1
        the matrix is ``[[1.]]``.

    Raises:
        ValueError: if lam is outside [1/K, 1] or K < 1.
    """
    lam = check_lam(lam, num_sites)
    if num_sites == 1:
        return torch.ones((1, 1), dtype=torch.float64)
    off = (1.0 - lam) / (num_sites - 1)
    m = torch.full((num_sites, num_sites), off, dtype=torch.float64)
    m.fill_diagonal_(1.0 - off * (num_sites - 1))
    return m


def lam_for(lam: float, num_sites: int) -> float:
    """The lam to mix ``num_sites`` models with, lam having been set for a larger federation.

    The sites that did not answer a round stay out of its mix; over the ``num_sites`` that did, lam is at least
    1 / ``num_sites``, so that a model keeps at least as much of itself as of any other (``check_lam``'s range);
    with a single model, 1 (nothing to pull towards).
    """
    if isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1:
        raise ValueError(f"K (number of personalized models) must be an int >= 1, got {num_sites!r}")
    return max(float(lam), 1.0 / num_sites)


def softpull(states: Sequence[State], lam: float) -> list[dict]:
    """Apply SoftPull to K personalized states.

    Args:
        states: K personalized states (site order), each a mapping ``name -> tensor`` with the same keys
            and shapes.
        lam: weight a model keeps of itself, in [1/K, 1] (paper's best: 0.7 fundus, 0.3 prostate).

    Returns:
        K new dicts (same order, same keys, same dtypes; tensors on CPU). Output k, key by key, is
        ``sum_j M[k, j] * states[j][key]`` with M = ``mixing_matrix(K, lam)``, computed in float64 and cast
        back to each tensor's dtype; integer and bool buffers (e.g. ``num_batches_tracked``) are rounded
        to the nearest integer first. K = 1 returns a copy. Inputs are never modified.

    Raises:
        ValueError: if ``states`` is empty, lam is out of range, or a key's shape differs between states.
        KeyError: if the states do not have the same keys (names the key and the state).
    """
    if len(states) == 0:
        raise ValueError("states: need at least one personalized state")
    num_sites = len(states)
    m = mixing_matrix(num_sites, lam)
    keys = list(states[0].keys())
    for i, s in enumerate(states):
        missing = [k for k in keys if k not in s]
        extra = [k for k in s.keys() if k not in states[0]]
        if missing:
            raise KeyError(f"state {i} has no key '{missing[0]}' (state 0 has it)")
        if extra:
            raise KeyError(f"state {i} has key '{extra[0]}' that state 0 lacks")

    out: list[dict] = [{} for _ in range(num_sites)]
    for key in keys:
        ref = states[0][key]
        for i, s in enumerate(states):
            if s[key].shape != ref.shape:
                raise ValueError(f"key '{key}': state {i} has shape {tuple(s[key].shape)}, state 0 {tuple(ref.shape)}")
        if num_sites == 1:
            out[0][key] = ref.detach().to("cpu").clone()
            continue
        stacked = torch.stack([s[key].detach().to("cpu", torch.float64).reshape(-1) for s in states])  # (K, numel)
        mixed = m @ stacked  # (K, numel)
        for k in range(num_sites):
            value = mixed[k].reshape(ref.shape)
            if ref.is_floating_point():
                out[k][key] = value.to(ref.dtype)
            else:
                out[k][key] = value.round().to(ref.dtype)
    return out
