"""LC-Fed and FedRep sites: the shared part (and with HC the coarse head) leaves; heads stay."""

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


def test_fedrep_sends_no_head(federation):
    fed = federation("fedrep", **LC)
    out = fed.site().train(fed.message(0))
    assert keys_of(out.params, "global") == set(shared_keys(build_net(fed.cfg["net"]))) and not keys_of(out.params, "head")
    assert fed.site().step_cfg["hc"] is False and fed.site().step_cfg["lam"] == 0.0


def test_lcfed_test_task_draws_the_reported_models_overlays(federation):
    fed = federation("lcfed", **LC)
    site = fed.site()
    site.train(fed.message(0))
    out = site.test(fed.message(1, params={}))
    assert 0.0 <= out.metrics["test"]["site"]["dice"] <= 1.0
    assert list((fed.store().root / "overlays").glob("*.png"))  # its worst and best test cases (one here)
