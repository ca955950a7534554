"""Result tables: per-site test Dice of each method's model for that site (the inside protocol)."""

from __future__ import annotations

from pflseg.eval.markdown import markdown_table
from pflseg.flare.methods import METHODS
from pflseg.infer.routing import LABELS as ROUTE_LABELS
from pflseg.infer.routing import METHODS as ROUTE_METHODS


def label(results: dict, job: str) -> str:
    """A run's column name: its method's table label (``Method.label``), else the job's name."""
    entry = METHODS.get(results["method"])
    return entry.label if entry is not None and entry.label else job


def site_dice(results: dict) -> dict[str, float]:
    """Per-site test Dice of the model the method gives each site: the selected global model for global
    methods, the site's own best-by-validation model otherwise."""
    key = "site" if METHODS[results["method"]].site.personalized else "global"
    return {site: metrics[key]["dice"] for site, metrics in sorted(results["test"].items())}


def dice_table(all_results: dict[str, dict]) -> str:
    """Markdown table: one row per site (plus the mean), one column per job."""
    columns = {name: site_dice(res) for name, res in all_results.items()}
    sites = sorted({s for col in columns.values() for s in col})
    names = list(columns)
    rows = [[site, *(f"{columns[n][site]:.4f}" if site in columns[n] else "-" for n in names)] for site in sites]
    rows.append(["mean", *(f"{sum(columns[n].values()) / max(len(columns[n]), 1):.4f}" for n in names)])
    return markdown_table(["site", *(label(all_results[n], n) for n in names)], rows)


#: columns of the per-site test table (``metric_rows``): one row per site and model the site scored
METRIC_COLUMNS = ["site", "model", "reported", "dice", "dice_per_class", "iou", "assd", "hd95", "n_cases",
                  "selected_round"]


def metric_rows(results: dict) -> list[dict]:
    """Per-site test metrics of every model a site scored (``global``, ``site``, ...): one row each;
    ``reported`` marks the model the Dice tables use for that site."""
    reported = "site" if METHODS[results["method"]].site.personalized else "global"
    rows = []
    for site, models in sorted(results["test"].items()):
        for model, m in models.items():
            if not isinstance(m, dict) or "dice" not in m:
                continue
            rows.append({
                "site": site, "model": model, "reported": "yes" if model == reported else "",
                "dice": round(m["dice"], 4),
                "dice_per_class": " ".join(f"{d:.4f}" for d in m.get("dice_per_class", [])),
                "iou": round(m["iou"], 4) if m.get("iou") is not None else "",
                "assd": round(m["assd"], 3) if m.get("assd") is not None else "",
                "hd95": round(m["hd95"], 3) if m.get("hd95") is not None else "",
                "n_cases": m.get("n_cases", ""), "selected_round": m.get("selected_round", ""),
            })
    return rows


def metric_table(rows: list[dict]) -> str:
    """Markdown of ``metric_rows``."""
    return markdown_table(METRIC_COLUMNS, [[r[c] for c in METRIC_COLUMNS] for r in rows])


def timing_summary(results: dict) -> str:
    """Wall time, peak memory and the per-round split into local work (slowest site) and FLARE overhead."""
    rounds = results["history"]
    wall = [h["wall_seconds"] for h in rounds]
    work = [max(h["site_compute_seconds"].values(), default=0.0) for h in rounds]
    fp = results.get("footprint", {})
    steady = rounds[1:] or rounds  # round 1 includes the sites' start-up (data loading, caching)
    w = sum(h["wall_seconds"] for h in steady) / len(steady)
    c = sum(max(h["site_compute_seconds"].values(), default=0.0) for h in steady) / len(steady)
    return (
        f"{results['job']}: {len(rounds)} rounds, {len(results['sites'])} sites; "
        f"wall {fp.get('wall_seconds', sum(wall)):.1f} s, peak memory {fp.get('peak_rss_gib', float('nan')):.2f} GiB; "
        f"first round {wall[0]:.2f} s (site work {work[0]:.2f} s); later rounds {w:.2f} s each = "
        f"{c:.2f} s site work (local training + validation, slowest site) + {w - c:.2f} s FLARE overhead"
    )


def infer_table(results: dict) -> str:
    """FedSM inference job: per site, the global, own personalized (inside sites) and super model Dice per gamma."""
    routes = sorted({r for site in results["infer"].values() for r in site["super"]})
    rows = []
    for name, site in sorted(results["infer"].items()):
        person = site["personalized"]
        rows.append([f"{name}{'' if site['inside'] else ' (outside)'}", f"{site['global']['dice']:.4f}",
                     "-" if person is None else f"{person['dice']:.4f}",
                     *(f"{site['super'][r]['dice']:.4f}" if r in site["super"] else "-" for r in routes)])
    return markdown_table(["site", "global", "personalized", *(f"super {r}" for r in routes)], rows)


def route_table(results: dict) -> str:
    """Markdown: one row per routed site, one column per method (Dice), from the routing job's results.json."""
    rows = results["route"]
    methods = [m for m in ROUTE_METHODS if all(m in r["methods"] for r in rows.values())]
    return markdown_table(["outside site", *(ROUTE_LABELS.get(m, m) for m in methods), "routing s/sample/epoch"], [
        [site, *(f"{r['methods'][m]['dice']:.4f}" if r["methods"][m]["dice"] is not None else "-" for m in methods),
         f"{r['seconds_per_sample']:.4f}"] for site, r in sorted(rows.items())])


def run_tables(results: dict, job: str) -> list[str]:
    """What ``pflseg run`` prints for job ``job``'s results.json: a post-training job's own table (its results'
    ``report``: the Markdown the job wrote for itself, e.g. the cross-site matrix; ``route``: the outside sites'
    routing table; ``infer``: FedSM inference), else the per-site Dice table and the timing line."""
    if "report" in results:
        return [results["report"]["markdown"]]
    if "route" in results:
        return [route_table(results)]
    if "infer" in results:
        return [infer_table(results)]
    return [dice_table({job: results}), timing_summary(results)]
