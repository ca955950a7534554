"""results.json's round history and test metrics in the files FLARE 2.9 users' tools read.

FLARE 2.9's ``MetricsArtifactWriter`` (``nvflare.app_common.widgets.metrics_artifact_writer``) writes
``metrics/round_metrics.jsonl`` (one JSON object per round) and ``metrics/metrics_summary.json`` in the server's
job folder; ``nvflare job download`` lists them as the job's ``round_metrics`` / ``metrics_summary`` artifacts.
pflseg's controllers do not fire the events that writer listens to, so they write the same files themselves
(``RoundController``: the jsonl after every round, both at the end, next to results.json), in FLARE's schema:

- a round: ``{"round": r (0-based, FLARE's count; results.json's history counts from 1: r + 1),
  "aggregated_metrics": [{"name", "value"}], "sites": [{"name", "metrics": [{"name", "value"}], "weight",
  "weight_key"}], "skipped_metrics": [{"name", "reason", "site"}], "key_metric": {"name": "val_dice_mean", "mode":
  "max"}}``. Metric names are values, never keys; values are finite numbers or
  booleans (anything else is listed in ``skipped_metrics`` with its reason, as FLARE does). A site's metrics are
  the ones it reported that round (``history[r].site_metrics``) plus the server's per-site entries of the round
  (``val_dice``, ``site_compute_seconds``); its weight is its training samples (n_samples, the n_k of
  NUM_STEPS_CURRENT_ROUND). The aggregated metrics are the round's numeric entries (``val_dice_mean``: the sites'
  validation Dice combined by the aggregation rule, n_k-weighted by default; ``wall_seconds``).
- the summary: FLARE's fields (``schema_version`` "1", ``status``, ``final_round``, ``final_aggregated_metrics``,
  ``round_metrics_file``, ``notes``, ``job_name``, ``metric_source``, ``metric_split``, ``key_metric``,
  ``best_round``, ``best_aggregated_metrics``) and one of pflseg's own, ``test_metrics``: every numeric test
  metric of every model a site scored, ``[{"site", "model", "name", "value"}]`` (per-class lists as
  ``<name>_<class index>``).
"""

from __future__ import annotations

import json
import math
import numbers

FOLDER = "metrics"
SUMMARY = "metrics_summary.json"
ROUNDS = "round_metrics.jsonl"
KEY_METRIC = {"name": "val_dice_mean", "mode": "max"}
WEIGHT_KEY = "NUM_STEPS_CURRENT_ROUND"
#: history entries that are not metrics
_NOT_METRICS = ("round", "site_metrics")


def _value(value):
    """``(value, None)`` for a finite number or a bool (FLARE's accepted values), else ``(None, reason)``."""
    if isinstance(value, bool):
        return value, None
    if isinstance(value, numbers.Integral):
        return int(value), None
    if isinstance(value, numbers.Real):
        return (float(value), None) if math.isfinite(value) else (None, "non_finite_number")
    return None, "unsupported_type"


def _metrics(items: dict, skipped: list, site: str | None = None) -> list[dict]:
    out = []
    for name, value in items.items():
        value, reason = _value(value)
        if reason:
            skipped.append({"name": str(name), "reason": reason, **({"site": site} if site is not None else {})})
        else:
            out.append({"name": str(name), "value": value})
    return out


def round_record(entry: dict) -> dict:
    """One line of ``round_metrics.jsonl`` from one ``results.json`` history entry."""
    per_site = {k: v for k, v in entry.items() if k not in _NOT_METRICS and isinstance(v, dict)}
    skipped: list[dict] = []
    aggregated = _metrics({k: v for k, v in entry.items() if k not in _NOT_METRICS and k not in per_site}, skipped)
    reported = entry.get("site_metrics") or {}
    sites = []
    for site in sorted(set(reported) | {s for values in per_site.values() for s in values}):
        values = dict(reported.get(site) or {})
        for key, by_site in per_site.items():
            if site in by_site and key not in values:
                values[key] = by_site[site]
        record = {"name": site, "metrics": _metrics(values, skipped, site)}
        weight, _ = _value(values.get("n_samples"))
        if isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0:
            record.update(weight=weight, weight_key=WEIGHT_KEY)
        sites.append(record)
    return {"round": entry["round"] - 1, "aggregated_metrics": aggregated, "sites": sites, "skipped_metrics": skipped,
            "key_metric": dict(KEY_METRIC)}


def round_lines(history: list[dict]) -> str:
    """``round_metrics.jsonl``: one compact JSON object per history entry (round), in round order."""
    return "".join(json.dumps(round_record(e), allow_nan=False, separators=(",", ":")) + "\n" for e in history)


def test_metrics(test: dict) -> list[dict]:
    """Every numeric test metric of every model of every site: ``[{"site", "model", "name", "value"}]``."""
    out = []
    for site, models in sorted((test or {}).items()):
        for model, metrics in sorted((models or {}).items()):
            if not isinstance(metrics, dict):
                continue
            for name, value in sorted(metrics.items()):
                values = enumerate(value) if isinstance(value, list) else [(None, value)]
                for index, item in values:
                    item, reason = _value(item)
                    if reason is None and not isinstance(item, bool):
                        key = name if index is None else f"{name}_{index}"
                        out.append({"site": site, "model": model, "name": key, "value": item})
    return out


def summary(results: dict) -> dict | None:
    """``metrics_summary.json`` of a finished training job's ``results.json``; None without rounds (as FLARE)."""
    history = results.get("history") or []
    if not history:
        return None
    final = round_record(history[-1])
    best_round = results.get("best_global_round")
    out = {
        "schema_version": "1",
        "status": "metrics_reported",
        "final_round": final["round"],
        "final_aggregated_metrics": final["aggregated_metrics"],
        "round_metrics_file": ROUNDS,
        "notes": [
            "Written by pflseg's server controller from results.json (pflseg.flare.metrics_files).",
            "val_dice_mean combines the sites' validation Dice by the job's aggregation rule (robust.aggregation; "
            "mean = n_k-weighted).",
            "test_metrics: each site's final test of each model it scored (Dice per case over classes, IoU, ASSD and "
            "HD95 in pixels).",
        ],
        "job_name": results.get("job"),
        "metric_source": "site_validation",
        "metric_split": "validation",
        "key_metric": dict(KEY_METRIC),
        "test_metrics": test_metrics(results.get("test") or {}),
    }
    if isinstance(best_round, int) and not isinstance(best_round, bool) and best_round >= 0:
        out["best_round"] = best_round  # == len(history): the final global model, scored after the last round
        # the model after k rounds is scored as the (k+1)-th round starts: history round k + 1, FLARE's round k
        best = next((e for e in history if e.get("round") == best_round + 1), None)
        if best is not None:
            out["best_aggregated_metrics"] = round_record(best)["aggregated_metrics"]
    return out
