"""The site's own policy (pflseg.flare.policy): the site decides what it runs and what leaves it, not the job.

Every refusal names the site, the key, the settings file and the fix; the defaults allow what the job asks, so
the simulator runs as before; K = 2, pooling and the synthetic fall-back are refused in a deployment by default.
"""

import json

import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import check_effective, load_job_config
from pflseg.flare.policy import POLICY, SIMULATOR_JOB_ID, PolicyError, check_policy, check_task, deployed
from pflseg.flare.settings import site_settings

THREE = ["site-1", "site-2", "site-3"]
PROD = "0d3c2f6e-job"  # a POC / provisioned job id (FLARE's simulator runs every job as ``simulate_job``)


def job(name="fedavg", **over):
    return check_effective(load_job_config(name, overrides=over))


def settings_with(tmp_path, monkeypatch, data="/data/pflseg", **policy):
    """The site's settings from a local/pflseg_site.json holding ``policy``, as a kit would."""
    monkeypatch.chdir(tmp_path)
    for var in ("PFLSEG_DATA", "PFLSEG_SITE_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "local").mkdir(exist_ok=True)
    body = {"data": data, **({"policy": policy} if policy else {})}
    (tmp_path / "local" / "pflseg_site.json").write_text(json.dumps(body))
    return site_settings("site-1")


def test_deployment_is_any_flare_job_id_but_the_simulators():
    assert deployed(PROD) and not deployed(SIMULATOR_JOB_ID) and not deployed(None)


def test_the_defaults_allow_what_any_committed_job_asks_in_the_simulator(tmp_path, monkeypatch):
    settings = settings_with(tmp_path, monkeypatch)
    assert settings["policy"] == {k: d for k, (d, _, _) in POLICY.items()}
    for name in ("fedavg", "fedsm", "iopfl", "lcfed", "centralized"):
        for sites in (THREE, THREE[:2]):
            check_task("site-1", "train", job(name, privacy={"per_case": True, "round_test": True}), sites, settings,
                       SIMULATOR_JOB_ID)


@pytest.mark.parametrize("policy, over, key", [
    ({"per_case": False}, {"privacy": {"per_case": True}}, "per_case"),
    ({"round_test": False}, {"method": "iopfl", "privacy": {"round_test": True}}, "round_test"),
    ({"methods": ["fedbn", "local"]}, {}, "methods"),
])
def test_what_the_job_asks_and_the_site_forbids_is_refused_naming_key_file_and_fix(policy, over, key, tmp_path,
                                                                                   monkeypatch):
    settings = settings_with(tmp_path, monkeypatch, **policy)
    name = over.pop("method", "fedavg")
    with pytest.raises(PolicyError,
                       match=rf"site site-1: the site's policy refuses .*policy\.{key}: .*pflseg_site\.json"
                                          r"\); "):
        check_task("site-1", "train", job(name, **over), THREE, settings, SIMULATOR_JOB_ID)


@pytest.mark.parametrize("name, over", [("fedsm", {}), ("lcfed", {}), ("iopfl", {})])
def test_a_site_that_keeps_its_personalized_model_refuses_the_jobs_that_send_it(name, over, tmp_path, monkeypatch):
    settings = settings_with(tmp_path, monkeypatch, publish=False)
    with pytest.raises(PolicyError, match=r"refuses sending .*policy\.publish: false"):
        check_task("site-1", "train", job(name, **over), THREE, settings, PROD)
    # the same methods without sending it: LC-Fed without HC's head exchange, IOP-FL without the bundle
    check_task("site-1", "train", job("lcfed", lcfed={"hc": False}), THREE, settings, PROD)
    check_task("site-1", "train", job("iopfl", iopfl={"publish": False}), THREE, settings, PROD)


def test_two_sites_are_refused_in_a_deployment_unless_the_site_allows_it(tmp_path, monkeypatch):
    """With K = 2 SoftPull's mix and LC-Fed's equal-weight body give a site the other site's model exactly."""
    settings = settings_with(tmp_path, monkeypatch)
    for name in ("fedsm", "lcfed", "fedavg"):
        with pytest.raises(PolicyError,
                           match=r"refuses a \w+ job of exactly two sites .*policy\.two_sites: false.*three "
                                              r"or more sites"):
            check_task("site-1", "train", job(name), THREE[:2], settings, PROD)
        check_task("site-1", "train", job(name), THREE, settings, PROD)  # K = 3: allowed
        check_task("site-1", "train", job(name), THREE[:2], settings, SIMULATOR_JOB_ID)  # the simulator: as before
    check_task("site-1", "train", job("local"), THREE[:2], settings, PROD)  # nothing is exchanged
    allowing = settings_with(tmp_path, monkeypatch, two_sites=True)
    check_task("site-1", "train", job("fedsm"), THREE[:2], allowing, PROD)


def test_a_deployed_site_without_data_refuses_the_synthetic_fallback_unless_the_job_opts_in(tmp_path, monkeypatch):
    settings = settings_with(tmp_path, monkeypatch, data=None)
    assert settings["data"] is None
    with pytest.raises(PolicyError, match=r"site site-1: no data configured .*data\.allow_synthetic.*pflseg site init "
                                          r"--data DIR"):
        check_task("site-1", "train", job(), THREE, settings, PROD)
    check_task("site-1", "train", job(data={"allow_synthetic": True}), THREE, settings, PROD)
    check_task("site-1", "train", job(), THREE, settings, SIMULATOR_JOB_ID)  # the simulator makes it, as before


@pytest.mark.parametrize("policy, match", [
    ({"publsh": False}, r"unknown policy key\(s\) \['publsh'\]"),
    ({"publish": "no"}, r"policy\.publish in .* must be true or false, got 'no'"),
    ({"methods": ["fedavg", "fedfoo"]}, r"policy\.methods .* unknown method\(s\) \['fedfoo'\]"),
    ([], r"'policy' in .* must be an object"),
])
def test_a_malformed_policy_is_an_error_naming_the_file_and_key(policy, match):
    with pytest.raises(PolicyError, match=match):
        check_policy(policy, "/opt/site-1/local/pflseg_site.json", "site-1")


def test_the_site_refuses_before_it_is_made_and_before_every_task(tmp_path, monkeypatch):
    """client.answer: a deployed two-site job never reaches the site's data; a policy tightened mid-job holds for
    the next task."""
    from pflseg.flare.client import answer

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    settings_with(tmp_path, monkeypatch, data=str(tmp_path / "nowhere"))
    msg = FLModel(params={}, current_round=0, meta={"pflseg": job("fedsm"), "sites": THREE[:2]})
    out, site = answer("site-1", "train", msg, None, PROD)
    assert site is None and "policy.two_sites: false" in out.meta["pflseg_error"]
    assert "nowhere" not in out.meta["pflseg_error"]  # refused before its data was looked at

    class Made:  # a site made earlier in the job; the site's policy now forbids its method
        cfg, sites = job("fedavg"), THREE

        def tasks(self):
            return {"validate": lambda m: pytest.fail("the task ran despite the policy")}

    settings_with(tmp_path, monkeypatch, data=str(tmp_path / "nowhere"), methods=["fedbn"])
    out, _ = answer("site-1", "validate", msg, Made(), PROD)
    assert "refuses method 'fedavg'" in out.meta["pflseg_error"] and "policy.methods: fedbn" in out.meta["pflseg_error"]


def test_why_two_sites_are_refused_softpull_hands_each_site_the_others_model():
    """K = 2: P_other = (mix - lam P_own) / (1 - lam), exact up to float rounding (README: What leaves a site)."""
    import torch

    from pflseg.algorithms.softpull import softpull
    from pflseg.nets import build_net

    cfg = job("fedsm")
    torch.manual_seed(0)
    own = build_net(cfg["net"]).state_dict()
    torch.manual_seed(1)
    other = build_net(cfg["net"]).state_dict()
    lam = cfg["fedsm"]["lam"]
    mix = softpull([own, other], lam)[0]  # what site 1 receives
    for key, value in other.items():
        if value.is_floating_point():
            recovered = (mix[key].double() - lam * own[key].double()) / (1 - lam)
            assert torch.allclose(recovered, value.double(), atol=1e-6), key
