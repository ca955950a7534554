"""FedBN's controller with a stubbed transport: only the shared keys travel and are averaged; a net without batch norm
is refused."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedbn import shared_keys
from pflseg.config import ConfigError, load_job_config
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed
from pflseg.nets import build_net
from tests.unit.flare.controllers.conftest import Stub, make, scaled


def test_fedbn_sends_and_averages_only_shared_keys(tmp_path, monkeypatch):
    ctrl = make("fedbn", tmp_path, monkeypatch)
    shared = set(shared_keys(build_net(ctrl.cfg["net"])))
    assert shared != set(ctrl.state.global_state)
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):
        assert set(unprefixed(GLOBAL, data.params)) == shared
        return FLModel(params=prefixed(GLOBAL, scaled(unprefixed(GLOBAL, data.params), 2.0)),
                       metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(0)
    for k in g0:
        if k in shared and g0[k].is_floating_point():
            assert torch.allclose(ctrl.state.global_state[k], 2 * g0[k])
        elif k not in shared:
            assert torch.equal(ctrl.state.global_state[k], g0[k])


def test_fedbn_refuses_a_net_without_batch_norm():
    from pflseg.flare.methods import method

    with pytest.raises(ConfigError, match=r"fedbn.*net\.norm='instance'.*net\.norm: batch"):
        method(load_job_config("fedbn", overrides={"net": {"norm": "instance"}}))
