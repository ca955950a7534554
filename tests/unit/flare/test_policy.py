"""The site's own policy (pflseg.flare.policy): the site decides what it runs and what leaves it, not the job.

Every refusal names the site, the key, the settings file and the fix; the defaults allow what the job asks, so
the simulator runs as before; K = 2, pooling and the synthetic fall-back are refused in a deployment by default.
"""

import json

import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import check_effective, load_job_config
from pflseg.flare import policy as site_policy
from pflseg.flare.methods import METHODS, method
from pflseg.flare.policy import POLICY, SIMULATOR_JOB_ID, PolicyError, check_policy, deployed
from pflseg.flare.settings import site_settings

THREE = ["site-1", "site-2", "site-3"]
PROD = "0d3c2f6e-job"  # a POC / provisioned job id (FLARE's simulator runs every job as ``simulate_job``)


def job(name="fedavg", **over):
    return check_effective(load_job_config(name, overrides=over))


def check_task(site, task, cfg, sites, settings, job_id):
    """``pflseg.flare.policy.check_task`` given the job's registry entry, as ``pflseg.flare.client.answer`` calls it."""
    site_policy.check_task(site, task, cfg, sites, settings, job_id, method(cfg))


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
        check_policy(policy, "/opt/site-1/local/pflseg_site.json", "site-1", METHODS)


def test_the_method_names_are_checked_by_the_callers_that_have_the_registry(tmp_path, monkeypatch):
    """policy.py sits below the registry: the names are checked where the registry is given (the site's entry point,
    ``pflseg site init`` and ``site check``); a job of a method the policy does not list is refused all the same."""
    from pflseg.deploy.site_setup import site_check, site_init
    from pflseg.flare.client import answer

    assert check_policy({"methods": ["fedfoo"]}, "a file", "site-1")["methods"] == ["fedfoo"]  # no registry given
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    settings = settings_with(tmp_path, monkeypatch, data=str(tmp_path / "nowhere"), methods=["fedavg", "fedfoo"])
    msg = FLModel(params={}, current_round=0, meta={"pflseg": job("fedavg"), "sites": THREE})
    out, site = answer("site-1", "train", msg, None, PROD)
    assert site is None and "unknown method(s) ['fedfoo']" in out.meta["pflseg_error"]
    with pytest.raises(PolicyError, match=r"refuses method 'fedbn'"):
        check_task("site-1", "train", job("fedbn"), THREE, settings, PROD)
    (tmp_path / "startup").mkdir()
    (tmp_path / "startup" / "fed_client.json").write_text("{}")  # a site's kit
    with pytest.raises(PolicyError, match=r"policy\.methods in .*pflseg_site\.json names unknown method\(s\) "
                                          r"\['fedfoo'\]"):
        site_check(tmp_path, "site-1", say=lambda line: None)
    with pytest.raises(PolicyError, match=r"unknown method\(s\) \['fedbar'\]"):
        site_init(tmp_path, tmp_path / "nowhere", "site-1", policy={"methods": ["fedbar"]}, say=lambda line: None)


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


# ---- issue 39 (F8-F10, F12): what a deployed site's policy bounds, by default and by its own keys -------------------


def dp_job(clip=1.0, sigma=1.0, **over):
    return job("fedavg", privacy={"update": {"dp": {"clip": clip, "noise_multiplier": sigma}}}, **over)


def test_a_site_that_requires_dp_refuses_a_training_job_without_it_or_with_too_little_noise(tmp_path, monkeypatch):
    settings = settings_with(tmp_path, monkeypatch, require_dp=True, min_noise_multiplier=0.8)
    with pytest.raises(PolicyError, match=r"site site-1: the site's policy refuses model updates without DP .*"
                                          r"policy\.require_dp: true.*noise_multiplier >= 0\.8"):
        check_task("site-1", "train", job(), THREE, settings, PROD)
    with pytest.raises(PolicyError, match=r"refuses DP noise_multiplier 0\.5 .*policy\.min_noise_multiplier: 0\.8"):
        check_task("site-1", "train", dp_job(sigma=0.5), THREE, settings, PROD)
    check_task("site-1", "train", dp_job(sigma=0.8), THREE, settings, PROD)
    check_task("site-1", "train", job("local"), THREE, settings, PROD)  # nothing of its model leaves the site
    check_task("site-1", "train", job(), THREE, settings_with(tmp_path, monkeypatch), PROD)  # default: not required


