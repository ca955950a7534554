"""IOP-FL controllers with a stubbed transport: the routing bundle, and routing only at outside sites."""

import json

import pytest
import torch
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.methods import METHODS
from pflseg.flare.state import load_file, prefixed, save_file, unprefixed
from tests.unit.flare.controllers.conftest import TINY, Stub, make, scaled


def test_training_publishes_the_best_global_and_each_sites_p_k(tmp_path, monkeypatch):
    ctrl = make("iopfl", tmp_path, monkeypatch)
    ctrl.get_run_dir = lambda: str(tmp_path)
    ctrl.store.root.mkdir(parents=True)
    ctrl.abort_signal = Signal()
    g0 = dict(ctrl.state.global_state)
    factor = {"site-1": 2.0, "site-2": 3.0, "site-3": 4.0}

    def reply(site, data):
        task = stub.sent[-1][0]  # the task being answered
        if task == "train":
            return FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})
        if task == "validate":
            return FLModel(params={}, metrics={"val_dice": 0.4})
        if task == "test":
            return FLModel(params={}, metrics={"test": {"site": {"dice": 0.6}}})
        return FLModel(params=prefixed("site", scaled(g0, factor[site])),
                       meta={"round": 1, "fg_fraction": [factor[site] / 10]})

    stub = Stub(ctrl, reply)
    ctrl.round(0)
    ctrl.finish()
    assert [t for t, _, _ in stub.sent].count("submit_model") == 3
    bundle = load_file(tmp_path / "server" / "bundle.pt")
    assert bundle["sites"] == ["site-1", "site-2", "site-3"] and bundle["person_round"]["site-2"] == 1
    assert bundle["fg_fraction"] == {"site-1": [0.2], "site-2": [0.3], "site-3": [0.4]}  # the size prior's inputs
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    assert torch.allclose(bundle[f"person.site-3.{key}"], 4.0 * g0[key])
    assert torch.equal(unprefixed("global", bundle)[key], ctrl.state.best_state[key])
    assert json.loads((tmp_path / "server" / "results.json").read_text())["bundle"].endswith("bundle.pt")


def test_no_bundle_without_publish(tmp_path, monkeypatch):
    ctrl = make("iopfl", tmp_path, monkeypatch, iopfl={"publish": False})
    ctrl.get_run_dir = lambda: str(tmp_path)
    ctrl.store.root.mkdir(parents=True)
    ctrl.abort_signal = Signal()
    stub = Stub(ctrl, lambda site, data: FLModel(params={}, metrics={"val_dice": 0.4, "test": {}}))
    ctrl.finish()
    assert "submit_model" not in [t for t, _, _ in stub.sent] and not (tmp_path / "server" / "bundle.pt").exists()


def routing(tmp_path, monkeypatch, targets):
    from pflseg.config import load_job_config

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    state = {"w": torch.ones(2)}
    bundle = tmp_path / "server" / "iopfl"  # the trained job's state folder, inside this server's state root
    save_file(bundle / "bundle.pt", {"sites": ["site-1", "site-2"], "fg_fraction": {"site-1": [0.1, 0.4],
                                                                                      "site-2": [0.3, 0.2]},
                                     **prefixed("global", state),
                                                   **prefixed("person.site-1", state),
                                                   **prefixed("person.site-2", state)})
    cfg = load_job_config("iopfl_route", overrides={**TINY, "iopfl": {"bundle": str(bundle), "targets": targets}})
    ctrl = METHODS["iopfl_route"].controller(config=cfg)
    ctrl.sample_clients = lambda: ["site-1", "site-2", "site-3"]
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    stub = Stub(ctrl, lambda site, data: FLModel(params={}, metrics={"route": {"methods": {}}}))
    ctrl.run()
    return stub, panics


@pytest.mark.parametrize("targets", [[], ["site-3"]])
def test_routing_goes_to_outside_sites_only(tmp_path, monkeypatch, targets):
    stub, panics = routing(tmp_path, monkeypatch, targets)
    assert not panics and [(t, s) for t, s, _ in stub.sent] == [("route", "site-3")]
    sent = stub.sent[0][2]
    assert sorted(sent.params) == ["global.w", "person.site-1.w", "person.site-2.w"]
    assert sent.meta["inside_sites"] == ["site-1", "site-2"]
    assert sent.meta["prior"] == pytest.approx([0.2, 0.3])  # per class, the mean of the inside sites' fractions
    assert json.loads((tmp_path / "server" / "iopfl_route" / "results.json").read_text())["targets"] == ["site-3"]


@pytest.mark.parametrize("targets, message",
                         [(["site-2"], "site-2 is an inside site"), (["site-9"], "site-9 is not connected")])
def test_routing_refuses_inside_and_unknown_targets(tmp_path, monkeypatch, targets, message):
    stub, panics = routing(tmp_path, monkeypatch, targets)
    assert not stub.sent and len(panics) == 1 and message in panics[0]
