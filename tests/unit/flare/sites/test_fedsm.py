"""FedSM site: the two models and its part of the selector's fit it sends; its optimizers on the site's device."""

import pytest
import torch

from pflseg.algorithms.fedsm import TEMPERATURES, selector_gradient, selector_labels_fedsm, selector_view
from pflseg.flare.state import prefixed, unprefixed
from pflseg.nets.selector import SELECTOR_DEFAULTS, build_selector, selector_cfg
from pflseg.train import make_loader
from tests.unit.flare.sites.conftest import keys_of, optimizer_tensors_on

LDA = {"selector_fit": "lda"}
EPOCH = {"selector_fit": "softmax", "selector_steps": "epoch", "selector_input": "intensity"}
BATCH = {"selector_fit": "softmax", "selector_steps": "batch"}


def first_message(fed, label=0):
    selector = build_selector(selector_cfg(fed.cfg, 2)).state_dict()
    params = {**prefixed("global", fed.initial), **prefixed("person", fed.initial), **prefixed("select", selector)}
    return fed.message(0, params, selector_label=label), selector


@pytest.mark.parametrize("mode, selector_keys", [(LDA, {"stats"}), (EPOCH, {"grad"}), (BATCH, {"select", "moment"})])
def test_sends_global_personalized_and_its_part_of_the_selector_fit(federation, mode, selector_keys):
    fed = federation("fedsm", fedsm=mode)
    msg, selector = first_message(fed)
    out = fed.site().train(msg)
    assert keys_of(out.params, "global") == keys_of(out.params, "person") == set(fed.initial)
    assert {k.split(".")[0] for k in out.params} == {"global", "person"} | selector_keys
    if mode is LDA:  # statistics of the features of its training images, all of class 0 (its label)
        n = len(fed.site().data("training"))
        assert out.params["stats.gram"].shape == (128, 128) and out.params["stats.count"].tolist() == [n, 0]
    if mode is EPOCH:
        assert keys_of(out.params, "grad") == {k for k,
                                               _ in build_selector(selector_cfg(fed.cfg, 2)).named_parameters()}
    if mode is BATCH:
        assert keys_of(out.params, "select") == set(selector) and keys_of(out.params, "moment")
    saved = fed.store().load(0)
    assert {"optim.global", "optim.person"} <= set(saved)
    assert not any(k.startswith(("global.", "person.")) for k in saved)  # the models live at the server


def test_epoch_mode_sends_the_summed_gradient_of_its_images_seen_by_intensity(federation, monkeypatch):
    # no random dropout masks: a deterministic gradient
    monkeypatch.setitem(SELECTOR_DEFAULTS["compact"], "dropout", 0.0)
    fed = federation("fedsm", fedsm=EPOCH)
    msg, selector_state = first_message(fed, label=1)
    site = fed.site("site-2")
    out = site.train(msg)
    selector = build_selector(selector_cfg(fed.cfg, 2))
    selector.load_state_dict(selector_state)
    batches = ((selector_view(b["image"], b["intensity"], "intensity"), selector_labels_fedsm(1, b["image"].shape[0]))
               for b in make_loader(site.data("training"), 5, shuffle=True, seed=7))  # any batching: it is a sum
    expected, _ = selector_gradient(selector.train(), batches)
    got = unprefixed("grad", out.params)
    assert set(got) == set(expected)
    assert all(torch.allclose(got[k], expected[k], rtol=1e-4, atol=1e-6) for k in expected)


def test_second_round_continues_from_the_averaged_moments(federation):
    fed = federation("fedsm", fedsm=BATCH)
    msg, _ = first_message(fed)
    first = fed.site().train(msg)
    steps = first.params["moment.0.step"]
    second = fed.site().train(fed.message(1, dict(first.params), selector_label=0))
    per_round = int(steps)  # one Adam step per batch: the same number again, on top of the loaded count
    assert int(second.params["moment.0.step"]) == 2 * per_round > 0


