"""Faults of a provisioned loopback federation (its own, started once for the module; tests in file order):
the server SIGKILLed mid-round and resumed, then a site dead for good under the default task timeout. FLARE's
dead-client detection runs on shorter waits than a deployment's, set where a deployment sets them (the project
file's heart_beat_timeout, the job's FLARE settings): the same path, with about 135 s less waiting."""

import json
import time
from pathlib import Path

import pytest
import torch

from pflseg.config import load_job_config
from pflseg.deploy.submit import submit
from pflseg.flare.state import load_file, unprefixed
from tests.integration.federation import SITES, check_per_site, federation, flare_settings, job, on_round, say

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deploy_faults"), pytest.mark.in_file_order]
# one worker, in file order: the module's federation is shared, and each test leaves it as the next expects


#: seconds without a heartbeat before the server drops a site (loopback kits: 60; FLARE's default 600); a live site
#: sends one every ~5 s
HEART_BEAT_TIMEOUT = 30


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    yield from federation(tmp_path_factory, heart_beat_timeout=HEART_BEAT_TIMEOUT)


def test_server_killed_mid_round_then_resumed_gives_the_uninterrupted_models(fed, tmp_path):
    """FedAvg, 2 rounds, run once whole; run again as a fresh job of the same name (the first run's state is
    moved aside, not wiped) whose server is SIGKILLed (with its job process) in round 2, started again, and
    the job submitted again with resume: the same final model, tensor for tensor."""
    server = fed.server()
    state = fed.kit(server) / "pflseg_state"
    whole = submit(job(tmp_path, "fedavg"), fed.admin_kit(), out=tmp_path / "dl1", progress=say, poll=0.5)
    check_per_site(whole, SITES)

    def crash(_job_id):
        fed.kill(server)

    progress = on_round(1, crash)
    with pytest.raises(Exception) as died:  # the admin connection dies with the server (given up after 5 s)
        submit(job(tmp_path / "2", "fedavg"), fed.admin_kit(), out=tmp_path / "dl2", progress=progress, poll=0.5,
               timeout=300, reconnect=5)
    say(f"submit ended with the server: {died.value!r}"[:300])
    assert "done" in progress.seen, "never saw round 1 finish"
    name = whole["config"]["name"]  # the job's state folder
    aside = state / f"{name}.{whole['job_id']}"
    assert (aside / "final.pt").is_file()  # the uninterrupted run's state, moved aside by the fresh run
    assert not (state / name / "final.pt").exists()
    fed.start_participant(server)
    fed.wait_connected(timeout=180)
    resumed = submit(job(tmp_path / "3", "fedavg", resume=True), fed.admin_kit(), out=tmp_path / "dl3",
                     progress=say, poll=0.5)
    check_per_site(resumed, SITES)
    assert [h["round"] for h in resumed["history"]] == [1, 2] and not resumed["missing"]
    a, b = (unprefixed("global", load_file(aside / "final.pt")),
            unprefixed("global", load_file(state / name / "final.pt")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_site_dead_for_good_under_the_default_timeout_job_finishes_without_it(fed, tmp_path):
    """FedBN, 2 rounds, min_clients 2, the default task_timeout (3600 s): site-3 dies in round 2 and never
    comes back; FLARE's own dead-client detection ends its tasks long before the task timeout, and the job finishes
    with the other two. The detection's waits, each shortened here: the server drops the site after
    heart_beat_timeout (30 s here; the loopback kits' 60, FLARE's default 600), the job then deems it
    disconnected after dead_client_grace_period (5 s; FLARE's 60) and ends a task left waiting only on it once
    the task is dead_client_check_lead_time old (5 s; FLARE's 30: the final validate and test tasks wait it
    each)."""
    conf = json.loads((fed.kit(fed.server()) / "startup" / "fed_server.json").read_text())
    assert conf["servers"][0]["heart_beat_timeout"] == HEART_BEAT_TIMEOUT
    t = {}

    def die(_job_id):
        fed.kill("site-3")
        t["killed"] = time.time()

    progress = on_round(1, die)
    default = load_job_config("fedbn")["task_timeout"]
    folder = flare_settings(job(tmp_path, "fedbn", rounds=2, task_timeout=default), dead_client_grace_period=5,
                            dead_client_check_lead_time=5)
    res = submit(folder, fed.admin_kit(), out=tmp_path / "dl", progress=progress, poll=0.5, timeout=900)
    assert "killed" in t, "never saw round 1 finish"
    assert time.time() - t["killed"] < 400  # the dead-client path, not the 3600 s task timeout, ended round 2
    assert res["config"]["task_timeout"] == default == 3600
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert "site-3" in res["missing"] and sorted(res["test"]) == ["site-1", "site-2"]
    # FLARE's label for a job one of whose site job processes was killed depends on when it notices (seen:
    # COMPLETED, ABNORMAL, and once in a fresh-clone run EXECUTION_EXCEPTION); pflseg's results are complete
    check_per_site(res, ["site-1", "site-2"],
                   status=("FINISHED:COMPLETED", "FINISHED:ABNORMAL", "FINISHED:EXECUTION_EXCEPTION"))
    log = next(Path(res["download"]).rglob("log.txt")).read_text()  # the server's job log, downloaded
    assert "site site-3 left out of this round" in log
