"""FedAvg's controller with a stubbed transport: the n_k-weighted mean, as a step that returns the new model."""

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make, scaled


def test_fedavg_round_is_the_nk_weighted_mean(tmp_path, monkeypatch):
    """The plain weighted mean (robust.clip off: site-3's update is 4x the others' median, which the default clip at
    3x would cut; tests/unit/flare/test_guard.py covers the clip)."""
    ctrl = make("fedavg", tmp_path, monkeypatch, robust={"median_rounds": 0})  # round 1 by the mean too
    ctrl.cfg["robust"]["clip"] = 0
    g0 = dict(ctrl.state.global_state)
    n = {"site-1": 1, "site-2": 1, "site-3": 2}
    factor = {"site-1": 1.0, "site-2": 2.0, "site-3": 3.0}

    def reply(site, data):
        state = unprefixed(GLOBAL, data.params)
        return FLModel(params=prefixed(GLOBAL, scaled(state, factor[site])), metrics={"val_dice": 0.5},
                       meta={"NUM_STEPS_CURRENT_ROUND": n[site]})

    stub = Stub(ctrl, reply)
    ctrl.round(0)
    assert [s for _, s, _ in stub.sent] == ctrl.sites
    assert all(torch.equal(unprefixed(GLOBAL, d.params)[k], g0[k]) for _, _, d in stub.sent for k in g0)
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    expected = g0[key] * (0.25 * 1 + 0.25 * 2 + 0.5 * 3)
    assert torch.allclose(ctrl.state.global_state[key], expected, atol=1e-6)


def test_aggregate_returns_the_new_model_and_leaves_the_controllers_alone(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust={"median_rounds": 0})
    g0 = dict(ctrl.state.global_state)
    state = {k: torch.zeros_like(v) for k, v in g0.items()}
    results = {s: FLModel(params=prefixed(GLOBAL, scaled(g0, f)), meta={"NUM_STEPS_CURRENT_ROUND": n})
               for s, f, n in (("site-1", 1.0, 1), ("site-2", 4.0, 3))}
    new, metrics = ctrl.aggregate(results, state, 0)
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    assert metrics == {} and torch.allclose(new[key], g0[key] * (1 * 1.0 + 3 * 4.0) / 4, atol=1e-6)
    assert list(new) == list(g0) and all(torch.equal(ctrl.state.global_state[k], g0[k]) for k in g0)
