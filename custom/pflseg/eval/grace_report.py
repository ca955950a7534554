"""GRACE's protocol on synthetic data: leave-one-site-out over all sites, the paper's ablation (Tables 1, 2, 4).

    pflseg report grace-loso --workspace runs/grace_loso --sites 4 --seeds 0 1 --rounds 10

For every seed and every held-out site, four variants of the ``grace`` job train on the other sites in the
FLARE simulator (real jobs, sites named after their data folders):

    FedAvg        grace.server false, grace.client false  (the FedAvg workflow, plain local training)
    GRACE-server  consistency re-weighting only
    GRACE-client  meta-learning with feature alignment only (FedAvg aggregation)
    GRACE         both

- generalization: the server's best global model (chosen on the inside sites' validation Dice) scored on
  the held-out site's test split;
- personalization: each inside site's own model -- its local model after the round's training, best by its
  validation Dice -- on its own test split, averaged over the inside sites.

Writes ``<workspace>/grace_loso.json`` and ``.md``; runs already finished (results.json present) are reused.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from pflseg.data import load_dataset_info, make_synthetic, site_dataset
from pflseg.flare.jobs import export_job
from pflseg.deploy.simulator import run_simulator
from pflseg.eval.progress import RunProgress
from pflseg.flare.state import RoundStore, unprefixed
from pflseg.nets import build_net
from pflseg.train import evaluate

VARIANTS = {"FedAvg": (False, False), "GRACE-server": (True, False), "GRACE-client": (False, True), "GRACE": (True, True)}


def run_one(ws: Path, root: Path, inside: list[str], held_out: str, variant: str, seed: int, rounds: int, progress) -> dict:
    server, client = VARIANTS[variant]
    over = {"rounds": rounds, "seed": seed, "min_clients": len(inside), "grace": {"server": server, "client": client}}
    results_path = ws / "state" / "server" / "grace" / "results.json"
    if results_path.is_file():
        res = json.loads(results_path.read_text())
    else:
        job = export_job("grace", ws / "job", overrides=over)
        res = run_simulator(job, ws, clients=inside, data=root, progress=progress)
    cfg = res["config"]
    store = RoundStore(ws / "state" / "server" / "grace")
    net = build_net(cfg["net"])
    net.load_state_dict(unprefixed("best", store.load(store.latest())))
    outside = evaluate(net, site_dataset(root, held_out, "testing", size=cfg["data"]["size"]), torch.device("cpu"))
    return {
        "generalization": outside["dice"],
        "personalization": {s: res["test"][s]["site"]["dice"] for s in inside},
        "global_inside": {s: res["test"][s]["global"]["dice"] for s in inside},
        "wall_seconds": res.get("footprint", {}).get("wall_seconds"),
    }


def measure(workspace: str | Path, n_sites: int = 4, seeds=(0, 1), rounds: int = 10, progress=print) -> dict:
    ws = Path(workspace).resolve()
    root = ws / "data"
    if not (root / "dataset.json").is_file():
        make_synthetic(root, n_sites=n_sites)
    sites = load_dataset_info(root)["sites"]
    runs, steps = {}, RunProgress(len(seeds) * len(sites) * len(VARIANTS), progress)
    for seed in seeds:
        for held_out in sites:
            inside = [s for s in sites if s != held_out]
            for variant in VARIANTS:
                steps.start(f"seed {seed}, held out {held_out}: {variant}")
                runs[f"{seed}/{held_out}/{variant}"] = run_one(
                    ws / f"seed{seed}" / held_out / variant, root, inside, held_out, variant, seed, rounds, progress)
                steps.done()
    report = {"sites": sites, "seeds": list(seeds), "rounds": rounds, "runs": runs}
    (ws / "grace_loso.json").write_text(json.dumps(report, indent=1))
    (ws / "grace_loso.md").write_text(to_markdown(report))
    return report


def _cell(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def to_markdown(report: dict) -> str:
    sites, seeds, runs = report["sites"], report["seeds"], report["runs"]
    out = []
    for title, metric in (("Generalization: global model at the held-out site", "generalization"),
                          ("Personalization: inside sites' own models (mean over the inside sites)", "personalization")):
        out += [f"{title} (test Dice, mean ± std over seeds {seeds})", "",
                "| held-out site | " + " | ".join(VARIANTS) + " |", "|" + "---|" * (len(VARIANTS) + 1)]
        averages = {v: [] for v in VARIANTS}
        for held_out in sites:
            row = []
            for v in VARIANTS:
                vals = []
                for seed in seeds:
                    value = runs[f"{seed}/{held_out}/{v}"][metric]
                    vals.append(statistics.fmean(value.values()) if isinstance(value, dict) else value)
                averages[v].append(vals)
                row.append(_cell(vals))
            out.append(f"| {held_out} | " + " | ".join(row) + " |")
        # the average over held-out sites, per seed, then mean ± std over seeds
        avg = [_cell([statistics.fmean(vals[i] for vals in averages[v]) for i in range(len(seeds))]) for v in VARIANTS]
        out += [f"| **average** | " + " | ".join(avg) + " |", ""]
    return "\n".join(out)
