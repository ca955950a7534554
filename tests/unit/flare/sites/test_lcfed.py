"""LC-Fed and FedRep sites: the shared part (and with HC the coarse head) leaves; heads stay."""

import pytest

from pflseg.config import ConfigError, load_job_config
from pflseg.flare.methods import method
from pflseg.flare.sites import lcfed as lcfed_site
from pflseg.nets import build_net
from pflseg.nets.lcfed import personal_keys, shared_keys
from tests.unit.flare.sites.conftest import keys_of

LC = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}}


def test_lcfed_sends_the_shared_part_and_its_coarse_head(federation):
    fed = federation("lcfed", **LC)
    net = build_net(fed.cfg["net"])
    out = fed.site().train(fed.message(0))
    assert keys_of(out.params, "global") == set(shared_keys(net))
    assert keys_of(out.params, "head") == {"weight", "bias"}
    saved = keys_of(fed.store().load(0), "model")
    assert set(personal_keys(net)) <= saved  # both heads kept at the site


@pytest.mark.parametrize("job, hc_map", [("lcfed_hczero", "zeros"), ("lcfed_hcself", "self_uncertainty")])
def test_hc_controls_calibrate_without_sending_a_head(federation, job, hc_map):
    fed = federation(job, **LC)
    site = fed.site()
    assert site.step_cfg["hc"] is True and site.step_cfg["hc_map"] == hc_map
    out = site.train(fed.message(0))
    assert (keys_of(out.params, "global") == set(shared_keys(build_net(fed.cfg["net"])))
            and not keys_of(out.params, "head"))


def test_windows_are_given_at_the_papers_image_size(federation):
    cfg = federation("lcfed", **LC).site().step_cfg
    assert ((cfg["nms_window"], cfg["gauss_size"], cfg["window_ref_size"], cfg["hc_map"])
            == (11, 11, 384, "disagreement"))


def test_unknown_hc_map_is_a_config_error():
    with pytest.raises(ConfigError, match=r"lcfed\.hc_map"):
        method(load_job_config("lcfed", overrides={"lcfed": {"hc_map": "ones"}}))


def test_fedrep_sends_no_head(federation):
    fed = federation("fedrep", **LC)
    out = fed.site().train(fed.message(0))
    assert (keys_of(out.params, "global") == set(shared_keys(build_net(fed.cfg["net"])))
            and not keys_of(out.params, "head"))
    assert fed.site().step_cfg["hc"] is False and fed.site().step_cfg["lam"] == 0.0


def test_lcfed_test_task_draws_the_reported_models_overlays(federation):
    fed = federation("lcfed", **LC)
    site = fed.site()
    site.train(fed.message(0))
    out = site.test(fed.message(1, params={}))
    assert 0.0 <= out.metrics["test"]["site"]["dice"] <= 1.0
    assert list((fed.store().root / "overlays").glob("*.png"))  # its worst and best test cases (one here)


def test_fedrep_head_first_fraction_splits_the_rounds_iterations(federation, monkeypatch):
    fed = federation("fedrep", **LC)
    assert fed.cfg["lcfed"]["head_first_fraction"] == 0.2 and fed.cfg["lcfed"]["head_first_iters"] == 0
    site = fed.site()
    heads = set(personal_keys(site.net))
    phases = []

    def record(model, *args):  # which parameters this step would train
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        phases.append("head" if trained <= heads else "body" if not trained & heads else "all")
        return {"loss": 0.0}

    monkeypatch.setattr(lcfed_site, "lcfed_step", record)
    step = site.schedule({}, total=10).step
    for _ in range(10):
        step(site.net, None, None, None)
    assert phases == ["head"] * 2 + ["body"] * 8


def test_head_first_fraction_and_iters_are_exclusive():
    with pytest.raises(ConfigError, match=r"lcfed\.head_first_iters.*lcfed\.head_first_fraction"):
        method(load_job_config("fedrep", overrides={"lcfed": {"head_first_iters": 10}}))
