"""The server's guard against one site that lies (issue 23 item 2), wired into ``RoundController``.

Each answer is first checked on its own (``RoundController.check_result``: exact keys, shapes, dtypes, finite
values, n_k a positive integer under ``max_n_samples``). What one answer alone cannot show, the round's answers
together can; the config section ``robust`` (``app_configs/defaults.yaml``) sets the bounds:

- ``screen`` (in ``send_each``, after the per-answer checks): a site whose update norm (the whole update, or one
  model tensor it was sent; not optimizer moments, ``NOT_PER_TENSOR``) exceeds ``robust.norm_ratio`` x the median
  of the other sites' is left out of the round, named in ``missing`` with the reason; every other site's update is
  clipped at ``robust.clip`` x the median of the other sites' update norms (``clip``: before any method weighs it,
  so one site moves an average by at most its weight x that many honest updates), named in the log and the round's
  site metrics (``update_clipped``; every site's ``update_ratio``), results.json ``updates_clipped``; then each n_k
  is capped at ``robust.n_k_ratio`` x the median of the other sites' n_k in the server's table (their first
  accepted n_k: ``cap_n_k``; the capped value is the site's weight everywhere: aggregation, best-model selection,
  its first accepted n_k), named in the log and in results.json ``n_k_capped``.
- ``note_clips``: where a method combines what the task did not send (FedSM's epoch-mode selector gradients and
  LDA statistics, LC-Fed's coarse heads), it clips with the same rule (``pflseg.algorithms.robust``) and records the
  clip here, as ``clip`` does (``update_clipped``, ``update_ratio``).
- ``aggregate`` / ``robust_args``: the aggregation rule of every method that averages (``robust.aggregation``:
  mean | median | trimmed_mean, ``robust.trim``; ``pflseg.algorithms.robust``).
- ``validation_score``: the best global model is chosen on the sites' validation Dice combined by the same
  rule, weighted by the (capped) n_k for ``mean``.
- ``keep_finite`` (around each round in ``run_rounds``, with the server state's ``snapshot``): an aggregate holding
  NaN / Inf (or an absurd magnitude) is not used: the server keeps its previous state (the guarded parts of its
  ``ServerState``: the global model; FedSM's selector, moments and personalized models too), says so in the log,
  the round's history (``aggregate_rejected``) and results.json ``aggregates_rejected``.

The math is in ``pflseg.algorithms.robust``; this module only moves answers and config to it.
"""

from __future__ import annotations

import math
import statistics

import torch
from nvflare.app_common.abstract.fl_model import FLMetaKey

from pflseg.algorithms.robust import aggregate as robust_aggregate
from pflseg.algorithms.robust import clip_updates, combine_rows, norm_outliers, norm_ratios, update_norms
from pflseg.flare.server_state import ServerState
from pflseg.flare.wire import MOMENT

N_K = FLMetaKey.NUM_STEPS_CURRENT_ROUND
#: keys not bounded tensor by tensor (the whole update still is): optimizer moments. Honest sites' Adam second
#: moments differ by orders of magnitude (measured on the synthetic sites: one tensor's exp_avg_sq update 2000x
#: the other sites' median in an honest FedSM round); FedSM checks them with ``check_moments`` instead.
NOT_PER_TENSOR = (MOMENT + ".",)


def robust_args(cfg: dict, r: int | None = None) -> dict:
    """``{"rule", "trim"}`` of the job's ``robust`` section, for the aggregation functions; in round ``r`` (from 0)
    below ``robust.median_rounds`` the rule is ``median``."""
    robust = cfg["robust"]
    first = r is not None and r < robust.get("median_rounds", 0)
    return {"rule": "median" if first else robust["aggregation"], "trim": robust["trim"]}


def aggregate(cfg: dict, states, weights, keys=None, r: int | None = None) -> dict:
    """The job's aggregation rule (in round ``r``: ``robust_args``) over ``states``
    (``pflseg.algorithms.robust.aggregate``)."""
    return robust_aggregate(states, weights, keys, **robust_args(cfg, r))


