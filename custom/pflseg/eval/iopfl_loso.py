"""IOP-FL leave-one-site-out: ``pflseg iopfl loso``.

For every seed and every held-out site h of a data root: the ``iopfl`` job trains in the FLARE simulator
on all other sites, then the ``iopfl_route`` job routes at h with the trained bundle (h never trained).
The simulator names its sites site-1..site-N, so each fold sees the data through a view folder
(``<workspace>/folds/<h>/data``: a dataset.json and links to the original site folders) in which the
inside sites come first and h is last; results are mapped back to the original site names.

Writes ``<workspace>/iopfl_loso.{json,csv,md}``:
    inside table   per site: test Dice of the best global model and of the site's best P_k (mean, std over
                   seeds and the folds in which the site was inside)
    outside table  per held-out site and on average: Dice of global, average, ensemble, tent,
                   routing_global, routing_layer, routing (mean, std over seeds)
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from pflseg.data import load_dataset_info, make_synthetic
from pflseg.infer.routing import METHODS
from pflseg.flare.jobs import export_job
from pflseg.deploy.simulator import run_simulator

LABELS = {"global": "FedAvg", "average": "Average", "ensemble": "Ensemble", "tent": "Tent",
          "routing_global": "IOP-FL (Global)", "routing_layer": "Routing (per-layer global, ours)",
          "routing": "IOP-FL routing"}


def fold_view(root: Path, held_out: str, out: Path) -> dict[str, str]:
    """Make ``out`` a data root whose sites site-1..site-N are the sites of ``root`` with ``held_out``
    last; returns {fold site name: original site name}."""
    info = json.loads((root / "dataset.json").read_text())
    order = [s for s in info["sites"] if s != held_out] + [held_out]
    mapping = {f"site-{i + 1}": s for i, s in enumerate(order)}
    out.mkdir(parents=True, exist_ok=True)
    for name, original in mapping.items():
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to((root / original).resolve(), target_is_directory=True)
    (out / "dataset.json").write_text(json.dumps({**info, "sites": list(mapping)}, indent=1))
    return mapping


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def run_loso(workspace: str | Path, data: str | Path | None = None, synth_sites: int = 5, seeds=(0, 1),
             overrides: dict | None = None, held_out: list[str] | None = None, threads: int | None = None,
             progress=print) -> dict:
    ws = Path(workspace).resolve()
    root = Path(data).resolve() if data else make_synthetic(ws / "data", n_sites=synth_sites, seed=0)
    sites = load_dataset_info(root)["sites"]
    if len(sites) < 3:
        raise ValueError(f"{root}: leave-one-site-out needs at least 3 sites (2 to train, 1 held out), got {sites}")
    folds = held_out or sites
    unknown = [h for h in folds if h not in sites]
    if unknown:
        raise ValueError(f"--holdout {unknown}: not sites of {root} ({sites})")
    over = dict(overrides or {})
    runs = []
    for seed in seeds:
        for h in folds:
            fold_ws = ws / f"seed{seed}" / h
            mapping = fold_view(root, h, ws / "folds" / h / "data")
            n = len(mapping)
            train_over = {**over, "seed": seed, "min_clients": n - 1}
            job = export_job("iopfl", fold_ws / "jobs", overrides=train_over)
            trained = run_simulator(job, fold_ws / "train", n_sites=n - 1, threads=threads,
                                    data=ws / "folds" / h / "data", progress=progress)
            bundle = fold_ws / "train" / "state" / "server" / "iopfl"
            iopfl = {**over.get("iopfl", {}), "bundle": str(bundle), "targets": [f"site-{n}"]}
            job = export_job("iopfl_route", fold_ws / "jobs", overrides={**train_over, "min_clients": 1, "iopfl": iopfl})
            routed = run_simulator(job, fold_ws / "route", n_sites=n, threads=threads,
                                   data=ws / "folds" / h / "data", progress=progress)
            out = routed["route"][f"site-{n}"]
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
