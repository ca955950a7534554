"""How heterogeneous is the synthetic data? Measured with the real jobs, not assumed.

    pflseg report heterogeneity --workspace runs/heterogeneity --rounds 20

1. makes the 6-site synthetic data set (5 inside sites + the outside site-6);
2. runs the ``local`` and ``fedavg`` jobs on the 5 inside sites in the FLARE simulator;
3. scores every site's own best model (Local) and the best FedAvg global model on the test split of
   every site, inside and outside, and reports:
   - the cross-site matrix and, per single-site model, on how many other inside sites it loses >= 0.15 Dice;
   - FedAvg vs Local on the smallest inside site;
   - at the outside site: every single-site model vs the FedAvg model (trained on the mix).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pflseg.config import load_job_config
from pflseg.data import load_dataset_info, make_synthetic, site_dataset
from pflseg.flare.jobs import export_job
from pflseg.deploy.simulator import run_simulator
from pflseg.eval.progress import RunProgress
from pflseg.flare.state import RoundStore, load_file, unprefixed
from pflseg.nets import build_net
from pflseg.train import evaluate


def _score(state: dict, cfg: dict, root: Path, sites: list[str]) -> dict[str, float]:
    net = build_net(cfg["net"])
    net.load_state_dict(state)
    return {s: evaluate(net, site_dataset(root, s, "testing", size=cfg["data"]["size"]), torch.device("cpu"))["dice"]
            for s in sites}


def measure(workspace: str | Path, rounds: int = 20, task: str = "prostate", seed: int = 0, progress=print) -> dict:
    ws = Path(workspace).resolve()
    root = make_synthetic(ws / "data", task=task, n_sites=6, seed=seed)
    sites = load_dataset_info(root)["sites"]
    inside, outside = sites[:-1], sites[-1]
    over = {"rounds": rounds, "min_clients": len(inside), "seed": seed}
    if task == "fundus":
        over["net"] = {"out_channels": 2}
    models = {}
    steps = RunProgress(2, progress)
    for name in ("local", "fedavg"):
        job = export_job(name, ws / "jobs", overrides=over)
        steps.start(name)
        run_simulator(job, ws / name, n_sites=len(inside), data=root, progress=progress)
        steps.done()
    cfg = load_job_config("fedavg", overrides=over)
    for site in inside:
        models[f"local:{site}"] = unprefixed("model", load_file(ws / "local" / "state" / site / "local" / "best.pt"))
    store = RoundStore(ws / "fedavg" / "state" / "server" / "fedavg")
    models["fedavg"] = unprefixed("best", store.final())
    matrix = {name: _score(state, cfg, root, sites) for name, state in models.items()}
    n_train = {s: len(site_dataset(root, s, "training", size=cfg["data"]["size"])) for s in inside}
    smallest = min(inside, key=lambda s: n_train[s])
    drops = {}
    for site in inside:
        row = matrix[f"local:{site}"]
        drops[site] = sum(1 for other in inside if other != site and row[site] - row[other] >= 0.15)
    report = {
        "matrix": matrix, "train_slices": n_train, "smallest_site": smallest,
        "sites_losing_0.15_on_most_others": sum(1 for s in inside if drops[s] > (len(inside) - 1) / 2),
        "other_sites_with_drop_ge_0.15": drops,
        "smallest_site_local_vs_fedavg": [matrix[f"local:{smallest}"][smallest], matrix["fedavg"][smallest]],
        "outside_single_site_models": {s: matrix[f"local:{s}"][outside] for s in inside},
        "outside_fedavg": matrix["fedavg"][outside],
    }
    (ws / "heterogeneity.json").write_text(json.dumps(report, indent=1))
    return report


def to_markdown(report: dict) -> str:
    matrix = report["matrix"]
    sites = list(next(iter(matrix.values())))
    lines = ["| model \\ test site | " + " | ".join(sites) + " |", "|" + "---|" * (len(sites) + 1)]
    for name, row in matrix.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.3f}" for s in sites) + " |")
    local, fed = report["smallest_site_local_vs_fedavg"]
    lines += [
        "",
        f"- single-site models that lose >= 0.15 Dice on most other inside sites: "
        f"{report['sites_losing_0.15_on_most_others']} of {len(report['other_sites_with_drop_ge_0.15'])} "
        f"(other sites with such a drop: {report['other_sites_with_drop_ge_0.15']})",
        f"- smallest inside site {report['smallest_site']} ({report['train_slices'][report['smallest_site']]} "
        f"training slices): Local {local:.3f} vs FedAvg {fed:.3f}",
        f"- outside site {sites[-1]}: best single-site model {max(report['outside_single_site_models'].values()):.3f}, "
        f"FedAvg (the mix) {report['outside_fedavg']:.3f}",
    ]
    return "\n".join(lines)