def screen(ctrl, task: str, payloads: dict, usable: dict, reference: dict | None) -> None:
    """Leave out of ``usable`` (in place, ``send_each``'s answers with their ``site_metrics``) the sites whose update
    is beyond the norm bound; clip the others' updates (``clip``); cap their n_k (``cap_n_k``)."""
    bounds = ctrl.cfg["robust"]
    norms: tuple[dict, dict] = ({}, {})
    if reference and len(usable) >= 2 and bounds["norm_ratio"] > 0:
        answers = {s: res.params or {} for s, res in usable.items()}
        sent = {s: (payloads[s].params or {}) for s in usable}
        norms = update_norms(answers, sent)  # once for the log line and the bound
        whole, tensor, key = norm_ratios(answers, sent, NOT_PER_TENSOR, norms)
        ctrl.info(f"{task}: update norms: at most {whole:.3g} x the other sites' median (whole update), {tensor:.3g} x "
                  f"(one tensor{', ' + key if key else ''}); bound {bounds['norm_ratio']:g} x")
        for site, reason in norm_outliers(answers, sent, bounds["norm_ratio"], NOT_PER_TENSOR, norms).items():
            ctrl.error(f"{task}: site {site} left out of this round: {reason}")
            ctrl.missing[site] = reason
            del usable[site]
            usable.site_metrics.pop(site, None)
    if reference and len(usable) >= 2:
        clip(ctrl, task, payloads, usable, bounds["clip"], norms[1])
    cap_n_k(ctrl, task, usable, bounds["n_k_ratio"])


def clip(ctrl, task: str, payloads: dict, usable: dict, ratio: float, per_key: dict | None = None) -> None:
    """Clip each site's update at ``ratio`` (``robust.clip``) x the median of the other sites' update norms, in place,
    before any method weighs it (``pflseg.algorithms.robust.clip_updates``), part by part: the keys the task sent
    under one prefix (``global``, FedSM's ``person`` and ``select``, ...) together; not optimizer moments
    (``NOT_PER_TENSOR``: ``check_moments`` and ``bound_moments`` bound them) and not what the task did not send
    (statistics, gradients: no update to clip). Every site's largest ratio to the others' median goes into its
    round metrics (``update_ratio``), a clipped site's also as ``update_clipped``, with a warning. ``per_key``: the
    update norms by key and site that ``update_norms`` took of the same answers (not taken again)."""
    sites = list(usable)
    per_key = per_key or {}
    known = [{k: by_site[s] for k, by_site in per_key.items() if s in by_site} for s in sites]
    sent = [payloads[s].params or {} for s in sites]
    groups = sorted({k.split(".", 1)[0] for params in sent for k in params if not k.startswith(NOT_PER_TENSOR)})
    worst = dict.fromkeys(sites, 0.0)
    for group in groups:
        keys = sorted({k for params in sent for k in params if k.startswith(group + ".")})
        states, factors, ratios = clip_updates(sent, [usable[s].params or {} for s in sites], ratio, keys, known)
        for site, state, factor, r in zip(sites, states, factors, ratios):
            worst[site] = max(worst[site], r)
            if factor < 1.0:
                usable[site].params = state
                usable.site_metrics.setdefault(site, {})["update_clipped"] = round(r, 4)
                ctrl.warning(f"{task}: site {site}: update of '{group}' clipped from {r:.3g} x to {ratio:g} x the "
                             "median of the other sites' update norms (robust.clip)")
    for site in sites:
        usable.site_metrics.setdefault(site, {})["update_ratio"] = round(worst[site], 4)


