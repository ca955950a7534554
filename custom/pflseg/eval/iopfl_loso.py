"""IOP-FL leave-one-site-out: ``pflseg iopfl loso``.

For every seed and every held-out site h of a data root: the ``iopfl`` job trains in the FLARE simulator
on all other sites, then the ``iopfl_route`` job routes at h with the trained bundle (h never trained:
it is the only site of the routing run). Sites run under their own names (a name FLARE does not accept,
e.g. ``Hospital A``, through a view, ``pflseg.deploy.data_sites.site_view``); tables use the data's names.

Writes ``<workspace>/iopfl_loso.{json,csv,md}``:
    inside table   per site: test Dice of the best global model and of the site's best P_k (mean, std over
                   seeds and the folds in which the site was inside)
    outside table  per held-out site and on average: Dice of global, average, ensemble, tent,
                   routing_global, routing (mean, std over seeds)
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from pflseg.data import make_synthetic
from pflseg.deploy.data_sites import choose_sites, site_view
from pflseg.infer.routing import METHODS
from pflseg.flare.jobs import export_job
from pflseg.deploy.simulator import run_simulator

LABELS = {"global": "FedAvg", "average": "Average", "ensemble": "Ensemble", "tent": "Tent",
          "routing_global": "Routing (global)", "routing": "IOP-FL routing"}


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def run_loso(workspace: str | Path, data: str | Path | None = None, synth_sites: int = 5, seeds=(0, 1),
             overrides: dict | None = None, held_out: list[str] | None = None, threads: int | None = None,
             progress=print, sites: list[str] | None = None) -> dict:
    """Run the protocol; ``sites``: the data root's sites taking part (default: all), ``held_out``: the
    folds (default: every site taking part)."""
    from pflseg.eval.progress import RunProgress

    ws = Path(workspace).resolve()
    root = Path(data).resolve() if data else make_synthetic(ws / "data", n_sites=synth_sites, seed=0)
    sites = sites or choose_sites(root)
    if len(sites) < 3:
        raise ValueError(f"{root}: leave-one-site-out needs at least 3 sites (2 to train, 1 held out), got {sites}")
    folds = held_out or sites
    unknown = [h for h in folds if h not in sites]
    if unknown:
        raise ValueError(f"--holdout {unknown}: not sites of {root} ({sites})")
    view, mapping = site_view(root, sites, ws / "data_view")
    flare = {site: name for name, site in mapping.items()}
    over = dict(overrides or {})
    runs, steps = [], RunProgress(2 * len(seeds) * len(folds), progress)
    for seed in seeds:
        for h in folds:
            fold_ws = ws / f"seed{seed}" / h
            inside = [flare[s] for s in sites if s != h]
            train_over = {**over, "seed": seed, "min_clients": len(inside)}
            job = export_job("iopfl", fold_ws / "jobs", overrides=train_over)
            steps.start(f"iopfl seed {seed} without {h}")
            trained = run_simulator(job, fold_ws / "train", threads=threads, data=view, progress=progress, clients=inside)
            steps.done()
            bundle = fold_ws / "train" / "state" / "server" / "iopfl"
            iopfl = {**over.get("iopfl", {}), "bundle": str(bundle), "targets": [flare[h]]}
            job = export_job("iopfl_route", fold_ws / "jobs", overrides={**train_over, "min_clients": 1, "iopfl": iopfl})
            steps.start(f"iopfl_route seed {seed} at {h}")
            routed = run_simulator(job, fold_ws / "route", threads=threads, data=view, progress=progress,
                                   clients=[flare[h]])
            steps.done()
            out = routed["route"][flare[h]]
            runs.append({
                "seed": seed, "held_out": h,
                "inside": {mapping[s]: {"global": t["global"]["dice"], "person": t["site"]["dice"],
                                        "person_round": t["site"]["selected_round"]} for s, t in trained["test"].items()},
                "outside": {m: r["dice"] for m, r in out["methods"].items()},
                "seconds_per_sample": out["seconds_per_sample"], "n_images": out["n_images"],
                "train_wall_seconds": trained["footprint"]["wall_seconds"],
                "route_wall_seconds": routed["footprint"]["wall_seconds"],
            })
            progress(f"[loso] seed {seed}, held out {h}: " + ", ".join(f"{m} {d:.4f}" for m, d in runs[-1]["outside"].items()))
    report = {"data": str(root), "sites": sites, "held_out": folds, "seeds": list(seeds), "overrides": over,
              "runs": runs, "inside": {}, "outside": {}}
    for site in sites:
        cells = [r["inside"][site] for r in runs if site in r["inside"]]
        if cells:
            report["inside"][site] = {k: _stats([c[k] for c in cells]) for k in ("global", "person")}
    methods = [m for m in METHODS if all(m in r["outside"] for r in runs)]
    for h in folds:
        report["outside"][h] = {m: _stats([r["outside"][m] for r in runs if r["held_out"] == h]) for m in methods}
    per_seed_avg = {m: [statistics.mean(r["outside"][m] for r in runs if r["seed"] == s) for s in seeds] for m in methods}
    report["outside"]["average"] = {m: _stats(v) for m, v in per_seed_avg.items()}
    _write(ws, report, methods)
    return report


def _cell(s: dict) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def to_markdown(report: dict, methods: list[str] | None = None) -> str:
    methods = methods or [m for m in METHODS if m in next(iter(report["outside"].values()))]
    lines = [f"Inside (test Dice, mean ± std over seeds {report['seeds']} and the folds where the site trained)", "",
             "| site | FedAvg global | IOP-FL P_k |", "|---|---|---|"]
    for site, s in report["inside"].items():
        lines.append(f"| {site} | {_cell(s['global'])} | {_cell(s['person'])} |")
    g = statistics.mean(s["global"]["mean"] for s in report["inside"].values())
    p = statistics.mean(s["person"]["mean"] for s in report["inside"].values())
    lines += [f"| mean | {g:.4f} | {p:.4f} |", "",
              "Outside, leave-one-site-out (Dice over every image of the held-out site, mean ± std over seeds)", "",
              "| held-out site | " + " | ".join(LABELS[m] for m in methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for h, row in report["outside"].items():
        lines.append(f"| {h} | " + " | ".join(_cell(row[m]) for m in methods) + " |")
    return "\n".join(lines)


def _write(ws: Path, report: dict, methods: list[str]) -> None:
    (ws / "iopfl_loso.json").write_text(json.dumps(report, indent=1))
    with open(ws / "iopfl_loso.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "site", "method", "dice_mean", "dice_std", "n"])
        for site, s in report["inside"].items():
            for k in ("global", "person"):
                w.writerow(["inside", site, k, s[k]["mean"], s[k]["std"], s[k]["n"]])
        for h, row in report["outside"].items():
            for m in methods:
                w.writerow(["outside", h, m, row[m]["mean"], row[m]["std"], row[m]["n"]])
    (ws / "iopfl_loso.md").write_text(to_markdown(report, methods) + "\n")