@pytest.mark.parametrize("over, key, fix", [
    ({"privacy": {"per_case": True}}, "per_case", r"privacy\.per_case: false"),
    ({"train": {"batch_size": 2}}, "min_batch_size", r"train\.batch_size >= 4"),
    ({"data": {"size": 1024}}, "max_image_size", r"data\.size <= 512"),
    ({"rounds": 10_000, "train": {"epochs": 1000}}, "max_rounds_x_epochs", r"rounds x train\.epochs <= 10000"),
])
def test_a_deployed_site_bounds_what_a_job_can_extract_by_default_the_simulator_as_before(over, key, fix, tmp_path,
                                                                                          monkeypatch):
    """F8, F9: before, per-case Dice, batch 1, 1024 px and 10000 rounds x 1000 epochs were all answered."""
    settings = settings_with(tmp_path, monkeypatch)
    cfg = job("fedavg", **over)
    with pytest.raises(PolicyError, match=rf"site site-1: the site's policy refuses .*policy\.{key}: null \(.* in a "
                                          rf"deployment\), from .*pflseg_site\.json\); .*{fix}"):
        check_task("site-1", "train", cfg, THREE, settings, PROD)
    check_task("site-1", "train", cfg, THREE, settings, SIMULATOR_JOB_ID)


@pytest.mark.parametrize("policy, over", [
    ({"per_case": True}, {"privacy": {"per_case": True}}),
    ({"min_batch_size": 2}, {"train": {"batch_size": 2}}),
    ({"max_image_size": 1024, "max_memory_gib": 1000}, {"data": {"size": 1024}}),
])
def test_a_sites_own_value_holds_over_the_deployment_default(policy, over, tmp_path, monkeypatch):
    check_task("site-1", "train", job("fedavg", **over), THREE, settings_with(tmp_path, monkeypatch, **policy), PROD)
    key = next(iter(policy))
    tighter = {key: {"per_case": False, "min_batch_size": 4, "max_image_size": 512}[key]}
    with pytest.raises(PolicyError, match=rf"policy\.{key}: "):  # and a tighter own value holds in the simulator too
        check_task("site-1", "train", job("fedavg", **over), THREE, settings_with(tmp_path, monkeypatch, **tighter),
                   SIMULATOR_JOB_ID)


def tracked(uri=None, receivers=("tensorboard", "mlflow"), wandb_mode="offline"):
    cfg = job()
    cfg["tracking"] = {**cfg["tracking"], "receivers": list(receivers), "mlflow_uri": uri, "wandb_mode": wandb_mode}
    return cfg


@pytest.mark.parametrize("cfg, remote", [
    (tracked(None), None),
    (tracked("file:///srv/mlruns"), None),
    (tracked("/srv/mlruns"), None),
    (tracked("sqlite:///srv/mlflow.db"), None),
    (tracked("http://localhost:5000"), None),
    (tracked("http://127.0.0.1:5000"), None),
    (tracked("https://mlflow.example.org"), "MLflow at mlflow.example.org"),
    (tracked("http://10.0.0.7:5000"), "MLflow at 10.0.0.7"),
    (tracked("databricks"), "MLflow at databricks"),
    (tracked("https://mlflow.example.org", receivers=["tensorboard"]), None),  # no MLflow receiver: never used
    (tracked(None, receivers=["wandb"], wandb_mode="online"), "Weights & Biases online"),
    (tracked(None, receivers=["wandb"]), None),
])
def test_remote_tracking_target(cfg, remote):
    from pflseg.flare.policy import remote_tracking_target

    got = remote_tracking_target(cfg["tracking"])
    assert (got is None) if remote is None else got.startswith(remote), got


def test_a_deployed_site_refuses_metrics_to_a_remote_tracker_unless_it_allows_it(tmp_path, monkeypatch):
    """F10: before, any submitter's tracking.mlflow_uri sent every site's per-round metrics to any host."""
    cfg = tracked("https://mlflow.example.org")
    with pytest.raises(PolicyError, match=r"refuses sending the site's metrics to MLflow at mlflow\.example\.org .*"
                                          r"policy\.remote_tracking: null \(false in a deployment\).*--allow-remote"):
        check_task("site-1", "train", cfg, THREE, settings_with(tmp_path, monkeypatch), PROD)
    check_task("site-1", "train", cfg, THREE, settings_with(tmp_path, monkeypatch), SIMULATOR_JOB_ID)
    check_task("site-1", "train", cfg, THREE, settings_with(tmp_path, monkeypatch, remote_tracking=True), PROD)


