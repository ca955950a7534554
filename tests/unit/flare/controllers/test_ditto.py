"""Ditto's server side and its one registry entry: FedAvg's round, its own config rule, and the places that read the
registry (CLI, job export, allow list, bench, result tables) reaching it with no other edit."""

import json
from pathlib import Path

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.cli import build_parser
from pflseg.config import ConfigError, job_names, load_job_config
from pflseg.data import make_synthetic
from pflseg.eval import bench as bench_module
from pflseg.eval.bench import Bench, default_methods, inside_columns
from pflseg.eval.tables import dice_table, metric_rows
from pflseg.flare.allowlist import pflseg_classes
from pflseg.flare.columns import Column
from pflseg.flare.controllers.ditto import DittoController
from pflseg.flare.methods import METHODS, method, own_config
from pflseg.flare.sites.ditto import DittoSite
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make, scaled


def test_ditto_round_is_fedavgs_nk_weighted_mean_of_the_global_model(tmp_path, monkeypatch):
    ctrl = make("ditto", tmp_path, monkeypatch)
    assert type(ctrl) is DittoController
    g0 = dict(ctrl.state.global_state)
    # updates (factor - 1) g0 of similar sizes: inside robust.clip's default bound, so the plain weighted mean
    n, factor = {"site-1": 1, "site-2": 1, "site-3": 2}, {"site-1": 0.5, "site-2": 1.5, "site-3": 2.0}

    def reply(site, data):
        return FLModel(params=prefixed(GLOBAL, scaled(unprefixed(GLOBAL, data.params), factor[site])),
                       metrics={"val_dice": 0.5, "val_dice_person": 0.7}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]})

    Stub(ctrl, reply)
    ctrl.round(0)
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    assert torch.allclose(ctrl.state.global_state[key], g0[key] * (0.25 * 0.5 + 0.25 * 1.5 + 0.5 * 2.0), atol=1e-6)


@pytest.mark.parametrize("lam", [0, 0.01, 2])
def test_its_config_loads_with_lam(lam):
    cfg = load_job_config("ditto", overrides={"ditto": {"lam": lam}})
    assert method(cfg) is METHODS["ditto"] and cfg["ditto"]["lam"] == lam


@pytest.mark.parametrize("lam", [-0.1, float("inf"), float("nan"), True, "1"])
def test_its_own_rule_refuses_a_bad_lam(lam):
    cfg = load_job_config("ditto")
    cfg["ditto"]["lam"] = lam  # past the loader's type check (a received config is checked by the rule alone)
    with pytest.raises(ConfigError, match=r"job ditto: ditto\.lam must be a finite number >= 0"):
        method(cfg)
    with pytest.raises(ConfigError, match=r"server job config: ditto\.lam"):  # what the server and the sites receive
        method(cfg, "server job config")


def test_the_registry_entry_and_what_reads_it():
    entry = METHODS["ditto"]
    assert (entry.controller, entry.site, entry.sections, entry.label) == (DittoController, DittoSite, ("ditto",),
                                                                           "Ditto")
    assert inside_columns()["ditto"] == (Column("Ditto global", "ditto", "global", "unet"),
                                         Column("Ditto personalized", "ditto", "site", "unet"))
    assert "ditto" in default_methods() and "ditto" in job_names()
    assert "ditto" in build_parser().parse_args(["bench"]).methods
    assert build_parser().parse_args(["bench", "--methods", "ditto"]).methods == ["ditto"]
    assert f"{DittoController.__module__}.DittoController" in pflseg_classes()  # package-mode allow list
    carried = own_config(load_job_config("ditto"))
    assert carried["ditto"] == {"lam": 0.1} and "fedprox" not in carried and "fedsm" not in carried
    assert "ditto" not in own_config(load_job_config("fedavg"))


def ditto_results(sites: list[str]) -> dict:
    score = {"global": {"dice": 0.55, "n_cases": 2, "n_images": 4},
             "site": {"dice": 0.65, "n_cases": 2, "n_images": 4, "selected_round": 2}}
    return {"method": "ditto", "sites": sites, "missing": {}, "test": {s: score for s in sites}}


def test_the_run_tables_report_its_personalized_model_and_list_its_global_one():
    res = ditto_results(["site-1", "site-2"])
    assert dice_table({"ditto": res}).splitlines()[:3] == ["| site | Ditto global | Ditto personalized |",
                                                           "|---|---|---|", "| site-1 | 0.5500 | 0.6500 |"]
    rows = {(r["site"], r["model"]): r for r in metric_rows(res)}
    assert rows["site-1", "site"]["reported"] == "yes" and rows["site-1", "global"]["dice"] == 0.55


def fake_simulator(job_dir, workspace, n_sites=3, threads=None, data=None, progress=print, clients=None, inputs=None):
    """run_simulator's stand-in: a results.json of the shape a run writes (FedAvg 0.5 everywhere, Ditto's above)."""
    job = Path(job_dir).name
    res = ditto_results(clients) if job == "ditto" else {
        "method": job, "sites": clients, "missing": {},
        "test": {s: {k: {"dice": 0.5, "n_cases": 2, "n_images": 4} for k in ("global", "global_adabn", "site")}
                 for s in clients}}
    res.update(job=job, history=[{"round": 0, "val_dice": {s: 0.5 for s in clients}, "site_metrics": {}}],
               footprint={"wall_seconds": 1.0})
    server = Path(workspace) / "state" / "server" / job
    server.mkdir(parents=True, exist_ok=True)
    (server / "results.json").write_text(json.dumps(res))
    return res


def test_the_bench_pairs_both_its_columns_with_fedavg(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator)
    root = make_synthetic(tmp_path / "root", n_sites=3, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedavg", "ditto"], seeds=[0], rounds=1, outside=False,
                  progress=lambda m: None)
    report = bench.execute()
    assert report["inside"]["Ditto personalized"]["site-1"]["mean"] == 0.65
    assert report["inside"]["Ditto global"]["site-1"]["mean"] == 0.55
    assert abs(report["inside_vs_fedavg"]["Ditto personalized"]["mean"] - 0.15) < 1e-9
    assert abs(report["inside_vs_fedavg"]["Ditto global"]["mean"] - 0.05) < 1e-9
    assert "| Ditto personalized |" in (tmp_path / "ws" / "bench.md").read_text()
