"""The server's guard against one site that lies (issue 23 item 2), wired into ``RoundController``.

Each answer is first checked on its own (``RoundController.check_result``: exact keys, shapes, dtypes, finite
values, n_k a positive integer under ``max_n_samples``). What one answer alone cannot show, the round's answers
together can; the config section ``robust`` (``app_configs/defaults.yaml``) sets the bounds:

- ``screen`` (in ``send_each``, after the per-answer checks): a site whose update norm (the whole update, or one
  model tensor it was sent; not optimizer moments, ``NOT_PER_TENSOR``) exceeds ``robust.norm_ratio`` x the median
  of the other sites' is left out of the round, named in ``missing`` with the reason; then each n_k is capped at
  ``robust.n_k_ratio`` x the median of the other sites' n_k (the capped value is the site's weight everywhere:
  aggregation, best-model selection, its first accepted n_k), named in the log and in results.json ``n_k_capped``.
- ``aggregate`` / ``robust_args``: the aggregation rule of every method that averages (``robust.aggregation``:
  mean | median | trimmed_mean, ``robust.trim``; ``pflseg.algorithms.robust``).
- ``validation_score``: the best global model is chosen on the sites' validation Dice combined by the same
  rule, weighted by the (capped) n_k for ``mean``.
- ``snapshot`` / ``keep_finite`` (around each round in ``run_rounds``): an aggregate holding NaN / Inf (or an
  absurd magnitude) is not used: the server keeps its previous state (global model; FedSM's selector, moments
  and personalized models too), says so in the log, the round's history (``aggregate_rejected``) and
  results.json ``aggregates_rejected``.

The math is in ``pflseg.algorithms.robust``; this module only moves answers and config to it.
"""

from __future__ import annotations

import math
import statistics

import torch
from nvflare.app_common.abstract.fl_model import FLMetaKey

from pflseg.algorithms.robust import aggregate as robust_aggregate
from pflseg.algorithms.robust import bounded_weights, combine_rows, first_nonfinite, norm_outliers, norm_ratios

N_K = FLMetaKey.NUM_STEPS_CURRENT_ROUND
#: keys not bounded tensor by tensor (the whole update still is): optimizer moments. Honest sites' Adam second
#: moments differ by orders of magnitude (measured on the synthetic sites: one tensor's exp_avg_sq update 2000x
#: the other sites' median in an honest FedSM round); FedSM checks them with ``check_moments`` instead.
NOT_PER_TENSOR = ("moment.",)


def robust_args(cfg: dict) -> dict:
    """``{"rule", "trim"}`` of the job's ``robust`` section, for the aggregation functions."""
    return {"rule": cfg["robust"]["aggregation"], "trim": cfg["robust"]["trim"]}


def aggregate(cfg: dict, states, weights, keys=None) -> dict:
    """The job's aggregation rule over ``states`` (``pflseg.algorithms.robust.aggregate``)."""
    return robust_aggregate(states, weights, keys, **robust_args(cfg))


def screen(ctrl, task: str, payloads: dict, usable: dict, reference: dict | None) -> None:
    """Leave out of ``usable`` (in place, ``send_each``'s answers with their ``site_metrics``) the sites whose update
    is beyond the norm bound; cap the others' n_k (noted in ``usable.site_metrics``)."""
    bounds = ctrl.cfg["robust"]
    if reference and len(usable) >= 2 and bounds["norm_ratio"] > 0:
        answers = {s: res.params or {} for s, res in usable.items()}
        sent = {s: (payloads[s].params or {}) for s in usable}
        whole, tensor, key = norm_ratios(answers, sent, NOT_PER_TENSOR)
        ctrl.info(f"{task}: update norms: at most {whole:.3g} x the other sites' median (whole update), {tensor:.3g} x "
                  f"(one tensor{', ' + key if key else ''}); bound {bounds['norm_ratio']:g} x")
        for site, reason in norm_outliers(answers, sent, bounds["norm_ratio"], NOT_PER_TENSOR).items():
            ctrl.error(f"{task}: site {site} left out of this round: {reason}")
            ctrl.missing[site] = reason
            del usable[site]
            usable.site_metrics.pop(site, None)
    weighted = {s: res for s, res in usable.items() if isinstance(res.meta, dict) and res.meta.get(N_K) is not None}
    if len(weighted) < 2 or bounds["n_k_ratio"] <= 0:
        return
    raw = [res.meta[N_K] for res in weighted.values()]
    for (site, res), n_k, cap in zip(weighted.items(), raw, bounded_weights(raw, bounds["n_k_ratio"])):
        if cap < n_k:
            capped = max(1, math.floor(cap))
            res.meta[N_K] = capped
            note = f"n_k {n_k} capped to {capped} ({bounds['n_k_ratio']:g} x the median of the other sites' n_k)"
            ctrl.warning(f"{task}: site {site}: {note}")
            # in the round's site metrics: the history is checkpointed, so a resumed job still reports it
            usable.site_metrics.setdefault(site, {}).update(n_k_claimed=n_k, n_k_capped=capped)


def validation_score(scores: list[tuple[float, float]], cfg: dict) -> float:
    """The round's validation score from ``(value, n_k)`` per site: the n_k-weighted mean (n_k capped by
    ``screen``) for ``robust.aggregation: mean``; else the rule's combination (median: unweighted)."""
    args = robust_args(cfg)
    if args["rule"] == "mean":
        return sum(s * n for s, n in scores) / sum(n for _, n in scores)
    if args["rule"] == "median":
        return float(statistics.median(s for s, _ in scores))
    block = torch.tensor([[float(s)] for s, _ in scores], dtype=torch.float64)
    return float(combine_rows(block, [float(n) for _, n in scores], **args)[0])


def guarded(ctrl) -> tuple[str, ...]:
    """The controller's aggregated server state: its attribute names (``guarded_states``; the global model)."""
    return tuple(getattr(ctrl, "guarded_states", ("global_state",)))


def _copy(obj):
    return {k: _copy(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


def snapshot(ctrl) -> dict:
    """The guarded state before a round (dicts copied, tensors shared: aggregation makes new tensors)."""
    return {name: _copy(getattr(ctrl, name)) for name in guarded(ctrl) if hasattr(ctrl, name)}


def keep_finite(ctrl, r: int, before: dict) -> str | None:
    """After round ``r``: if any guarded state holds NaN / Inf (or a value beyond ``MAX_ABS``), put every guarded
    state back as it was before the round, with a log line. Returns that note (the round's ``aggregate_rejected``),
    or None when the round's state is kept."""
    for name in before:
        reason = first_nonfinite(getattr(ctrl, name), name)
        if reason:
            for kept, value in before.items():
                setattr(ctrl, kept, value)
            note = f"the aggregate of round {r + 1} was not used: {reason}; the server kept its previous model"
            ctrl.error(note)
            return note
    return None


def result_notes(ctrl) -> dict:
    """results.json entries of the guard, only when it acted, both read from the history (checkpointed: a resumed
    job keeps them): ``aggregates_rejected`` {round: note}, ``n_k_capped`` {site: note of its latest cap}."""
    out = {}
    rejected = {str(h["round"]): h["aggregate_rejected"] for h in ctrl.history if "aggregate_rejected" in h}
    if rejected:
        out["aggregates_rejected"] = rejected
    capped = {site: f"n_k {m['n_k_claimed']} capped to {m['n_k_capped']} (round {h['round']})"
              for h in ctrl.history for site, m in (h.get("site_metrics") or {}).items()
              if isinstance(m, dict) and "n_k_capped" in m}
    if capped:
        out["n_k_capped"] = capped
    return out
