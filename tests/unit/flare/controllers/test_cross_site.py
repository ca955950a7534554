"""Cross-site evaluation's controller with a stubbed transport: every (model, site) cell, FLARE's file shape, and
personalized models kept at the sites scored elsewhere only when their site publishes them."""

import json
from pathlib import Path

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import load_job_config
from pflseg.eval.plots import write_results
from pflseg.eval.tables import run_tables
from pflseg.flare.methods import personalized_methods, server_controller
from pflseg.flare.state import prefixed, save_file
from pflseg.nets import build_net
from tests.unit.flare.controllers.conftest import SITES, TINY, Stub


def trained_run(tmp_path, method: str, person: bool = False, **over) -> tuple:
    """A finished training run's server state folder (final.pt, results.json) inside the state root."""
    cfg = load_job_config(method, overrides={**TINY, **over})
    state = dict(build_net(cfg["net"]).state_dict())
    ckpt = {"round": 2, **prefixed("global", state), **prefixed("best", state)}
    if person:
        for site in SITES:
            ckpt.update(prefixed(f"person.{site}", state))
    folder = tmp_path / "server" / method
    save_file(folder / "final.pt", ckpt)
    test = {s: {"global": {"dice": 0.5}, "site": {"dice": 0.6}} for s in SITES}
    (folder / "results.json").write_text(json.dumps({"job": method, "method": method, "sites": SITES, "test": test,
                                                     "config": cfg}))
    return folder, state


def run(tmp_path, monkeypatch, folder, own=None, **over):
    """Run the cross_site controller against ``folder``; ``own(site)``: the site's answer to ``own_model``."""
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    cfg = load_job_config("cross_site", overrides={**TINY, "cross_site": {"bundle": str(folder)}, **over})
    ctrl = server_controller(cfg)
    ctrl.sample_clients = lambda: list(SITES)
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append

    def reply(site, data):
        if stub.sent[-1][0] == "own_model":
            return own(site)
        dice = {m: 0.1 * (1 + SITES.index(site)) + (0.01 if m == "global" else 0.02) for m in data.meta["models"]}
        return FLModel(params={}, metrics={"scores": {m: {"dice": d, "n_cases": 2} for m, d in dice.items()}})

    stub = Stub(ctrl, reply)
    ctrl.run()
    assert not panics, panics
    return stub, json.loads((tmp_path / "server" / "cross_site" / "results.json").read_text())


def test_a_global_method_fills_the_global_column_at_every_site_in_flares_shape(tmp_path, monkeypatch):
    folder, _ = trained_run(tmp_path, "fedavg", data={"size": 32})
    stub, results = run(tmp_path, monkeypatch, folder)
    assert [(t, s) for t, s, _ in stub.sent] == [("cross_site", s) for s in SITES]  # no own_model: not personalized
    assert all(d.meta["pflseg"]["data"]["size"] == 32 for _, _, d in stub.sent)  # the trained run's data section
    assert all(sorted(d.params) == sorted(prefixed("global", build_net(d.meta["pflseg"]["net"]).state_dict()))
               for _, _, d in stub.sent)
    flare = json.loads((tmp_path / "server" / "cross_site" / "cross_val_results.json").read_text())
    assert flare == json.loads((tmp_path / "run" / "cross_site_val" / "cross_val_results.json").read_text())
    assert flare == {s: {"global": {"dice": 0.1 * (1 + i) + 0.01, "n_cases": 2}} for i, s in enumerate(SITES)}
    assert results["cross_site"]["matrix"] == flare and results["cross_site"]["models"] == ["global"]
    md = (tmp_path / "server" / "cross_site" / "cross_val_results.md").read_text()
    assert "| site \\ model | global |" in md and "| site-3 | 0.3100 |" in md
    # what `pflseg run` prints and writes comes from the job's own report, not from a branch on the job's name
    assert results["report"] == {"markdown": md.rstrip("\n"), "files": {"cross_val_results.json": flare}}
    assert run_tables(results, "cross_site") == [md.rstrip("\n")]
    write_results({**results, "job": "cross_site"}, tmp_path / "ws")
    assert json.loads((tmp_path / "ws" / "results" / "cross_val_results.json").read_text()) == flare
    assert (tmp_path / "ws" / "results" / "cross_site.md").read_text() == md


def test_server_held_personalized_models_go_to_every_site(tmp_path, monkeypatch):
    folder, _ = trained_run(tmp_path, "fedsm", person=True)
    stub, results = run(tmp_path, monkeypatch, folder)
    assert [t for t, _, _ in stub.sent] == ["cross_site"] * 3
    models = ["global", *SITES]
    assert all(d.meta["models"] == models for _, _, d in stub.sent)
    matrix = results["cross_site"]["matrix"]
    assert {(s, m) for s, row in matrix.items() for m in row} == {(s, m) for s in SITES for m in models}


