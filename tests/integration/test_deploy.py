"""A provisioned 3-site federation on loopback (separate processes, mutual TLS), started once for the
module: jobs submitted through the FLARE API in package mode (FedAvg, FedBN) and BYOC mode, refusals
(a user without the right, a client from another project), a site killed mid-round, and a shutdown
that leaves no process behind."""

import json
import time
from pathlib import Path

import pytest

from pflseg.data import make_synthetic
from pflseg.deploy.local import LocalFederation
from pflseg.deploy.provision import REPO_PROJECT, provision_loopback
from pflseg.deploy.submit import SubmitError, submit
from pflseg.flare.jobs import export_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deploy")]  # one worker: shared module fixture
SITES = ["site-1", "site-2", "site-3"]
TINY = {"rounds": 2, "min_clients": 2, "task_timeout": 300, "data": {"size": 32},
        "net": {"channels": [4, 8, 16], "strides": [2, 2]}, "train": {"batch_size": 8, "epochs": 1}}


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    ws = tmp_path_factory.mktemp("federation")
    data = make_synthetic(ws / "data", n_sites=3, cases=5, size=32, depth=6)
    federation = LocalFederation(ws / "fed", progress=lambda m: None)
    federation.provision({"data": str(data), "device": "cpu"})
    federation.start()
    # a client provisioned by another project (its own root CA) aims at the same server
    port = json.loads((federation.kit("site-1") / "startup" / "fed_client.json").read_text())["servers"][0]["service"]["target"]
    intruder = LocalFederation(ws / "intruder", progress=lambda m: None)
    provision_loopback(intruder.workspace, REPO_PROJECT, port=int(port.split(":")[1]))
    intruder.start_participant("site-1")  # same name as a real site, wrong certificates
    federation.intruder = intruder
    try:
        federation.wait_connected(timeout=180)
        yield federation
    finally:
        intruder.kill("site-1")
        federation.stop(timeout=30)


def job(tmp_path, name, mode="package", **over):
    cfg = {**TINY, **over}
    return export_job(name, tmp_path / "jobs", overrides=cfg, mode=mode, job_name=f"{name}_{mode}")


def check_per_site(res, sites, status=("FINISHED:COMPLETED",)):
    assert res["status"] in status and sorted(res["test"]) == sites
    for site in sites:
        assert 0.0 <= res["test"][site]["site"]["dice"] <= 1.0 and res["test"][site]["site"]["n_cases"] >= 1


def test_package_mode_fedavg(fed, tmp_path):
    folder = job(tmp_path, "fedavg")
    assert not (folder / "app" / "custom").exists()  # no code in the job: no byoc right needed
    res = submit(folder, fed.admin_kit(), out=tmp_path / "dl", progress=lambda m: None, poll=0.5)
    check_per_site(res, SITES)
    assert [h["round"] for h in res["history"]] == [0, 1] and not res["missing"]
    assert all(0.0 <= res["test"][s]["global"]["dice"] <= 1.0 for s in SITES)


def test_byoc_mode_runs_the_code_the_job_carries(fed, tmp_path):
    folder = job(tmp_path, "fedavg", mode="byoc", rounds=1)
    assert (folder / "app" / "custom" / "pflseg" / "flare" / "client.py").is_file()
    res = submit(folder, fed.admin_kit("lead@hospital1.org"), out=tmp_path / "dl", progress=lambda m: None, poll=0.5)
    check_per_site(res, SITES)
    site_log = (fed.kit("site-1") / res["job_id"] / "log.txt").read_text()
    assert f"pflseg from {fed.kit('site-1') / res['job_id'] / 'app_site-1' / 'custom' / 'pflseg'}" in site_log


def test_user_without_submit_right_is_refused(fed, tmp_path):
    with pytest.raises(SubmitError, match="refused for viewer@hospital2.org"):
        submit(job(tmp_path, "fedavg"), fed.admin_kit("viewer@hospital2.org"), progress=lambda m: None)


def test_client_of_another_project_cannot_join(fed):
    assert fed.intruder.running()  # it kept trying ...
    sess = fed.session()
    try:
        assert fed.connected(sess) == SITES  # ... and never joined
    finally:
        sess.close()
    log_file, deadline = fed.intruder.kit("site-1") / "log.txt", time.time() + 120
    while "CERTIFICATE_VERIFY_FAILED" not in (log := log_file.read_text()) and time.time() < deadline:
        time.sleep(2)  # a loaded machine: its first TLS attempt may come seconds after the others joined
    assert "CERTIFICATE_VERIFY_FAILED" in log, log[-2000:]


def test_site_killed_mid_round_personalized_job_finishes_without_it(fed, tmp_path):
    """FedBN (personalized norm layers at the sites), 3 rounds, min_clients 2: site-3 dies in round 2."""
    killed = []

    def progress(msg):
        if "round 1 done" in msg and not killed:
            fed.kill("site-3")
            killed.append(time.time())

    folder = job(tmp_path, "fedbn", rounds=3, task_timeout=20)
    res = submit(folder, fed.admin_kit(), out=tmp_path / "dl", progress=progress, poll=0.5)
    assert killed, "never saw round 1 finish"
    assert [h["round"] for h in res["history"]] == [0, 1, 2]
    assert "site-3" in res["missing"] and sorted(res["test"]) == ["site-1", "site-2"]
    # FLARE may call the job abnormal (a site's job process died); pflseg's results are complete
    check_per_site(res, ["site-1", "site-2"], status=("FINISHED:COMPLETED", "FINISHED:ABNORMAL"))
    log = next(Path(res["download"]).rglob("log.txt")).read_text()  # the server's job log, downloaded
    assert "site site-3 left out of this round" in log


def test_shutdown_leaves_no_process(fed):
    fed.intruder.kill("site-1")
    fed.stop(timeout=60)
    assert fed.processes() == [] and fed.intruder.processes() == []
