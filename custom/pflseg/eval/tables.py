"""Result tables: per-site test Dice of each method's model for that site (the inside protocol)."""

from __future__ import annotations

from pflseg.flare.methods import METHODS
from pflseg.infer.routing import LABELS as ROUTE_LABELS
from pflseg.infer.routing import METHODS as ROUTE_METHODS
from pflseg.infer.routing import NORM as ROUTE_NORM
from pflseg.markdown import markdown_table


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
#: what the test table's columns and its round numbers mean (printed under it: ``metric_table``)
METRIC_LEGEND = ("reported: the model the Dice tables use for the site; dice: mean Dice per case over the classes; "
                 "assd, hd95: surface distances in pixels; selected_round: the round of the model the site scored, "
                 "0 = the initial model, k = the model after round k (rounds count from 1, as in the log and "
                 "results.json's history)")


def metric_rows(results: dict) -> list[dict]:
    """Per-site test metrics of every model a site scored (``global``, ``site``, ...): one row each;
    ``reported`` marks the model the Dice tables use for that site."""
    reported = "site" if METHODS[results["method"]].site.personalized else "global"
    best_global = results.get("best_global_round")  # the global model every site tested: chosen at the server
    rows = []
    for site, models in sorted(results["test"].items()):
        for model, m in models.items():
            if not isinstance(m, dict) or "dice" not in m:
                continue
            chosen = m.get("selected_round", best_global if model.startswith("global") else "")
            rows.append({
                "site": site, "model": model, "reported": "yes" if model == reported else "",
                "dice": round(m["dice"], 4),
                "dice_per_class": " ".join(f"{d:.4f}" for d in m.get("dice_per_class", [])),
                "iou": round(m["iou"], 4) if m.get("iou") is not None else "",
                "assd": round(m["assd"], 3) if m.get("assd") is not None else "",
                "hd95": round(m["hd95"], 3) if m.get("hd95") is not None else "",
                "n_cases": m.get("n_cases", ""), "selected_round": "" if chosen is None else chosen,
            })
    return rows


def metric_table(rows: list[dict]) -> str:
    """Markdown of ``metric_rows``, with its legend (``METRIC_LEGEND``) under it."""
    return markdown_table(METRIC_COLUMNS, [[r[c] for c in METRIC_COLUMNS] for r in rows]) + f"\n\n{METRIC_LEGEND}"


def timing_summary(results: dict) -> str:
    """Wall time, peak memory and, from round 2 on, the per-round split into local work (slowest site) and FLARE
    overhead (round 1 also holds the sites' start-up: data loading and caching). A run without ``footprint`` (the
    ``python job.py`` route) says its memory was not measured."""
    rounds = results["history"]
    wall = [h["wall_seconds"] for h in rounds]
    work = [max(h["site_compute_seconds"].values(), default=0.0) for h in rounds]
    fp = results.get("footprint") or {}
    total = f"wall {fp['wall_seconds']:.1f} s" if "wall_seconds" in fp else f"rounds' wall {sum(wall):.1f} s"
    memory = (f"peak memory {fp['peak_rss_gib']:.2f} GiB" if isinstance(fp.get("peak_rss_gib"), (int, float))
              else "peak memory not measured (pflseg run measures it)")
    head = (f"{results['job']}: {len(rounds)} rounds, {len(results['sites'])} sites; {total}, {memory}; "
            f"first round {wall[0]:.2f} s (site work {work[0]:.2f} s, with the sites' start-up)")
    steady = rounds[1:]
    if not steady:
        return head + "; FLARE's overhead per round is measured from round 2 on (run 2 or more rounds)"
    w = sum(h["wall_seconds"] for h in steady) / len(steady)
    c = sum(max(h["site_compute_seconds"].values(), default=0.0) for h in steady) / len(steady)
    which = "round 2" if len(rounds) == 2 else f"rounds 2-{len(rounds)}"
    return (f"{head}; {which}: {w:.2f} s each = {c:.2f} s site work (local training + validation, "
            f"slowest site) + {w - c:.2f} s FLARE overhead")


#: a run whose mean test Dice is below this, at tiny settings (``tiny_settings``), gets ``tiny_note``
TINY_DICE = 0.3


def tiny_settings(cfg: dict) -> list[str]:
    """The settings of ``cfg`` (a job's effective config) that make a run too small to learn: few rounds, small
    images, one local epoch. Empty when none."""
    out = []
    if cfg.get("rounds", 99) <= 3:
        out.append(f"{cfg['rounds']} round(s)")
    size = (cfg.get("data") or {}).get("size")
    if isinstance(size, int) and size <= 48:
        out.append(f"{size} px")
    return out


def tiny_note(results: dict) -> str | None:
    """A line saying that a low Dice is what tiny settings give (``tiny_settings``), or None."""
    scores = list(site_dice(results).values()) if "test" in results and results.get("method") in METHODS else []
    tiny = tiny_settings(results.get("config") or {})
    mean = sum(scores) / len(scores) if scores else None
    if mean is None or not tiny or mean >= TINY_DICE:
        return None
    return (f"note: mean test Dice {mean:.2f} is what these tiny settings give ({', '.join(tiny)}): "
            "they show the route, not a result. For numbers to compare, run more rounds at the data's size (e.g. "
            "--rounds 20 without --size), or `pflseg demo`")