def test_models_kept_at_the_sites_leave_only_where_the_site_publishes(tmp_path, monkeypatch):
    folder, state = trained_run(tmp_path, "fedbn")

    def own(site):
        if site == "site-2":  # its policy keeps the model at the site: its scores only
            return FLModel(params={}, metrics={"own": {"dice": 0.9}}, meta={"published": 0, "why": "policy.publish"})
        return FLModel(params=prefixed("site", state), metrics={"own": {"dice": 0.8}}, meta={"published": 1})

    stub, results = run(tmp_path, monkeypatch, folder, own=own)
    assert [(t, s) for t, s, _ in stub.sent[:3]] == [("own_model", s) for s in SITES]
    assert all(d.meta["trained_job"] == "fedbn" for _, _, d in stub.sent[:3])
    sent = {s: d for t, s, d in stub.sent if t == "cross_site"}
    assert sent["site-1"].meta["models"] == ["global", "site-3"]  # its own: scored already; site-2's: not published
    assert sent["site-2"].meta["models"] == ["global", "site-1", "site-3"]
    assert torch.equal(sent["site-2"].params[f"person.site-1.{next(iter(state))}"], next(iter(state.values())))
    xs = results["cross_site"]
    assert xs["models"] == ["global", *SITES]
    cells = {(s, m) for s, row in xs["matrix"].items() for m in row}
    assert cells == {(s, m) for s in SITES for m in ("global", "site-1", "site-3")} | {("site-2", "site-2")}
    assert xs["matrix"]["site-2"]["site-2"] == {"dice": 0.9} and xs["matrix"]["site-1"]["site-1"] == {"dice": 0.8}
    assert any("site-2's model scored at site-2 only: policy.publish" in n for n in xs["notes"])
    md = (tmp_path / "server" / "cross_site" / "cross_val_results.md").read_text()
    assert "| site-1 | 0.1100 | 0.8000 | - | 0.1200 |" in md


def test_a_published_model_of_the_wrong_shape_stays_in_its_own_cell(tmp_path, monkeypatch):
    folder, state = trained_run(tmp_path, "fedbn")
    key = next(k for k, v in state.items() if v.is_floating_point())
    bad = {**state, key: torch.zeros(3)}
    stub, results = run(tmp_path, monkeypatch, folder, own=lambda site: FLModel(
        params=prefixed("site", bad if site == "site-3" else state), metrics={"own": {"dice": 0.8}},
        meta={"published": 1}))
    assert "site-3" not in {m for _, _, d in stub.sent if d.meta.get("models") for m in d.meta["models"]}
    assert list(results["cross_site"]["matrix"]["site-1"]) == ["global", "site-1", "site-2"]
    assert any("site-3's model scored at site-3 only" in n and "shape" in n for n in results["cross_site"]["notes"])


def test_personal_false_scores_the_global_model_only(tmp_path, monkeypatch):
    folder, _ = trained_run(tmp_path, "fedbn")
    stub, results = run(tmp_path, monkeypatch, folder, cross_site={"bundle": str(folder), "personal": False})
    assert [t for t, _, _ in stub.sent] == ["cross_site"] * 3 and results["cross_site"]["models"] == ["global"]


def test_a_folder_without_a_finished_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    cfg = load_job_config("cross_site", overrides={**TINY, "cross_site": {"bundle": str(tmp_path / "server" / "x")}})
    ctrl = server_controller(cfg)
    ctrl.sample_clients = lambda: list(SITES)
    ctrl.info = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    ctrl.run()
    assert len(panics) == 1 and "holds no finished run" in panics[0]


def test_the_registry_names_the_personalized_methods_in_the_job_it_builds():
    """The controller does not import the registry (which imports it): the registry gives it the methods whose sites
    keep their own models, and the exported job carries them (tests/unit/flare/test_jobs.py: jobs/ is a fresh
    export)."""
    named = personalized_methods()
    assert {"fedbn", "local", "fedsm", "iopfl", "grace", "ft"} <= set(named) and "fedavg" not in named
    ctrl = server_controller(load_job_config("cross_site"))
    assert ctrl.personalized_methods == named
    exported = Path(__file__).resolve().parents[4] / "jobs" / "cross_site" / "app" / "config" / "config_fed_server.json"
    assert json.loads(exported.read_text())["workflows"][0]["args"]["personalized_methods"] == named