def note_clips(ctrl, usable: dict, part: str, sites: list, factors: list, ratios: list) -> None:
    """Record a clip a method made where it combines the sites' answers (FedSM's selector gradients and LDA statistics,
    LC-Fed's coarse heads: ``pflseg.algorithms.robust``), as ``clip`` does: for each of ``sites`` that is in
    ``usable`` its round metrics' ``update_ratio`` becomes the larger of its value and this ratio; a clipped site's
    ``update_clipped`` too, with a warning naming the site and ``part``."""
    ratio = ctrl.cfg["robust"]["clip"]
    for site, factor, r in zip(sites, factors, ratios):
        if site not in usable:
            continue
        metrics = getattr(usable, "site_metrics", {}).setdefault(site, {})  # a plain dict of answers: log only
        metrics["update_ratio"] = round(max(float(metrics.get("update_ratio", 0.0)), r), 4)
        if factor < 1.0:
            metrics["update_clipped"] = round(max(float(metrics.get("update_clipped", 0.0)), r), 4)
            ctrl.warning(f"site {site}: {part} clipped from {r:.3g} x to {ratio:g} x the median of the other sites' "
                         "(robust.clip)")


def cap_n_k(ctrl, task: str, usable: dict, ratio: float) -> None:
    """Cap each answer's n_k at ``ratio`` (``robust.n_k_ratio``) x the median of the other sites' n_k in the server's
    table: each site's first accepted n_k (``ctrl.state.n_first``, checkpointed), else what it declares now. The capped
    value is its weight everywhere and becomes its first accepted n_k (which its later n_k may not exceed)."""
    weighted = {s: res for s, res in usable.items() if isinstance(res.meta, dict) and res.meta.get(N_K) is not None}
    if not weighted or ratio <= 0:
        return
    table = {**{s: res.meta[N_K] for s, res in weighted.items()}, **ctrl.state.n_first}
    if len(table) < 2:
        return
    for site, res in weighted.items():
        n_k = res.meta[N_K]
        cap = ratio * statistics.median(n for s, n in table.items() if s != site)
        if n_k > cap:
            capped = max(1, math.floor(cap))
            res.meta[N_K] = capped
            note = f"n_k {n_k} capped to {capped} ({ratio:g} x the median of the other sites' n_k)"
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


def keep_finite(state: ServerState, r: int, before: dict, error) -> str | None:
    """After round ``r``: if any guarded part of the server ``state`` holds NaN / Inf (or a value beyond ``MAX_ABS``),
    put every guarded part back as it was before the round (``before``: ``state.snapshot()``), with a log line
    (``error``). Returns that note (the round's ``aggregate_rejected``), or None when the round's state is kept."""
    reason = state.first_nonfinite()
    if not reason:
        return None
    state.rollback(before)
    note = f"the aggregate of round {r + 1} was not used: {reason}; the server kept its previous model"
    error(note)
    return note


def result_notes(ctrl) -> dict:
    """results.json entries of the guard, only when it acted, read from the history (checkpointed: a resumed job
    keeps them): ``aggregates_rejected`` {round: note}, ``n_k_capped`` {site: note of its latest cap},
    ``updates_clipped`` {site: how many rounds, the latest}."""
    out = {}
    rejected = {str(h["round"]): h["aggregate_rejected"] for h in ctrl.state.history if "aggregate_rejected" in h}
    if rejected:
        out["aggregates_rejected"] = rejected
    capped = {site: f"n_k {m['n_k_claimed']} capped to {m['n_k_capped']} (round {h['round']})"
              for h in ctrl.state.history for site, m in (h.get("site_metrics") or {}).items()
              if isinstance(m, dict) and "n_k_capped" in m}
    if capped:
        out["n_k_capped"] = capped
    clipped: dict[str, list] = {}
    for h in ctrl.state.history:
        for site, m in (h.get("site_metrics") or {}).items():
            if isinstance(m, dict) and "update_clipped" in m:
                clipped.setdefault(site, []).append((h["round"], m["update_clipped"]))
    if clipped:
        out["updates_clipped"] = {site: f"{len(rs)} round(s), the latest {rs[-1][0]} from {rs[-1][1]:g} x the others' "
                                  f"median to {ctrl.cfg['robust']['clip']:g} x" for site, rs in clipped.items()}
    return out
