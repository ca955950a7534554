"""GRACE, server side (Zhang et al., MICCAI 2023): consistency-enhanced re-weighting of client updates.

With K sites, global model theta_g and local models theta_k (trainable parameters only):

    g_k      = theta_g - theta_k                                   (update of site k)
    Sigma_ij = cos(g_i, g_j)                                       (K x K similarity)
    c_k      = sum_j Sigma_kj            (self "include", paper)
             | mean_{j != k} Sigma_kj    (self "exclude", reference code)
    c        <- c - min c + 1e-3   if min c <= 0;   c <- c / max c   if max c > 1
    p'_k     = c_k p_k / sum_j c_j p_j                             (p_k = n_k / sum_j n_j)
    theta_g  <- theta_g - eta_g * sum_k p'_k g_k

Normalisation buffers (BN running statistics) are averaged with p'. With eta_g = 1 the step is the
p'-weighted mean of the local models, so with uniform consistency (e.g. K = 2, or identical updates)
it is FedAvg.

Similarity modes: ``total`` (default) is the cosine of the whole flattened update; ``split`` is the
per-tensor cosine averaged over tensors; ``reweight`` is the per-tensor cosine weighted by
``linspace(1, 0, L)`` normalised to mean 1, in the given tensor order (state-dict order, i.e. forward
order for the project's UNet: shallow layers count more). All three come from per-tensor Gram matrices
G_l = U_l U_l^T (K x K), accumulated in float64 over chunks of parameters, so the cost is one pass over
the updates whatever K is, the memory is bounded, and ``total`` (G = sum_l G_l) stays exact for tens of
millions of parameters. The cosine with a zero-norm update is defined as 0 (diagonal included): a site
that sent no change neither supports nor opposes anybody.

Paper vs reference code (``self_mode``). The paper's Eq. 3 sums the row of Sigma with its diagonal,
c_k = 1 + sum_{j != k} cos(g_k, g_j): every c_k carries the same 1 (its own similarity), so unless the
cosines between sites are large next to 1 the c_k differ little and p' stays close to the n_k shares p:
the paper's rule can only nudge FedAvg's weights. The authors' public code uses another rule
(``exclude``): c_k = the MEAN cosine with the other sites' updates, self left out; if the smallest of
those is negative, every c is shifted by -min c + 1e-3 (the least consistent site keeps only 1e-3), then
divided by max c when above 1, and only then multiplied by p_k and normalised. Its c_k are spread over the
cross-site cosines alone, so its weights can move far from p (a site whose update opposes the others' gets
almost none). ``include`` (the paper) is the default; ``exclude`` is reachable from config (job
``grace_refcode``) so that both can be measured.

Where this deviates from the reference code: the shift is applied when min c <= 0 (the code tests
``< 0``), so p'_k > 0 also when some c_k is exactly 0 (e.g. a site with an all-zero update), as the paper
requires p' in (0, 1). The division by max c does not change p' (p' is invariant to scaling c); it is
kept for parity with the code.

The client side (meta-learning with feature alignment) is in ``grace_meta.py`` and ``alignment.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from pflseg.algorithms.fedavg import normalized_weights
from pflseg.algorithms.fedbn import norm_keys
from pflseg.algorithms.robust import aggregate, check_rule, combine_rows

State = Mapping[str, torch.Tensor]

MODES = ("total", "split", "reweight")
SELF_MODES = ("include", "exclude")
SHIFT_EPS = 1e-3
GRAM_CHUNK_ELEMENTS = 1 << 22  # 4M float64 values (32 MiB) per chunk of the Gram accumulation
#: ``grace_step`` keeps the float64 update blocks of the Gram pass for the step when they fit in this many bytes
#: (K = 6 sites of an 8 M parameter UNet: 395 MB); above it, each block is recomputed for the step (same values)
KEEP_BLOCKS_BYTES = 1 << 30
ALIGN_ELEMENTS = 8  # 64 bytes of float64: torch's CPU allocator alignment


def grace_keys(model: nn.Module) -> tuple[list[str], list[str]]:
    """The key groups GRACE needs, from the network itself.

    Returns:
        ``(trainable_keys, buffer_keys)`` in state-dict order: the parameters with ``requires_grad``,
        and the remaining state of normalisation layers (found by module type with
        :func:`pflseg.algorithms.fedbn.norm_keys`: running mean / var, ``num_batches_tracked``).
    """
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    norm = norm_keys(model)
    order = list(model.state_dict().keys())
    return [k for k in order if k in trainable], [k for k in order if k in norm and k not in trainable]


def _check_keys(global_state: State, client_states: Sequence[State], keys: Iterable[str]) -> None:
    for key in keys:
        if key not in global_state:
            raise KeyError(f"global_state has no key '{key}'")
        ref = global_state[key]
        for i, s in enumerate(client_states):
            if key not in s:
                raise KeyError(f"client state {i} has no key '{key}'")
            if s[key].shape != ref.shape:
                raise ValueError(
                    f"key '{key}': client state {i} has shape {tuple(s[key].shape)}, global {tuple(ref.shape)}"
                )


def _update_block(global_state: State, client_states: Sequence[State], key: str, dtype: torch.dtype,
                  buffer: torch.Tensor | None = None) -> torch.Tensor:
    """(K, p) block of the updates g_k = theta_g - theta_k for one tensor, on the CPU in ``dtype``.

    Each row is one subtraction written in place: theta_k is promoted to ``dtype`` inside the kernel (an exact
    widening), so the values are those of ``g.to(dtype) - theta_k.to(dtype)`` without a converted copy of every
    client tensor and a stacked copy of them all. With ``buffer`` (flat, ``dtype``, at least K p elements) the
    block is a contiguous view of its start, overwritten by the next call: no fresh pages to fault in per tensor.
    """
    g = global_state[key].detach().to("cpu", dtype).reshape(-1)
    shape = (len(client_states), g.numel())
    if buffer is not None and buffer.dtype == dtype and buffer.numel() >= shape[0] * shape[1]:
        block = buffer[:shape[0] * shape[1]].view(shape)
    else:
        block = torch.empty(shape, dtype=dtype)
    for i, s in enumerate(client_states):
        torch.sub(g, s[key].detach().to("cpu").reshape(-1), out=block[i])
    return block


def update_vectors(global_state: State, client_states: Sequence[State], keys: Sequence[str]) -> torch.Tensor:
    """Stack the flattened updates g_k = theta_g - theta_k over ``keys``.

    Args:
        global_state: the round's global model.
        client_states: K local models with the same keys and shapes.
        keys: trainable keys, concatenated in this order.

    Returns:
        (K, P) tensor on the CPU, P = total number of elements of ``keys``; float64 when any input is
        float64, float32 otherwise.
    """
    keys = list(keys)
    if not client_states:
        raise ValueError("client_states: need at least one client")
    if not keys:
        raise ValueError("keys: need at least one key")
    _check_keys(global_state, client_states, keys)
    dtype = torch.float32
    for key in keys:
        for t in [global_state[key], *(s[key] for s in client_states)]:
            dtype = torch.promote_types(dtype, t.dtype) if t.is_floating_point() else dtype
    return torch.cat([_update_block(global_state, client_states, k, dtype) for k in keys], dim=1)


def _gram(block: torch.Tensor, chunk_elements: int) -> torch.Tensor:
    """G = U U^T (K x K, float64) of a (K, p) block, accumulated over column chunks of bounded size."""
    k = block.shape[0]
    cols = max(1, chunk_elements // max(k, 1))
    gram = torch.zeros(k, k, dtype=torch.float64, device=block.device)
    for start in range(0, block.shape[1], cols):
        x = block[:, start:start + cols].to(torch.float64)
        gram += x @ x.T
    return gram


def _cosine_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Cosine matrix from a Gram matrix; 0 wherever one of the two updates has zero norm."""
    norms = gram.diagonal().clamp_min(0.0).sqrt()
    denom = norms[:, None] * norms[None, :]
    cos = torch.where(denom > 0, gram / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(gram))
    return cos.clamp(-1.0, 1.0)


