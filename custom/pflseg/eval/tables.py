"""Result tables: per-site test Dice of each method's model for that site (the inside protocol)."""

from __future__ import annotations

from pflseg.flare.methods import METHODS
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


def run_columns(results: dict, job: str) -> list[tuple[str, str]]:
    """(label, test-metrics key) of every model a run scores at its sites, as its method's registry entry names them
    (its inside columns of its own job, ``Method.inside[method]``, e.g. Ditto's global and personalized models); a
    method without them: the run's name and the model the method reports."""
    entry = METHODS.get(results["method"])
    cols = entry.inside.get(results["method"], ()) if entry is not None else ()
    own = [(c.label, c.key) for c in cols if c.read is None and c.job == results["method"]]
    if own:
        return own
    return [(label(results, job), "site" if entry is not None and entry.site.personalized else "global")]


def dice_table(all_results: dict[str, dict]) -> str:
    """Markdown table: one row per site (plus the mean), one column per model each job's sites scored
    (``run_columns``; a model no site scored is left out); a site that did not score a model shows "-"."""
    scored = {(n, lab): {site: m[key]["dice"] for site, m in res["test"].items() if isinstance(m.get(key), dict)}
              for n, res in all_results.items() for lab, key in run_columns(res, n)}
    columns = {name: col for name, col in scored.items() if col}
    sites = sorted({s for col in columns.values() for s in col})
    rows = [[site, *(f"{col[site]:.4f}" if site in col else "-" for col in columns.values())] for site in sites]
    rows.append(["mean", *(f"{sum(col.values()) / max(len(col), 1):.4f}" for col in columns.values())])
    return markdown_table(["site", *(lab for _, lab in columns)], rows)


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


def run_tables(results: dict, job: str) -> list[str]:
    """What ``pflseg run`` prints for job ``job``'s results.json: a post-training job's own table (its results'
    ``report``: the Markdown the job wrote for itself, e.g. the cross-site matrix; else the method's own table of
    its results, ``Method.table``), else the per-site Dice table and the timing line."""
    if "report" in results:
        return [results["report"]["markdown"]]
    entry = METHODS.get(results.get("method"))
    if entry is not None and entry.table is not None:
        return [entry.table(results)]
    note = tiny_note(results)
    return [dice_table({job: results}), timing_summary(results), *([note] if note else [])]