def infer_table(results: dict) -> str:
    """FedSM inference job: per site, the global, own personalized (inside sites) and super model Dice at each
    gamma (the selector's confidence threshold), the gamma chosen on the inside sites' validation named, and a
    legend."""
    routes = sorted({r for site in results["infer"].values() for r in site["super"]})
    chosen = results.get("gamma_selected")
    rows = []
    for name, site in sorted(results["infer"].items()):
        person = site["personalized"]
        rows.append([f"{name}{'' if site['inside'] else ' (outside)'}", f"{site['global']['dice']:.4f}",
                     "-" if person is None else f"{person['dice']:.4f}",
                     *(f"{site['super'][r]['dice']:.4f}" if r in site["super"] else "-" for r in routes)])

    def column(r: str) -> str:
        if r == "extra":
            return "super (extra selector)"
        mark = " (chosen)" if chosen is not None and _same(r, chosen) else ""
        return f"super, gamma={r}{mark}"

    table = markdown_table(["site", "global", "personalized", *map(column, routes)], rows)
    inside = results.get("inside_sites")
    legend = ["", "global: the final global model; personalized: the site's own model (inside sites only); super, "
              "gamma=g: FedSM's super model, which uses the personalized model the selector picks for an image when "
              "the selector's confidence is above gamma, else the global model"]
    if chosen is not None:
        legend.append(f"gamma chosen on the inside sites' validation: {chosen:g}")
    if inside:
        outside = [s for s in sorted(results["infer"]) if s not in inside]
        legend.append(f"inside sites (trained): {', '.join(inside)}"
                      + (f"; outside sites (never trained): {', '.join(outside)}" if outside else ""))
    return "\n".join([table, *legend])


def _same(key: str, value: float) -> bool:
    try:
        return float(key) == float(value)
    except ValueError:
        return False


#: the routing job's comparators (``pflseg.infer.routing.NORM``) in the table's words; the routing variants are
#: ``pflseg.infer.routing.LABELS``. key -> (label, what it is)
ROUTE_COMPARATORS = {
    "global": ("Global", "the global model w_g as trained (FedAvg's)"),
    "global_bn": ("Global, test-batch BN", "w_g with the test batch's normalisation statistics"),
    "average": ("Average", "the weight average of the experts (P_1..P_K and w_g)"),
    "average_bn": ("Average, test-batch BN", "the weight average with test-batch statistics: the routed models' "
                                             "starting point"),
    "ensemble": ("Ensemble", "the mean of the experts' probabilities"),
    "ensemble_bn": ("Ensemble, test-batch BN", "the mean of the experts' probabilities, test-batch statistics"),
    "tent": ("Tent", "online Tent on w_g: one pass, the norm layers' affine parameters adapted"),
    "tent_epochs": ("Tent, routing's budget", "Tent for the routing step budget, per image its lowest-entropy "
                                              "prediction"),
    "tent_average": ("Tent from Average", "Tent started from the Average"),
    "routing_global": (None, "one coefficient per expert for the whole model (the paper's Global ablation)"),
    "routing_layer": (None, "one coefficient vector per layer, shared by the images"),
    "routing": (None, "the routed model: per-image, per-layer routers (iopfl.router)"),
    "routing_final": (None, "the routed model at the end of its run"),
}
_NORM_WORDS = {"running": "training's running statistics", "batch": "test-batch statistics"}


def route_label(key: str) -> str:
    """A routing job's column in words: the routing variants' ``LABELS``, the comparators' ``ROUTE_COMPARATORS``."""
    return ROUTE_LABELS.get(key) or (ROUTE_COMPARATORS.get(key, (None, ""))[0] or key)


def route_table(results: dict) -> str:
    """Markdown: one row per routed (outside) site, one column per method (test Dice), from the routing job's
    results.json; a line naming the outside and the inside sites above it, a legend of the columns under it."""
    rows = results["route"]
    methods = [m for m in ROUTE_METHODS if all(m in r["methods"] for r in rows.values())]
    table = markdown_table(["outside site", *map(route_label, methods), "routing s/sample/epoch"], [
        [site, *(f"{r['methods'][m]['dice']:.4f}" if r["methods"][m]["dice"] is not None else "-" for m in methods),
         f"{r['seconds_per_sample']:.4f}"] for site, r in sorted(rows.items())])
    inside = results.get("inside_sites")
    head = (f"Test Dice at the outside site(s) {', '.join(sorted(rows))} (never trained: the models were routed "
            "there, unlabeled)" + (f"; experts: P_k of the inside sites {', '.join(inside)} and the global model "
                                    "w_g" if inside else ""))
    legend = [f"- {route_label(m)}: {ROUTE_COMPARATORS.get(m, (None, ''))[1] or m}"
              + (f" [{_NORM_WORDS[ROUTE_NORM[m]]}]" if ROUTE_NORM.get(m) in _NORM_WORDS else "") for m in methods]
    return "\n".join([head, "", table, "", *legend])


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
    note = tiny_note(results)
    return [dice_table({job: results}), timing_summary(results), *([note] if note else [])]
