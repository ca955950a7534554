"""Centralized training's controller with a stubbed transport: one site trains on the pooled data."""

from nvflare.app_common.abstract.fl_model import FLModel

from tests.unit.flare.controllers.conftest import Stub, make


def test_centralized_trains_at_one_site(tmp_path, monkeypatch):
    ctrl = make("centralized", tmp_path, monkeypatch)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params=data.params, metrics={"val_dice": 0.3}, meta={"NUM_STEPS_CURRENT_ROUND": 9}))
    out = ctrl.round(0)
    assert [s for _, s, _ in stub.sent] == ["site-1"]
    assert list(out.compute) == ["site-1"] and out.metrics["val_dice"] == {"site-1": 0.3}