def _similarity_from_grams(grams: Sequence[torch.Tensor], mode: str) -> torch.Tensor:
    for g in grams:
        bad = (~torch.isfinite(g.diagonal())).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"updates: client(s) {bad} contain NaN or inf; refusing to aggregate")
    if mode == "total":
        return _cosine_from_gram(torch.stack(list(grams)).sum(0))
    cos = torch.stack([_cosine_from_gram(g) for g in grams])  # (L, K, K)
    if mode == "split":
        return cos.mean(0)
    lin = torch.linspace(1.0, 0.0, len(grams), dtype=torch.float64, device=cos.device)
    w = lin / lin.mean()
    return (w[:, None, None] * cos).mean(0)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: unknown similarity '{mode}'; known: {', '.join(MODES)}")


def similarity(
    updates: torch.Tensor | Sequence[torch.Tensor], mode: str = "total", *, chunk_elements: int = GRAM_CHUNK_ELEMENTS
) -> torch.Tensor:
    """K x K cosine similarity of client updates, from Gram matrices (never K^2 passes).

    Args:
        updates: a list of L per-tensor blocks, each (K, p_l) (or (K, *shape), flattened here), in
            layer order; or the stacked (K, P) matrix (``total`` only: it has no tensor boundaries).
        mode: ``total`` (cosine of the whole flattened update), ``split`` (per-tensor cosine, mean over
            tensors) or ``reweight`` (per-tensor cosine weighted by linspace(1, 0, L) / mean).
        chunk_elements: bound on the float64 elements converted at once while accumulating a Gram.

    Returns:
        (K, K) float64 symmetric matrix on the CPU. The cosine with a zero-norm update is 0.
    """
    _check_mode(mode)
    if torch.is_tensor(updates):
        if mode != "total":
            raise ValueError(
                f"updates: mode '{mode}' needs the list of per-tensor (K, p_l) blocks, got one stacked matrix"
            )
        if updates.dim() != 2:
            raise ValueError(f"updates: the stacked matrix must be (K, P), got shape {tuple(updates.shape)}")
        blocks = [updates]
    else:
        blocks = [b.reshape(b.shape[0], -1) if b.dim() > 0 else b for b in updates]
    if not blocks:
        raise ValueError("updates: need at least one block")
    k = blocks[0].shape[0] if blocks[0].dim() > 0 else 0
    for i, b in enumerate(blocks):
        if b.dim() != 2 or b.shape[0] != k or not b.is_floating_point():
            raise ValueError(f"updates: block {i} must be a floating (K={k}, p) tensor, got {b.dtype} {tuple(b.shape)}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return _similarity_from_grams([_gram(b, chunk_elements).cpu() for b in blocks], mode)


def consistency(sim: torch.Tensor, self_mode: str = "include") -> torch.Tensor:
    """Consistency c_k of each site from the similarity matrix.

    Args:
        sim: (K, K) similarity.
        self_mode: ``include`` (paper: row sum with the diagonal, c_k = 1 + sum_{j != k} Sigma_kj for
            non-zero updates) or ``exclude`` (reference code: mean over j != k, needs K >= 2). Either may
            be negative; :func:`reweight_probs` shifts them before normalising.

    Returns:
        (K,) tensor, dtype of ``sim``.
    """
    if sim.dim() != 2 or sim.shape[0] != sim.shape[1]:
        raise ValueError(f"sim must be a square (K, K) matrix, got shape {tuple(sim.shape)}")
    if self_mode == "include":
        return sim.sum(1)
    if self_mode == "exclude":
        k = sim.shape[0]
        if k < 2:
            raise ValueError(f"self_mode 'exclude' needs K >= 2 sites, got K={k}")
        return (sim.sum(1) - sim.diagonal()) / (k - 1)
    raise ValueError(f"self_mode: unknown value '{self_mode}'; known: {', '.join(SELF_MODES)}")


def reweight_probs(c: torch.Tensor | Sequence[float], p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """p'_k = c_k p_k / sum_j c_j p_j after making c positive.

    Args:
        c: (K,) consistencies (any sign).
        p: (K,) non-negative aggregation weights (e.g. n_k); normalised here.

    Returns:
        (K,) float64 weights summing to 1, each in (0, 1) when K >= 2 and every p_k > 0.
        c is shifted (c - min c + 1e-3) when min c <= 0, then divided by max c when max c > 1.
    """
    c = torch.as_tensor(c, dtype=torch.float64).detach().cpu().reshape(-1)
    p_list = p.detach().cpu().tolist() if torch.is_tensor(p) else list(p)
    if c.numel() != len(p_list):
        raise ValueError(f"c/p: {c.numel()} consistencies but {len(p_list)} weights")
    if not torch.isfinite(c).all():
        raise ValueError(f"c: consistencies must be finite, got {c.tolist()}")
    pw = torch.tensor(normalized_weights(p_list), dtype=torch.float64)
    if c.min() <= 0:
        c = c - c.min() + SHIFT_EPS
    if c.max() > 1:
        c = c / c.max()
    cp = c * pw
    return cp / cp.sum()


def grace_step(
    global_state: State,
    client_states: Sequence[State],
    weights: Sequence[float],
    eta_g: float = 1.0,
    mode: str = "total",
    self_mode: str = "include",
    trainable_keys: Sequence[str] | None = None,
    buffer_keys: Sequence[str] | None = None,
    rule: str = "mean",
    trim: float = 0.0,
) -> tuple[dict, dict]:
    """One GRACE server round.

    Args:
        global_state: the round's global model theta_g.
        client_states: K >= 2 local models after training, same keys and shapes.
        weights: K non-negative weights p_k (e.g. n_k); normalised here.
        eta_g: server learning rate (1 = p'-weighted mean of the local models).
        mode: similarity mode, see :func:`similarity`.
        self_mode: consistency mode, see :func:`consistency`.
        trainable_keys: keys of the updates (use :func:`grace_keys`); default: every floating-point key
            of ``global_state`` not in ``buffer_keys``.
        buffer_keys: normalisation buffers averaged with p' (use :func:`grace_keys`); default: none.
        rule: how the K updates (and buffers) are combined: ``mean`` (the paper's p'-weighted sum),
            ``median`` or ``trimmed_mean`` (coordinate-wise, :func:`pflseg.algorithms.robust.combine_rows`).
        trim: fraction trimmed at each end by ``trimmed_mean`` (:func:`pflseg.algorithms.robust.trim_count`);
            ignored by the other rules.

    Returns:
        ``(new_state, info)``: a new dict with every key of ``global_state`` (trainable keys stepped,
        buffers averaged with p' -- integer buffers rounded back --, other keys copied unchanged; values
        on the CPU in the global state's dtypes) and ``info = {"sim": (K, K), "consistency": (K,),
        "p_prime": (K,)}`` (float64; ``consistency`` before the shift). Inputs are never modified.
    """
    k = len(client_states)
    if k < 2:
        raise ValueError(f"GRACE needs all updates of the round from K >= 2 sites, got K={k}")
    if len(weights) != k:
        raise ValueError(f"weights: {k} client states but {len(weights)} weights")
    _check_mode(mode)
    check_rule(rule, trim)
    if self_mode not in SELF_MODES:
        raise ValueError(f"self_mode: unknown value '{self_mode}'; known: {', '.join(SELF_MODES)}")
    if not (eta_g > 0 and eta_g != float("inf")):
        raise ValueError(f"eta_g must be finite and > 0, got {eta_g}")
    buffers = list(buffer_keys) if buffer_keys is not None else []
    if trainable_keys is None:
        trainable = [key for key, v in global_state.items() if v.is_floating_point() and key not in set(buffers)]
    else:
        trainable = list(trainable_keys)
    overlap = sorted(set(trainable) & set(buffers))
    if overlap:
        raise ValueError(f"trainable_keys and buffer_keys overlap: {overlap}")
    if not trainable:
        raise ValueError("trainable_keys: no trainable keys to aggregate")
    for key in trainable:
        if key in global_state and not global_state[key].is_floating_point():
            raise ValueError(f"trainable_keys: key '{key}' is not floating point ({global_state[key].dtype})")
    _check_keys(global_state, client_states, trainable + buffers)

    # The update blocks, in float64, are needed twice: by the Gram matrices and, once p' is known, by the step.
    # Kept between the two passes (each a contiguous view of one allocation) when K P float64 values fit in
    # KEEP_BLOCKS_BYTES; otherwise one scratch block sized for the largest tensor is refilled for each tensor, twice.
    # Every kept block starts 64-byte aligned, as a fresh tensor does: BLAS may sum in another order otherwise.
    sizes = [global_state[key].numel() for key in trainable]
    spans = [-(-k * size // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for size in sizes]
    keep = 8 * sum(spans) <= KEEP_BLOCKS_BYTES
    scratch = torch.empty(sum(spans) if keep else k * max(sizes), dtype=torch.float64)
    blocks: dict[str, torch.Tensor] = {}
    grams = []
    offset = 0
    for key, size, span in zip(trainable, sizes, spans):
        block = _update_block(global_state, client_states, key, torch.float64, scratch[offset:offset + k * size])
        grams.append(_gram(block, GRAM_CHUNK_ELEMENTS))
        if keep:
            blocks[key] = block
            offset += span
    sim = _similarity_from_grams(grams, mode)
    c = consistency(sim, self_mode)
    p_prime = reweight_probs(c, weights)

    stepped = set(trainable)
    new_state = {key: v.detach().to("cpu") if key in stepped else v.detach().to("cpu").clone()
                 for key, v in global_state.items()}  # trainable entries replaced below: no clone for them
    for key in trainable:
        ref = global_state[key].detach().to("cpu")
        block = blocks[key] if keep else _update_block(global_state, client_states, key, torch.float64, scratch)
        step = (p_prime[None, :] @ block if rule == "mean"
                else combine_rows(block, p_prime.tolist(), rule, trim)).reshape(ref.shape)
        if eta_g != 1.0:  # eta_g = 1 skips an exact multiplication
            step.mul_(eta_g)
        new_state[key] = torch.sub(ref, step).to(ref.dtype)  # ref is promoted to float64 inside the kernel
    if buffers:
        new_state.update(aggregate(client_states, p_prime.tolist(), buffers, rule, trim))
    return new_state, {"sim": sim, "consistency": c, "p_prime": p_prime}
