"""Local training's controller with a stubbed transport: the initial model once, nothing aggregated."""

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from tests.unit.flare.controllers.conftest import Stub, make


def test_local_sends_initial_model_once_and_aggregates_nothing(tmp_path, monkeypatch):
    ctrl = make("local", tmp_path, monkeypatch)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params={}, metrics={"val_dice": 0.1}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    g0 = dict(ctrl.state.global_state)
    out = ctrl.round(0)
    ctrl.round(1)
    assert all(d.params for t, s, d in stub.sent[:3]) and not any(d.params for t, s, d in stub.sent[3:])
    assert all(torch.equal(ctrl.state.global_state[k], g0[k]) for k in g0)
    assert out.metrics == {"val_dice": {s: 0.1 for s in ctrl.sites}}  # each site's own model: no global to score
