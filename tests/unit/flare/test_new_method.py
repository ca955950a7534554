"""One method, one description (issue 24): a toy FedAvgM (server momentum), registered at test time as algorithm +
controller + site + registry entry + app config + defaults section, and nothing else, is loaded and checked by its own
rules, exported and refused by the CLI, planned by the bench with its own columns, labelled in the result tables,
allowed in package-mode deployments and identified by its own section in a run's record.

Every project function below is the real one; the only edits are the ones a new method makes (``METHODS`` and a copy
of app_configs/, through ``PFLSEG_CONFIGS``). The bench also runs on it, end to end, with the
simulator stubbed (its results.json).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.cli import build_parser, main
from pflseg.config import ConfigError, check_effective, configs_dir, job_names, load_job_config
from pflseg.data import make_synthetic
from pflseg.deploy.workspace import differences, run_record
from pflseg.eval import bench as bench_module
from pflseg.eval.bench import Bench, default_methods, inside_columns, outside_columns
from pflseg.eval.tables import dice_table, label
from pflseg.flare.allowlist import pflseg_classes
from pflseg.flare.columns import Column
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.methods import METHODS, Method, method
from pflseg.flare.server_state import NET, ServerState
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make, scaled
from tests.unit.flare.controllers.test_resume import assert_same, stopped_and_resumed


# ---- algorithms/fedavgm.py: the math, two dicts of tensors in, no FLARE ----------------------------------------------
def server_momentum(state: dict, averaged: dict, momentum: dict, beta: float) -> tuple[dict, dict]:
    """FedAvgM (Hsu et al., 2019): with the averaged update d = avg - w, m <- beta m + d and w <- w + m. Integer
    buffers (batch counts) take the average as FedAvg does. Returns (the new global state, the new momentum)."""
    new, m = dict(averaged), {}
    for key, w in state.items():
        if w.is_floating_point():
            m[key] = beta * momentum.get(key, torch.zeros_like(w)) + (averaged[key] - w)
            new[key] = w + m[key]
    return new, m


# ---- flare/controllers/fedavgm.py: FedAvg's round, the new global model by momentum, its own config rules ----------
class FedAvgMController(FedAvgController):
    ranges = {"fedavgm.warmup_rounds": (0, 10_000)}

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)  # the ranges
        if not 0.0 <= cfg["fedavgm"]["beta"] < 1.0:
            raise ConfigError(f"{source}: fedavgm.beta must lie in [0, 1), got {cfg['fedavgm']['beta']}")

    def declare(self, state: ServerState) -> None:
        """Its server momentum is part of the server state: checkpointed (``momentum.*``), restored on resume, and
        rolled back with the global model when an aggregate is not finite."""
        super().declare(state)
        state.add("momentum", {}, NET, "momentum", guarded=True)

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        averaged, more = super().aggregate(results, state, r)
        if r < self.cfg["fedavgm"]["warmup_rounds"]:
            return averaged, more
        beta = self.cfg["fedavgm"]["beta"]
        new, self.state.momentum = server_momentum(state, averaged, self.state.momentum, beta)
        return new, more


# ---- flare/sites/fedavgm.py: FedAvg's local training --------------------------------------------------------------
class FedAvgMSite(FedAvgSite):
    pass


# ---- its line in flare/methods.py -------------------------------------------------------------------------------
FEDAVGM = Method(FedAvgMController, FedAvgMSite, ("fedavgm",), label="FedAvgM",
                 inside={"fedavgm": (Column("FedAvgM", "fedavgm", "global", "unet"),)},
                 outside={"fedavgm": (Column("FedAvgM", "fedavgm", "global", "running"),)})


@pytest.fixture
def fedavgm(tmp_path, monkeypatch):
    """The registry with FedAvgM, and app_configs/ with fedavgm.yaml and its section in defaults.yaml."""
    configs = tmp_path / "app_configs"
    shutil.copytree(configs_dir(), configs)
    with open(configs / "defaults.yaml", "a") as f:
        f.write("\nfedavgm:                  # FedAvgM: server momentum\n  beta: 0.9\n  warmup_rounds: 0\n")
    (configs / "fedavgm.yaml").write_text("method: fedavgm\nrounds: 3\n")
    monkeypatch.setitem(METHODS, "fedavgm", FEDAVGM)
    monkeypatch.setenv("PFLSEG_CONFIGS", str(configs))
    return configs


def test_the_momentum_step_against_closed_forms():
    w, avg = {"x": torch.tensor([1.0]), "n": torch.tensor(3)}, {"x": torch.tensor([0.5]), "n": torch.tensor(5)}
    new, m = server_momentum(w, avg, {}, 0.0)  # beta = 0 is FedAvg
    assert new["x"].item() == 0.5 and new["n"].item() == 5 and m["x"].item() == -0.5
    new, m = server_momentum(w, avg, {"x": torch.tensor([-1.0])}, 0.25)  # m = 0.25 (-1) - 0.5, w + m
    assert m["x"].item() == -0.75 and new["x"].item() == 0.25


def test_its_config_loads_and_its_own_rules_check_it(fedavgm):
    cfg = load_job_config("fedavgm")
    assert cfg["fedavgm"] == {"beta": 0.9, "warmup_rounds": 0} and method(cfg) is FEDAVGM
    bad = load_job_config("fedavgm", overrides={"fedavgm": {"beta": 1.5}})  # the common rules know nothing of it
    with pytest.raises(ConfigError, match=r"job fedavgm: fedavgm\.beta must lie in \[0, 1\), got 1\.5"):
        method(bad)
    with pytest.raises(ConfigError, match=r"server job config: fedavgm\.beta"):  # what the server and sites receive
        method(check_effective(bad), "server job config")
    with pytest.raises(ConfigError, match=r"fedavgm\.warmup_rounds=100000 exceeds the cap 10000 .*"
                                          r"test_new_method\.FedAvgMController\.ranges"):
        method(load_job_config("fedavgm", overrides={"fedavgm": {"warmup_rounds": 10**5}}))
    with pytest.raises(ConfigError, match=r"unknown key 'fedavgm\.mu'"):
        load_job_config("fedavgm", overrides={"fedavgm": {"mu": 0.1}})
    assert method(load_job_config("fedavg", overrides={"fedavgm": {"beta": 1.5}}))  # not fedavg's business


def test_its_controller_runs_a_round_with_momentum(fedavgm, tmp_path, monkeypatch):
    ctrl = make("fedavgm", tmp_path, monkeypatch)
    assert type(ctrl) is FedAvgMController
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):  # every site halves what it received
        return FLModel(params=prefixed(GLOBAL, scaled(unprefixed(GLOBAL, data.params), 0.5)), metrics={"val_dice": 0.5},
                       meta={"NUM_STEPS_CURRENT_ROUND": 2})

    Stub(ctrl, reply)
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    ctrl.round(0)  # m = -g0/2, w = g0/2
    assert torch.allclose(ctrl.state.global_state[key], 0.5 * g0[key], atol=1e-6)
    ctrl.round(1)  # d = -g0/4, m = 0.9 (-g0/2) - g0/4 = -0.7 g0, w = g0/2 - 0.7 g0 = -0.2 g0 (FedAvg: g0/4)
    assert torch.allclose(ctrl.state.global_state[key], -0.2 * g0[key], atol=1e-6)


class AttributeMomentum(FedAvgMController):
    """The resume bug this template used to teach: momentum in a controller attribute, not in the server state."""

    def declare(self, state: ServerState) -> None:
        FedAvgController.declare(self, state)

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        averaged, more = FedAvgController.aggregate(self, results, state, r)
        new, self.momentum = server_momentum(state, averaged, getattr(self, "momentum", {}), 0.9)
        return new, more


def test_a_resumed_run_keeps_its_momentum_and_equals_the_uninterrupted_run(fedavgm, tmp_path, monkeypatch):
    straight, resumed = stopped_and_resumed("fedavgm", tmp_path / "state", monkeypatch)
    assert_same(straight.store.load(1), resumed.store.load(1))
    assert unprefixed("momentum", resumed.store.load(1)) and resumed.state.momentum  # it is in the checkpoint
    monkeypatch.setitem(METHODS, "fedavgm", FEDAVGM._replace(controller=AttributeMomentum))  # momentum not in state
    straight, resumed = stopped_and_resumed("fedavgm", tmp_path / "attribute", monkeypatch)
    with pytest.raises(AssertionError, match="global"):  # resumed with no momentum: another global model
        assert_same(straight.store.load(1), resumed.store.load(1))


def test_the_cli_lists_exports_and_refuses_it(fedavgm, tmp_path, capsys):
    assert "fedavgm" in job_names()  # `pflseg jobs export` with no names exports every listed job
    assert main(["jobs", "export", "fedavgm", "--out", str(tmp_path / "jobs")]) == 0
    server = json.loads((tmp_path / "jobs" / "fedavgm" / "app" / "config" / "config_fed_server.json").read_text())
    workflow = server["workflows"][0]
    assert workflow["path"] == f"{FedAvgMController.__module__}.FedAvgMController"
    assert workflow["args"]["config"]["fedavgm"] == {"beta": 0.9, "warmup_rounds": 0}
    assert "fedsm" not in workflow["args"]["config"]  # only its own section travels
    capsys.readouterr()
    assert main(["jobs", "export", "fedavgm", "--out", str(tmp_path / "bad"), "--set", "fedavgm.beta=2"]) == 2
    assert "fedavgm.beta must lie in [0, 1), got 2.0" in capsys.readouterr().err
    assert main(["run", "fedavgm", "--workspace", str(tmp_path / "run"), "--set", "fedavgm.beta=2"]) == 2
    assert "fedavgm.beta must lie in [0, 1), got 2.0" in capsys.readouterr().err  # before any simulator starts
    assert not (tmp_path / "run" / "run.json").exists()
    assert "fedavgm" in build_parser().parse_args(["bench"]).methods  # a default of the bench, and a choice
    assert build_parser().parse_args(["bench", "--methods", "fedavgm"]).methods == ["fedavgm"]


def test_the_bench_plans_it_with_its_columns(fedavgm, tmp_path):
    assert inside_columns()["fedavgm"] == FEDAVGM.inside["fedavgm"] and "fedavgm" in outside_columns()
    assert "fedavgm" in default_methods()
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedavg", "fedavgm"], holdout=["site-4"], rounds=1,
                  progress=lambda m: None)
    assert [job for _, fold, job in bench.plan() if fold == "inside"] == ["fedavg", "fedavgm"]
    alone = Bench(tmp_path / "ws", data=root, methods=["fedavgm"], holdout=["site-4"], progress=lambda m: None)
    assert alone.outside  # its outside column: the held-out site-4 is scored on its runs too
    assert bench.expected(0, "inside", "fedavgm")["config"]["fedavgm"]["beta"] == 0.9


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


def test_the_bench_runs_it_and_reports_it_against_fedavg(fedavgm, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator)
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedavg", "fedavgm"], seeds=[0], holdout=["site-4"], rounds=1,
                  outside=False, progress=lambda m: None)
    report = bench.execute()
    assert report["inside"]["FedAvgM"]["site-1"]["mean"] == 0.6 and report["inside_backbone"]["FedAvgM"] == "unet"
    assert report["inside_vs_fedavg"]["FedAvgM"]["mean"] > 0.099  # paired with FedAvg, the reference of its backbone
    assert "| FedAvgM | 0.600 | 0.600 | 0.600 | **0.600** |" in (tmp_path / "ws" / "bench.md").read_text()
    assert "site-1,FedAvgM,0.6000" in (tmp_path / "ws" / "bench_inside.csv").read_text()
    assert dice_table({"fedavgm": bench.results(0, "inside", "fedavgm")}).splitlines()[0] == "| site | FedAvgM |"


def test_the_tables_label_it(fedavgm):
    score = {"dice": 0.6, "n_cases": 2}
    results = {"method": "fedavgm", "test": {"site-1": {"global": score, "site": {"dice": 0.1}},
                                            "site-2": {"global": score, "site": {"dice": 0.1}}}}
    assert label(results, "fedavgm_fundus") == "FedAvgM"
    table = dice_table({"fedavgm_fundus": results}).splitlines()
    assert table[0] == "| site | FedAvgM |" and "0.6000" in table[2]  # its global model, not a personalized one


def test_deployments_allow_it_and_a_run_is_identified_by_its_own_section(fedavgm):
    assert f"{FedAvgMController.__module__}.FedAvgMController" in pflseg_classes()
    base = run_record(load_job_config("fedavgm"))
    assert differences(base, run_record(load_job_config("fedavgm", overrides={"fedavgm": {"beta": 0.5}}))) == [
        "fedavgm.beta: 0.9 -> 0.5"]
    assert differences(base, run_record(load_job_config("fedavgm", overrides={"fedsm": {"lam": 0.5}}))) == []
