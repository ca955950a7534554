"""The base of every workflow (``pflseg.flare.controllers.base``), shown on FedAvg with a stubbed transport: the state
``init_state`` sets, what a round returns, answers left out and re-admitted, the best global model, the state folder
claimed for the job id, resume."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import load_job_config
from pflseg.flare.checks import check_update
from pflseg.flare.controllers.base import Answers, RoundError, RoundOutput
from pflseg.flare.methods import METHODS
from pflseg.flare.state import RoundStore
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from pflseg.nets import build_net
from tests.unit.flare.controllers.conftest import SITES, TINY, Stub, make, scaled


def test_init_state_sets_the_whole_state_in_one_place(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    cfg = load_job_config("fedavg", overrides=TINY)
    ctrl = METHODS["fedavg"].controller(config=cfg)
    store = RoundStore(tmp_path / "server")
    assert ctrl.init_state(cfg, ["site-2", "site-1"], store) == 0  # nothing to resume: round 0 first
    assert ctrl.cfg is cfg and ctrl.sites == ["site-1", "site-2"] and ctrl.store is store
    assert ctrl.missing == {} and ctrl.state.history == [] and ctrl.state.n_first == {} and ctrl.state.best_state == {}
    assert ctrl.state.best == {"round": -1, "score": -1.0}
    assert set(ctrl.state.global_state) == set(build_net(cfg["net"]).state_dict())


def test_a_round_returns_what_the_run_loop_keeps(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    Stub(ctrl, lambda site, data: FLModel(params=data.params, metrics={"val_dice": 0.5, "compute_seconds": 2.0,
                                                                       "train_loss": 0.25},
                                          meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    out = ctrl.round(0)
    assert isinstance(out, RoundOutput) and out.compute == {s: 2.0 for s in SITES}
    assert out.metrics == {"val_dice": {s: 0.5 for s in SITES}, "val_dice_mean": 0.5}
    # not compute_seconds; the guard's update_ratio (each site's update norm over the others' median: 0 here)
    assert out.site_metrics == {s: {"val_dice": 0.5, "train_loss": 0.25, "update_ratio": 0.0} for s in SITES}
    assert not hasattr(ctrl, "round_metrics") and not hasattr(ctrl, "site_metrics")  # nothing left on the controller


def test_send_each_returns_the_usable_answers_with_their_site_metrics(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, min_clients=1)
    Stub(ctrl, lambda site, data: None if site == "site-2" else FLModel(params={}, metrics={"val_dice": 0.5}))
    answers = ctrl.send_each("validate", {s: ctrl.message(0) for s in SITES})
    assert isinstance(answers, Answers) and list(answers) == ["site-1", "site-3"]
    assert answers.site_metrics == {"site-1": {"val_dice": 0.5}, "site-3": {"val_dice": 0.5}}


def test_nan_and_misshaped_updates_are_left_out_and_named(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    key = next(k for k, v in ctrl.state.global_state.items() if v.is_floating_point())

    def reply(site, data):
        state = dict(unprefixed(GLOBAL, data.params))
        if site == "site-2":
            state[key] = torch.full_like(state[key], float("nan"))
        if site == "site-3":
            state[key] = torch.zeros(1)
        return FLModel(params=prefixed(GLOBAL, state), metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    with pytest.raises(RoundError, match="site-2.*NaN|site-3.*shape"):
        ctrl.round(0)  # min_clients = 2 but only site-1 is usable
    assert set(ctrl.missing) == {"site-2", "site-3"}
    assert "NaN" in ctrl.missing["site-2"] and "shape" in ctrl.missing["site-3"]


def test_missing_site_round_completes_with_min_clients(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)

    def reply(site, data):
        if site == "site-3":
            return None  # died
        return FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(0)
    assert "site-3" in ctrl.missing
    ctrl.store.save(0, ctrl.checkpoint(0))
    resumed = make("fedavg", tmp_path, monkeypatch, resume=True)  # results.json names it after a resume too
    assert resumed.missing == ctrl.missing and resumed.missing["site-3"].startswith("no result")


def test_best_global_follows_weighted_validation(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    dice = {"site-1": 0.2, "site-2": 0.8, "site-3": 0.8}
    Stub(ctrl, lambda site, data: FLModel(params=data.params, metrics={"val_dice": dice[site]},
                                          meta={"NUM_STEPS_CURRENT_ROUND": 1 if site == "site-1" else 3}))
    out = ctrl.round(0)
    assert ctrl.state.best["round"] == 0 and set(ctrl.state.best_state) == set(ctrl.state.global_state)
    assert ctrl.state.best["score"] == pytest.approx((0.2 * 1 + 0.8 * 3 + 0.8 * 3) / 7) == out.metrics["val_dice_mean"]


def test_check_update_reasons():
    ref = {"global.w": torch.zeros(2)}
    assert check_update({"global.w": torch.ones(2)}, ref) is None
    assert "unexpected" in check_update({"global.v": torch.ones(2)}, ref)
    assert "shape" in check_update({"global.w": torch.ones(3)}, ref)
    assert "Inf" in check_update({"global.w": torch.tensor([1.0, float("inf")])}, ref)


def test_a_site_that_gave_no_result_is_sent_the_next_round_and_counts_when_it_answers(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    g0 = dict(ctrl.state.global_state)
    factor = {"site-1": 1.0, "site-2": 1.0, "site-3": 4.0}

    def reply(site, data):
        if site == "site-3" and data.current_round == 0:
            return None  # timed out / crashed in round 0
        return FLModel(params=prefixed(GLOBAL, scaled(unprefixed(GLOBAL, data.params), factor[site])),
                       metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    stub = Stub(ctrl, reply)
    out = ctrl.round(0)
    assert "site-3" in ctrl.missing and set(out.metrics["val_dice"]) == {"site-1", "site-2"}
    g1 = dict(ctrl.state.global_state)
    out = ctrl.round(1)
    assert [s for t, s, d in stub.sent if d.current_round == 1] == ["site-1", "site-2", "site-3"]  # re-admitted
    assert set(out.metrics["val_dice"]) == {"site-1", "site-2", "site-3"}
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    # site-3 in round 1's mean
    assert torch.allclose(ctrl.state.global_state[key], g1[key] * (1 + 1 + 4) / 3, atol=1e-6)


def test_a_site_that_fails_again_is_left_out_of_that_round_again(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    Stub(ctrl, lambda site, data: None if site == "site-3" else
         FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    for r in range(2):
        out = ctrl.round(r)
        assert set(out.metrics["val_dice"]) == {"site-1", "site-2"} and "site-3" in ctrl.missing


def test_the_default_task_timeout_is_finite():
    assert 0 < load_job_config("fedavg")["task_timeout"] <= 24 * 3600


class Ctx:
    def __init__(self, job_id):
        self.job_id = job_id

    def get_job_id(self):
        return self.job_id


def server(tmp_path, monkeypatch, job_id, **over):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    ctrl = METHODS["fedavg"].controller(config=load_job_config("fedavg", overrides={**TINY, **over}))
    ctrl.fl_ctx = Ctx(job_id)
    ctrl.sample_clients = lambda: ["site-1", "site-2"]
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    return ctrl, panics


def test_the_server_claims_its_state_folder_for_the_job_id(tmp_path, monkeypatch):
    from pflseg.flare.state import owner, release

    folder = tmp_path / "server" / "fedavg"
    first, _ = server(tmp_path, monkeypatch, "job-a")
    assert first.setup() == 0 and owner(folder) == "job-a"
    first.store.save(0, {"round": 0})
    second, panics = server(tmp_path, monkeypatch, "job-b")
    assert second.setup() is None  # job-a still runs: job-b ends at once
    assert f"state folder {folder} is in use by job job-a" in panics[0]
    release(folder)  # job-a ends
    third, panics = server(tmp_path, monkeypatch, "job-b")
    try:
        assert third.setup() == 0 and not panics and owner(folder) == "job-b"
        assert (tmp_path / "server" / "fedavg.job-a" / "round_0000.pt").is_file() and third.store.rounds() == []
    finally:
        release(folder)


def test_resume_with_another_network_says_the_config_no_longer_matches_the_checkpoint(tmp_path, monkeypatch):
    first = make("fedavg", tmp_path, monkeypatch)
    first.store.save(0, first.checkpoint(0))
    assert make("fedavg", tmp_path, monkeypatch, resume=True).restore() == 1  # the same network resumes
    with pytest.raises(ValueError, match=r"config no longer matches the checkpoint .*(in the checkpoint|now)"):
        make("fedavg", tmp_path, monkeypatch, resume=True, net={"channels": [4, 8, 16], "strides": [2, 2]})


def test_an_optimizer_state_of_another_network_is_named_not_torchs_error():
    from pflseg.train.loop import build_optimizer

    state = build_optimizer(build_net({"channels": [4, 8], "strides": [2]}), torch.device("cpu"), 1e-3).state_dict()
    with pytest.raises(ValueError, match="config no longer matches the checkpoint"):
        build_optimizer(build_net({"channels": [4, 8, 16], "strides": [2, 2]}), torch.device("cpu"), 1e-3, state)
