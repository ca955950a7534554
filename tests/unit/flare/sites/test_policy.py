"""The site's policy where a site class decides: Centralized's pooling, IOP-FL's submit_model; the data source a
test reply names (pflseg.flare.policy, pflseg.flare.client.answer)."""

import pytest

from pflseg.flare.client import answer
from pflseg.flare.policy import SIMULATOR_JOB_ID, PolicyError
from pflseg.flare.sites.centralized import CentralizedSite

PROD = "0d3c2f6e-job"  # a POC / provisioned job id


def test_a_server_cannot_make_a_deployed_site_train_on_other_sites_folders(federation):
    """Before: Centralized at site-1 pooled every site of the job from site-1's data root, whatever the site said."""
    fed = federation("centralized")
    with pytest.raises(PolicyError, match=r"site site-1: the site's policy refuses training on other sites' folders "
                                          r"\['site-2'\] .*policy\.pooling: null .*--allow-pooling"):
        CentralizedSite("site-1", fed.cfg, ["site-1", "site-2"], PROD)
    site = CentralizedSite("site-1", fed.cfg, ["site-1", "site-2"], SIMULATOR_JOB_ID)
    assert site.pool_sites == ["site-1", "site-2"]  # the simulator pools, as before


def test_a_deployed_site_pools_when_its_policy_allows(federation, tmp_path, monkeypatch):
    fed = federation("centralized")
    config = tmp_path / "pflseg_site.json"
    config.write_text('{"policy": {"pooling": true}}')
    monkeypatch.setenv("PFLSEG_SITE_CONFIG", str(config))
    site = CentralizedSite("site-1", fed.cfg, ["site-1", "site-2"], PROD)
    assert site.pool_sites == ["site-1", "site-2"]


def test_submit_model_hands_out_p_k_only_when_the_job_publishes_it(federation):
    """Before: submit_model returned P_k even with iopfl.publish: false."""
    fed = federation("iopfl", iopfl={"publish": False})
    site = fed.site()
    site.train(fed.message(0))
    with pytest.raises(PolicyError, match=r"site site-1: refusing submit_model: job iopfl has iopfl\.publish: false"):
        site.submit_model(fed.message(1, {}))


def test_submit_model_respects_a_site_that_keeps_p_k(federation, tmp_path, monkeypatch):
    fed = federation("iopfl")
    site = fed.site()
    site.train(fed.message(0))
    assert site.submit_model(fed.message(1, {})).params  # published by default
    config = tmp_path / "pflseg_site.json"
    config.write_text('{"policy": {"publish": false}}')
    monkeypatch.setenv("PFLSEG_SITE_CONFIG", str(config))  # tightened after training: holds for submit_model
    with pytest.raises(PolicyError, match=r"refuses handing out its P_k .*policy\.publish: false"):
        site.submit_model(fed.message(1, {}))


def test_a_test_reply_names_the_sites_data_source(federation):
    fed = federation("fedavg")
    out, site = answer("site-1", "train", fed.message(0), None)
    out, site = answer("site-1", "test", fed.message(1), site)
    assert out.metrics["test"]["data_source"] == "site data" and "site" in out.metrics["test"]
