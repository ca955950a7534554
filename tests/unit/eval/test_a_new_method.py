"""A new method is its algorithm, controller, site, registry entry, app config and defaults section: registered here at
test time (a toy FedAvgM, server momentum), it appears in ``pflseg bench``'s plan and tables, in the result tables and
in the CLI's method choices with no other edit."""

import json
import shutil
from pathlib import Path

import torch

from pflseg.cli import build_parser
from pflseg.config import configs_dir, load_job_config
from pflseg.data import make_synthetic
from pflseg.eval import bench as bench_module
from pflseg.eval.bench import Bench
from pflseg.eval.tables import dice_table
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.methods import METHODS, Method, method
from pflseg.flare.sites.fedavg import FedAvgSite


# ---- the algorithm (algorithms/fedavgm.py) ------------------------------------------------------------------------
def server_momentum(state: dict, averaged: dict, velocity: dict, beta: float) -> tuple[dict, dict]:
    """FedAvgM (Hsu et al., 2019): v <- beta v + (w - avg), w <- w - v. Returns (new state, new velocity)."""
    v = {k: beta * velocity.get(k, torch.zeros_like(state[k])) + (state[k] - averaged[k]) for k in averaged}
    return {**state, **{k: state[k] - v[k] for k in v}}, v


# ---- its controller (flare/controllers/fedavgm.py) and site (flare/sites/fedavgm.py) ----------------------------
class FedAvgMController(FedAvgController):
    def aggregate(self, results: dict, r: int) -> None:
        before = dict(self.global_state)
        super().aggregate(results, r)
        self.global_state, self.velocity = server_momentum(before, self.global_state, getattr(self, "velocity", {}),
                                                           self.cfg["fedavgm"]["beta"])


class FedAvgMSite(FedAvgSite):
    pass


# ---- its registry entry (flare/methods.py) ------------------------------------------------------------------------
FEDAVGM = Method(FedAvgMController, FedAvgMSite, ("fedavgm",), label="FedAvgM",
                 inside={"fedavgm": (("FedAvgM", "fedavgm", "global", "unet"),)},
                 outside={"fedavgm": (("FedAvgM", "fedavgm", "global", "running"),)})


def app_configs(tmp_path: Path) -> Path:
    """app_configs/ with app_configs/fedavgm.yaml and the method's section in defaults.yaml."""
    out = tmp_path / "app_configs"
    shutil.copytree(configs_dir(), out)
    with open(out / "defaults.yaml", "a") as f:
        f.write("\nfedavgm:\n  beta: 0.9   # server momentum\n")
    (out / "fedavgm.yaml").write_text("method: fedavgm\n")
    return out


def fake_simulator(job_dir, workspace, n_sites=3, threads=None, data=None, progress=print, clients=None, inputs=None):
    """run_simulator's stand-in: a results.json of the shape a run writes, each site scoring 0.5 (0.6 with FedAvgM)."""
    job = Path(job_dir).name
    dice = 0.6 if job == "fedavgm" else 0.5
    score = {"dice": dice, "n_cases": 2, "n_images": 4}
    res = {"job": job, "method": job, "sites": clients, "missing": {},
           "test": {s: {"global": score, "global_adabn": score, "site": score} for s in clients},
           "history": [{"round": 0, "val_dice": {s: dice for s in clients}, "site_metrics": {}}],
           "footprint": {"wall_seconds": 1.0}}
    server = Path(workspace) / "state" / "server" / job
    server.mkdir(parents=True, exist_ok=True)
    (server / "results.json").write_text(json.dumps(res))
    return res


def test_a_method_registered_at_test_time_appears_in_the_bench_the_tables_and_the_cli(tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, "fedavgm", FEDAVGM)
    monkeypatch.setenv("PFLSEG_CONFIGS", str(app_configs(tmp_path)))
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator)
    # the algorithm: beta = 0 is FedAvg's average; with momentum the step grows by beta times the last one
    w, avg = {"x": torch.tensor([1.0])}, {"x": torch.tensor([0.5])}
    assert server_momentum(w, avg, {}, 0.0)[0]["x"].item() == 0.5
    assert server_momentum(w, avg, {"x": torch.tensor([1.0])}, 0.25)[0]["x"].item() == 1.0 - (0.25 + 0.5)

    cfg = load_job_config("fedavgm")
    assert cfg["fedavgm"] == {"beta": 0.9} and method(cfg) is FEDAVGM

    args = build_parser().parse_args(["bench"])
    assert "fedavgm" in args.methods  # a default of the bench, and a choice
    assert build_parser().parse_args(["bench", "--methods", "fedavg", "fedavgm"]).methods == ["fedavg", "fedavgm"]

    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedavg", "fedavgm"], seeds=[0], holdout=["site-4"], rounds=1,
                  outside=False, progress=lambda m: None)
    assert [job for _, _, job in bench.plan()] == ["fedavg", "fedavgm"]
    assert Bench(tmp_path / "ws", data=root, methods=["fedavgm"], holdout=["site-4"]).outside  # it has outside columns
    report = bench.execute()
    assert report["inside"]["FedAvgM"]["site-1"]["mean"] == 0.6 and report["inside_backbone"]["FedAvgM"] == "unet"
    assert report["inside_vs_fedavg"]["FedAvgM"]["mean"] > 0.099  # paired with FedAvg, the reference of its backbone
    assert "| FedAvgM | 0.600 | 0.600 | 0.600 | **0.600** |" in (tmp_path / "ws" / "bench.md").read_text()
    assert "site-1,FedAvgM,0.6000" in (tmp_path / "ws" / "bench_inside.csv").read_text()

    results = bench.results(0, "inside", "fedavgm")
    assert dice_table({"fedavgm": results}).splitlines()[0] == "| site | FedAvgM |"