def test_a_deployed_site_answers_two_scoring_tasks_per_job(tmp_path, monkeypatch):
    """F8: before, a server could send test after test (a new model each time) and read per-patient Dice."""
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    settings = settings_with(tmp_path, monkeypatch)
    cfg = job()
    for task in ("train", "validate", "train", "test"):
        check_task("site-1", task, cfg, THREE, settings, PROD)  # training tasks are not counted
    with pytest.raises(PolicyError, match=r"refuses scoring task 3 of FLARE job 0d3c2f6e-job .*"
                                          r"policy\.max_evaluations_per_job: null \(2 in a deployment\)"):
        check_task("site-1", "test", cfg, THREE, settings, PROD)
    check_task("site-1", "test", cfg, THREE, settings, "another-job")  # counted per FLARE job
    for _ in range(5):
        check_task("site-1", "test", cfg, THREE, settings, SIMULATOR_JOB_ID)  # the simulator: no bound
    counts = tmp_path / "state" / "site-1" / "evaluations"
    assert (counts / PROD).read_text() == "2\n" and (counts.stat().st_mode & 0o777) == 0o700
    assert not (counts / SIMULATOR_JOB_ID).exists()


def test_a_deployed_site_bounds_the_job_by_its_memory(tmp_path, monkeypatch):
    """F9: data.size 1024 x batch 4 was accepted (about 11 GiB of feature maps) whatever the site had."""
    settings = settings_with(tmp_path, monkeypatch, max_memory_gib=8, max_image_size=1024)
    big = job(data={"size": 1024}, train={"batch_size": 4, "eval_batch_size": 4})
    with pytest.raises(PolicyError, match=r"data\.size=1024 x train\.batch_size=4: 1[0-9]\.\d GiB.*over its memory "
                                          r"\(8\.0 GiB\).*policy\.max_memory_gib: 8, from"):
        check_task("site-1", "train", big, THREE, settings, PROD)
    check_task("site-1", "train", job(data={"size": 256}, train={"batch_size": 4}), THREE, settings, PROD)


def test_check_memory_counts_the_slice_cache_and_tells_gpu_from_host():
    from pflseg.config import ConfigError, activation_bytes, cache_bytes, check_memory

    cfg = job(data={"size": 512})
    assert cache_bytes(cfg, 1000) == 1000 * 3 * 512 * 512 * 4  # image, intensity copy, label
    maps = max(activation_bytes(cfg, cfg["train"]["batch_size"]), activation_bytes(cfg, 32, training=False))
    check_memory(cfg, "job", 1000, host_bytes=maps + cache_bytes(cfg, 1000) + 1)
    with pytest.raises(ConfigError, match=r"job: needs about .* GiB at the site \(feature maps .*; the slice cache of "
                                          r"100000 slices at data\.size=512: 293\.0 GiB\), over its memory"):
        check_memory(cfg, "job", 100_000, host_bytes=64 * 2**30)
    check_memory(cfg, "job", 0, host_bytes=1, gpu_bytes=maps + 1)  # the feature maps live on the GPU
    with pytest.raises(ConfigError, match=r"over the site's GPU memory"):
        check_memory(cfg, "job", 0, host_bytes=2**40, gpu_bytes=maps - 1)


@pytest.mark.parametrize("policy, match", [
    ({"min_batch_size": 0}, r"policy\.min_batch_size in .* must be null or an integer >= 1, got 0"),
    ({"min_noise_multiplier": -1}, r"policy\.min_noise_multiplier .* must be a number >= 0, got -1"),
    ({"max_memory_gib": "lots"}, r"policy\.max_memory_gib .* must be null or a number >= 0"),
    ({"require_dp": 1}, r"policy\.require_dp .* must be true or false, got 1"),
])
def test_a_malformed_bound_is_an_error_naming_the_key(policy, match):
    with pytest.raises(PolicyError, match=match):
        check_policy(policy, "/opt/site-1/local/pflseg_site.json", "site-1")


# ---- F12: a bundle only from the submitter's own jobs (or the same study) -----------------------------------------


def meta(submitter, study=None):
    return {"submitter_name": submitter, "submitter_org": "hospital_1", **({"study": study} if study else {})}


@pytest.mark.parametrize("trained, now, allowed", [
    (meta("lead@a.org"), meta("lead@a.org"), True),
    (meta("lead@b.org"), meta("lead@a.org"), False),
    (meta("lead@b.org", "prostate"), meta("lead@a.org", "prostate"), True),
    (meta("lead@b.org", "prostate"), meta("lead@a.org", "fundus"), False),
    (meta("lead@b.org", "default"), meta("lead@a.org", "default"), False),  # FLARE's default study joins no one
])
def test_a_bundle_only_from_the_submitters_own_jobs_or_the_same_study(trained, now, allowed, tmp_path):
    from pflseg.flare.policy import ORIGIN, check_bundle_origin, record_origin

    folder = tmp_path / "fedavg"
    folder.mkdir()
    assert record_origin(folder, "train-job", trained)
    assert json.loads((folder / ORIGIN).read_text())["submitter"] == trained["submitter_name"]
    assert (folder / ORIGIN).stat().st_mode & 0o777 == 0o600
    if allowed:
        check_bundle_origin("site site-1", folder, PROD, "cross_site.bundle", now)
    else:
        with pytest.raises(PolicyError, match=r"site site-1: refusing cross_site\.bundle: the trained job fedavg was "
                                              r"submitted by lead@b\.org .*this job by lead@a\.org"):
            check_bundle_origin("site site-1", folder, PROD, "cross_site.bundle", now)
    check_bundle_origin("site site-1", folder, SIMULATOR_JOB_ID, "cross_site.bundle")  # the simulator: as before