@pytest.mark.gpu
def test_two_rounds_of_fedsm_on_cuda(federation, monkeypatch):
    fed = federation("fedsm", fedsm=BATCH)
    monkeypatch.setenv("PFLSEG_DEVICE", "cuda")
    msg, _ = first_message(fed)
    first = fed.site().train(msg)
    # moments, optimizer state from round 0
    second = fed.site().train(fed.message(1, dict(first.params), selector_label=0))
    assert keys_of(second.params, "moment") and all(v.device.type == "cpu" for v in second.params.values())
    saved = fed.store().load(1)
    assert optimizer_tensors_on(saved["optim.person"]) == {"cuda"}  # saved from the GPU optimizer


def test_selector_accuracy_on_validation_is_reported_every_round(federation):
    fed = federation("fedsm")
    assert {k: fed.cfg["fedsm"][k]
            for k in ("selector_fit", "selector_input", "selector_steps", "selector_epochs")} == {
        "selector_fit": "lda", "selector_input": "zscore", "selector_steps": "epoch", "selector_epochs": 1}
    msg, _ = first_message(fed, label=1)
    out = fed.site("site-2").train(msg)
    assert 0.0 <= out.metrics["selector_val_acc"] <= 1.0 and "selector_val_acc_local" not in out.metrics
    assert len(out.metrics["selector_val_nll"]) == len(TEMPERATURES)  # summed NLL per temperature: the server fits T
    batch = federation("fedsm", fedsm=BATCH)
    msg, _ = first_message(batch, label=1)
    out = batch.site("site-2").train(msg)
    assert out.metrics["selector_val_acc_local"] >= 0.5  # trained on one label: trivially high


@pytest.mark.parametrize("mode", [LDA, EPOCH])
def test_extra_selector_round_fits_the_k_plus_one_class_selector(federation, mode):
    fed = federation("fedsm", fedsm={**mode, "extra_rounds": 1})
    selector = build_selector(selector_cfg(fed.cfg, 3)).state_dict()  # K + 1 = 3 classes: global, site-1, site-2
    models = {k: v for name in ("global", "person.site-1", "person.site-2") for k,
              v in prefixed(name, fed.initial).items()}
    out = fed.site().train_selector(fed.message(2, {**models, **prefixed("select", selector)}))
    n = len(fed.site().data("training"))
    if mode is LDA:
        assert out.params["stats.sum"].shape == (3, 128) and out.params["stats.count"].sum() == n
    else:
        assert keys_of(out.params, "grad") == set(selector)
    assert 0.0 <= out.metrics["selector_val_acc"] <= 1.0 and out.n_samples == n


def test_infer_sends_validation_distances_inside_and_falls_back_outside_when_given_tau(federation):
    fed = federation("fedsm_infer")
    selector = build_selector(selector_cfg(fed.cfg, 2)).state_dict()  # lda: the linear head over Selector.embed
    d = selector["classifier.weight"].shape[1]
    f64 = dict(dtype=torch.float64)
    familiar = prefixed("familiar", {"mean": torch.zeros(2, d, **f64), "precision": torch.eye(d, **f64)})
    params = {**prefixed("global", fed.initial), **prefixed("person.site-1", fed.initial),
              **prefixed("person.site-2", fed.initial), **prefixed("select", selector)}
    inside = fed.site("site-1").infer(fed.message(0, {**params, **familiar}, inside_sites=["site-1", "site-2"]))
    result = inside.metrics["infer"]
    distances = result["validation_d2_min"]  # one scalar per validation image, for the server's tau
    assert len(distances) == len(fed.site("site-1").data("validation")) and all(v >= 0 for v in distances)
    assert "fallback" not in result and "d2_min" not in result  # inside sites are scored without the fallback
    outside = fed.site("site-3", sites=["site-1", "site-2", "site-3"]).infer(
        fed.message(0, {**params, **familiar}, inside_sites=["site-1", "site-2"], familiar_tau=0.0))
    result = outside.metrics["infer"]
    n = result["n_images"]
    assert result["fallback"] == {"tau": 0.0, "n_fallback": n, "n_images": n}  # every image is farther than 0
    assert all(e["selected"] == [n, 0, 0] for e in result["super"].values())
    assert result["super_nofallback"]["0.0"]["selected"][0] == 0  # the selector alone never picks global at gamma 0
    assert "d2_min" not in result and "validation_d2_min" not in result  # per-image distances of an outside site stay
