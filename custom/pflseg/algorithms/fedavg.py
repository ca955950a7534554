"""FedAvg (McMahan et al., 2017): the n_k-weighted mean of client states.

    w <- sum_k p_k w_k,   p_k = n_k / sum_j n_j

Applied key by key over the full state (trainable parameters and normalisation buffers alike), so
batch-norm running statistics are averaged too. Integer buffers (BN's ``num_batches_tracked``) are
averaged in float and rounded back. See pflseg/algorithms/METHODS.md, section "Baselines".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

State = Mapping[str, torch.Tensor]

#: elements per float64 block of the server's element-wise work (``weighted_average``, ``robust.squared_norm``):
#: 2 MiB, so a block's buffers stay in cache
BLOCK = 1 << 18


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """Return ``weights / sum(weights)``; raise ValueError on negative, non-finite or all-zero weights."""
    w = [float(x) for x in weights]
    if not w:
        raise ValueError("weights: need at least one client")
    if any(not (x >= 0.0) or x == float("inf") for x in w):
        raise ValueError(f"weights: every weight must be finite and >= 0, got {w}")
    total = sum(w)
    if total <= 0.0:
        raise ValueError(f"weights: sum must be > 0, got {w}")
    return [x / total for x in w]


def weighted_average(states: Sequence[State], weights: Sequence[float], keys: Sequence[str] | None = None) -> dict:
    """Weighted mean of ``states`` key by key.

    Args:
        states: K client states with the same keys, shapes and dtypes (a mismatch is a ValueError naming
            the key: no state decides the dtype of the others' average).
        weights: K non-negative weights (e.g. n_k); normalised here.
        keys: keys to average (default: all keys of the first state).

    Returns:
        A new dict, each key in the states' dtype (accumulated in float64); inputs are never modified.
    """
    if len(states) != len(weights):
        raise ValueError(f"states/weights: {len(states)} states but {len(weights)} weights")
    p = normalized_weights(weights)
    keys = list(states[0].keys()) if keys is None else list(keys)
    for key in keys:
        ref = states[0][key]
        for i, s in enumerate(states):
            if key not in s:
                raise KeyError(f"state {i} has no key '{key}'")
            if s[key].shape != ref.shape:
                raise ValueError(f"key '{key}': state {i} has shape {tuple(s[key].shape)}, state 0 {tuple(ref.shape)}")
            if s[key].dtype != ref.dtype:
                raise ValueError(f"key '{key}': state {i} has dtype {s[key].dtype}, state 0 {ref.dtype}")
    # acc += p_k * float64(w_k) element by element, in site order, BLOCK elements at a time into two reused buffers:
    # element-wise, so the result is the same bit for bit as over whole tensors; whole-tensor float64 temporaries
    # made this step 1.7x a plain float32 average (8.2 M parameters, 6 sites; 2.4-4.5x with fresh ones per site),
    # blocks 0.8x (docs/speed.md)
    size = min(BLOCK, max((states[0][k].numel() for k in keys), default=0))
    acc_buf, term_buf = torch.empty(size, dtype=torch.float64), torch.empty(size, dtype=torch.float64)
    out = {}
    for key in keys:
        ref = states[0][key]
        flat = [s[key].detach().reshape(-1) for s in states]
        res = torch.empty(ref.numel(), dtype=ref.dtype)
        for i in range(0, ref.numel(), BLOCK):
            m = min(BLOCK, ref.numel() - i)
            acc, term = acc_buf[:m].zero_(), term_buf[:m]
            for pk, f in zip(p, flat):
                acc.add_(term.copy_(f[i:i + m]).mul_(pk))
            res[i:i + m] = acc if ref.is_floating_point() else acc.round()
        out[key] = res.reshape(ref.shape)
    return out