def test_a_bundle_without_a_recorded_submitter_is_refused_in_a_deployment(tmp_path):
    from pflseg.flare.policy import check_bundle_origin

    with pytest.raises(PolicyError, match=r"refusing iopfl\.bundle: .* records no submitter"):
        check_bundle_origin("the server", tmp_path, PROD, "iopfl.bundle", meta("lead@a.org"))


def test_a_deployed_site_records_who_trained_and_refuses_another_submitters_cross_site(tmp_path, monkeypatch):
    """F12: lead A's cross_site job read lead B's trained models at the site. The site's state folder of a training
    job records the submitter (FLARE's meta.json in the job's run folder) once the job has claimed it."""
    from pflseg.flare.policy import ORIGIN
    from pflseg.flare.state import claim, release

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    settings = settings_with(tmp_path, monkeypatch)

    def run_folder(job_id, who):
        (tmp_path / job_id).mkdir()
        (tmp_path / job_id / "meta.json").write_text(json.dumps(meta(who)))

    run_folder("train-b", "lead@b.org")
    folder = tmp_path / "state" / "site-1" / "fedavg"
    check_task("site-1", "train", job(), THREE, settings, "train-b")  # first task: the folder is not claimed yet
    assert not (folder / ORIGIN).exists()
    claim(folder, "train-b", False)
    check_task("site-1", "train", job(), THREE, settings, "train-b")
    release(folder)
    assert json.loads((folder / ORIGIN).read_text())["submitter"] == "lead@b.org"
    cross = job("cross_site", cross_site={"bundle": "/srv/state/server/fedavg"})
    run_folder("eval-a", "lead@a.org")
    with pytest.raises(PolicyError, match=r"site site-1: refusing cross_site\.bundle: the trained job fedavg was "
                                          r"submitted by lead@b\.org"):
        check_task("site-1", "own_model", cross, THREE, settings, "eval-a")
    run_folder("eval-b", "lead@b.org")
    check_task("site-1", "own_model", cross, THREE, settings, "eval-b")


def test_loopback_lines_at_the_site_entry_point(tmp_path, monkeypatch):
    """Issue 39's loopback lines, at the site's entry point (``client.answer``, what FLARE's executor calls) with a
    deployed job id: a site whose policy requires DP refuses a job without it; a job pointing tracking at a remote
    URI is refused by a deployed site's default; a refused job leaves only 0700 folders (before: ``pflseg_state``
    0755, made by the error-log writer)."""
    import os

    from pflseg.flare.client import answer

    monkeypatch.delenv("PFLSEG_STATE_DIR", raising=False)
    umask = os.umask(0o022)  # the usual one: folders made without a mode would be 0755
    try:
        _loopback_lines(tmp_path, monkeypatch, answer)
    finally:
        os.umask(umask)


def _loopback_lines(tmp_path, monkeypatch, answer):
    kit = tmp_path / "site-1"
    kit.mkdir()
    settings_with(kit, monkeypatch, data=str(tmp_path / "nowhere"), require_dp=True)
    out, site = answer("site-1", "train", FLModel(params={}, current_round=0, meta={"pflseg": job(), "sites": THREE}),
                       None, PROD)
    assert site is None and "policy.require_dp: true" in out.meta["pflseg_error"]
    settings_with(kit, monkeypatch, data=str(tmp_path / "nowhere"))
    remote = tracked("https://mlflow.example.org")
    out, _ = answer("site-1", "train", FLModel(params={}, current_round=0, meta={"pflseg": remote, "sites": THREE}),
                    None, PROD)
    assert "policy.remote_tracking: null (false in a deployment)" in out.meta["pflseg_error"]
    made = [p for p in kit.rglob("*") if p.is_dir() and p != kit / "local"]
    assert made and (kit / "pflseg_state") in made  # the site-local error log's folder
    assert {str(p.relative_to(kit)): oct(p.stat().st_mode & 0o777) for p in made} == {
        str(p.relative_to(kit)): "0o700" for p in made}
