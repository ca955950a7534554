"""GRACE's controller with a stubbed transport: the re-weighting step returns the new model and the weights."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.state import RoundStore
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make, scaled


def test_grace_identical_updates_give_uniform_weights_and_fedavg(tmp_path, monkeypatch):
    ctrl = make("grace", tmp_path, monkeypatch)
    g0 = dict(ctrl.state.global_state)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params=prefixed(GLOBAL, scaled(unprefixed(GLOBAL, data.params), 2.0)),
                              metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    out = ctrl.round(0)
    weights = out.metrics["grace_weights"]
    assert stub.scalars == [("grace_weight", weights, 0)]  # TensorBoard, tb_events/<server name>
    assert sorted(weights) == ctrl.sites and all(w == pytest.approx(1 / 3) for w in weights.values())
    assert out.metrics["similarity"]["sites"] == ctrl.sites and len(out.metrics["similarity"]["matrix"]) == 3
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0 and "adn" not in k)
    assert torch.allclose(ctrl.state.global_state[key], 2 * g0[key], atol=1e-6)


def test_grace_needs_two_sites(tmp_path, monkeypatch):
    ctrl = make("grace", tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="at least 2"):
        ctrl.init_state(ctrl.cfg, ["site-1"], RoundStore(tmp_path / "server"))
