"""FedSM site: the three models and the selector moments it sends; its optimizers on the site's device."""

import pytest
import torch

from pflseg.flare.state import prefixed
from pflseg.nets.selector import build_selector, selector_cfg
from tests.unit.flare.sites.conftest import keys_of, optimizer_tensors_on


def first_message(fed, label=0):
    selector = build_selector(selector_cfg(fed.cfg, 2)).state_dict()
    params = {**prefixed("global", fed.initial), **prefixed("person", fed.initial), **prefixed("select", selector)}
    return fed.message(0, params, selector_label=label), selector


def test_sends_global_personalized_selector_and_moments(federation):
    fed = federation("fedsm")
    msg, selector = first_message(fed)
    out = fed.site().train(msg)
    assert keys_of(out.params, "global") == keys_of(out.params, "person") == set(fed.initial)
    assert keys_of(out.params, "select") == set(selector)
    assert keys_of(out.params, "moment")
    saved = fed.store().load(0)
    assert {"optim.global", "optim.person"} <= set(saved)
    assert not any(k.startswith(("global.", "person.")) for k in saved)  # the models live at the server


def test_second_round_continues_from_the_averaged_moments(federation):
    fed = federation("fedsm", fedsm={"selector_steps": "batch"})
    msg, _ = first_message(fed)
    first = fed.site().train(msg)
    steps = first.params["moment.0.step"]
    second = fed.site().train(fed.message(1, dict(first.params), selector_label=0))
    per_round = int(steps)  # one Adam step per batch: the same number again, on top of the loaded count
    assert int(second.params["moment.0.step"]) == 2 * per_round > 0


@pytest.mark.gpu
def test_two_rounds_of_fedsm_on_cuda(federation, monkeypatch):
    fed = federation("fedsm")
    monkeypatch.setenv("PFLSEG_DEVICE", "cuda")
    msg, _ = first_message(fed)
    first = fed.site().train(msg)
    second = fed.site().train(fed.message(1, dict(first.params), selector_label=0))  # moments, optimizer state from round 0
    assert keys_of(second.params, "moment") and all(v.device.type == "cpu" for v in second.params.values())
    saved = fed.store().load(1)
    assert optimizer_tensors_on(saved["optim.person"]) == {"cuda"}  # saved from the GPU optimizer


def test_selector_accuracy_on_validation_is_reported_every_round(federation):
    fed = federation("fedsm")
    assert fed.cfg["fedsm"]["selector_steps"] == "batch"  # the paper's per-batch steps by default
    msg, _ = first_message(fed, label=1)
    out = fed.site("site-2").train(msg)
    assert 0.0 <= out.metrics["selector_val_acc"] <= 1.0 and out.metrics["selector_val_acc_local"] >= 0.5  # trained on one label
