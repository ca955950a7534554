"""LC-Fed's protocol on synthetic data: per-site IoU, Dice and ASSD of six methods (the paper's Tables 1-4).

    pflseg report lcfed --workspace runs/lcfed_report --sites 4 --seeds 0 1 --rounds 12

Every method trains on all sites in the FLARE simulator (real jobs, LC-Fed's five-stage backbone for all;
without PCS for the baselines) and is scored on each site's test split with the model it gives that site,
chosen on validation only:

    Local          job local (net lcfed, pcs false): the site's own model
    FedAvg         job ft: the global model chosen on the sites' validation Dice
    FT             job ft: that global model fine-tuned at the site (ft.epochs), best epoch by validation
    FedRep         job fedrep: shared body, personal head, head-first schedule
    LC-Fed w/o HC  job lcfed_nohc: PCS + site contrast, personal head
    LC-Fed         job lcfed: PCS + site contrast + head calibration (the calibrated head's prediction)

and the head exchange of LC-Fed per round (bytes the sites upload and download). Writes
``<workspace>/lcfed_report.json`` and ``.md``; finished runs (results.json present) are reused.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pflseg.data import load_dataset_info, make_synthetic
from pflseg.flare.jobs import export_job
from pflseg.deploy.simulator import run_simulator
from pflseg.eval.progress import RunProgress

BACKBONE = {"name": "lcfed", "channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2]}
#: row -> (job, which model of results.json "test": global or the site's own)
ROWS = {"Local": ("local", "site"), "FedAvg": ("ft", "global"), "FT": ("ft", "site"), "FedRep": ("fedrep", "site"),
        "LC-Fed w/o HC": ("lcfed_nohc", "site"), "LC-Fed": ("lcfed", "site")}
METRICS = {"dice": "Dice (higher is better)", "iou": "IoU (higher is better)", "assd": "ASSD in pixels (lower is better)"}


def run_job(ws: Path, root: Path, job: str, seed: int, rounds: int, task: str, progress) -> dict:
    results_path = ws / "state" / "server" / job / "results.json"
    if results_path.is_file():
        return json.loads(results_path.read_text())
    net = dict(BACKBONE, pcs=False) if job == "local" else {}
    over = {"rounds": rounds, "seed": seed, "net": net}
    if task == "fundus":
        over["net"] = {**net, "out_channels": 2}
    exported = export_job(job, ws / "job", overrides=over)
    return run_simulator(exported, ws, data=root, progress=progress, n_sites=len(load_dataset_info(root)["sites"]))


def measure(workspace: str | Path, n_sites: int = 4, seeds=(0, 1), rounds: int = 12, task: str = "prostate",
            progress=print) -> dict:
    ws = Path(workspace).resolve()
    root = ws / "data"
    if not (root / "dataset.json").is_file():
        make_synthetic(root, task=task, n_sites=n_sites)
    sites = load_dataset_info(root)["sites"]
    runs, exchange = {}, []
    jobs = list(dict.fromkeys(job for job, _ in ROWS.values()))
    steps = RunProgress(len(seeds) * len(jobs), progress)
    for seed in seeds:
        for job in jobs:
            steps.start(f"seed {seed}: {job}")
            res = run_job(ws / f"seed{seed}" / job, root, job, seed, rounds, task, progress)
            steps.done()
            for row, (row_job, which) in ROWS.items():
                if row_job == job:
                    runs[f"{seed}/{row}"] = {s: {m: res["test"][s][which].get(m) for m in METRICS} for s in sites}
            if job == "lcfed":
                exchange += [h["head_bytes"] for h in res["history"][1:]]
    report = {"task": task, "sites": sites, "seeds": list(seeds), "rounds": rounds, "runs": runs,
              "head_bytes_per_round": exchange[0] if exchange else None}
    (ws / "lcfed_report.json").write_text(json.dumps(report, indent=1))
    (ws / "lcfed_report.md").write_text(to_markdown(report))
    return report


def _cell(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def to_markdown(report: dict) -> str:
    sites, seeds, runs = report["sites"], report["seeds"], report["runs"]
    out = []
    for metric, title in METRICS.items():
        out += [f"{title}, test split, {report['task']}, {report['rounds']} rounds, mean ± std over seeds {seeds}", "",
                "| site | " + " | ".join(ROWS) + " |", "|" + "---|" * (len(ROWS) + 1)]
        for site in sites:
            out.append(f"| {site} | " + " | ".join(_cell([runs[f"{s}/{row}"][site][metric] for s in seeds]) for row in ROWS) + " |")
        means = []  # the mean over sites per seed, then mean ± std over seeds
        for row in ROWS:
            per_seed = [[runs[f"{s}/{row}"][site][metric] for site in sites] for s in seeds]
            means.append(_cell([statistics.fmean(v for v in vals if v is not None) if any(v is not None for v in vals) else None
                                for vals in per_seed]))
        out += ["| **average** | " + " | ".join(means) + " |", ""]
    hb = report.get("head_bytes_per_round")
    if hb:
        k = len(sites)
        out.append(f"LC-Fed head exchange per round ({k} sites): sites upload {hb['up']} bytes in all "
                   f"({hb['up'] // k} each), download {hb['down']} bytes in all ({hb['down'] // k} each, the other {k - 1} heads).")
    return "\n".join(out)
