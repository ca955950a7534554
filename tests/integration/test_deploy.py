"""A provisioned 3-site federation on loopback, started once for the module: jobs in package mode (FedAvg as a
recipe on FLARE's ProdEnv; FedBN submitted through the FLARE API), refusals (a lead's BYOC
job, a shell command at another organisation's site, a user without the right, a client from another project), a
straggler beyond the task timeout, a site restarted mid-job, and a shutdown that leaves no process behind. Tests
run in file order on the one federation. The server SIGKILLed mid-round and a site dead for good:
test_deploy_faults.py (its own federation)."""

import json
import signal
import threading
import time
from pathlib import Path

import pytest
from nvflare.recipe import ProdEnv

from pflseg.deploy.submit import SubmitError, submit
from pflseg.flare.recipes import FedAvgRecipe
from tests.integration.federation import SITES, TINY, check_per_site, federation, job, on_round, rounds_of, say

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("deploy"), pytest.mark.in_file_order]
# one worker, in file order: the module's federation is shared, and each test leaves it as the next expects


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    yield from federation(tmp_path_factory, intruder=True)


def test_a_recipe_on_prodenv_runs_in_package_mode_at_the_federation(fed, tmp_path):
    """Issue 26 item 9: a pflseg recipe executed on FLARE's ProdEnv (the admin's startup kit) runs at every site; in
    package mode (what ``pflseg jobs export`` writes, tests/unit/flare/test_recipes.py): the job carries no code, so
    no byoc right is needed. FedAvg, 2 rounds, the global model scored at every site. (One job for both checks: a
    job on this federation costs ~40 s of process start-up.)"""
    recipe = FedAvgRecipe(overrides=TINY, name="fedavg_recipe")
    recipe.export(str(tmp_path / "exported"))
    assert (tmp_path / "exported" / "fedavg_recipe" / "meta.json").is_file()
    assert not (tmp_path / "exported" / "fedavg_recipe" / "app" / "custom").exists()  # no code in the job
    run = recipe.execute(ProdEnv(startup_kit_location=str(fed.admin_kit()), username=fed.admin, login_timeout=30))
    download = run.get_result(timeout=300)
    res = json.loads(next(Path(download).rglob("results.json")).read_text())
    check_per_site({**res, "status": run.get_status()}, SITES)
    assert res["job"] == "fedavg_recipe" and [h["round"] for h in res["history"]] == [1, 2] and not res["missing"]
    assert all(0.0 <= res["test"][s]["global"]["dice"] <= 1.0 for s in SITES)


def test_a_leads_byoc_job_is_refused(fed, tmp_path):
    """Issue 23 item 1: under FLARE's default policy (before) the lead of hospital_1 ran the code its job carries at
    every hospital; pflseg's policy (PflsegBuilder) grants BYOC to no one: the job never reaches a site."""
    folder = job(tmp_path, "fedavg", mode="byoc", rounds=1)
    assert (folder / "app" / "custom" / "pflseg" / "flare" / "client.py").is_file()
    sess = fed.session("lead@hospital1.org")
    try:
        job_id = sess.submit_job(str(folder))  # submitting is the lead's right; running custom code is not
        deadline = time.time() + 120
        while (meta := sess.get_job_meta(job_id))["status"] in ("SUBMITTED", "DISPATCHED") and time.time() < deadline:
            time.sleep(1)
    finally:
        sess.close()
    assert meta["status"] == "FINISHED:FAILED_TO_RUN", meta
    assert "BYOC not permitted" in str(meta.get("job_deploy_detail")), meta
    assert not [s for s in SITES if (fed.kit(s) / job_id).exists()]  # no site received the job's code


def _shell(sess, target) -> str:
    try:
        return str(sess.ls_target(target))
    except Exception as exc:  # FLARE's API may raise on a refused command
        return f"{type(exc).__name__}: {exc}"


def test_shell_commands_only_at_the_users_own_organisation(fed):
    """Issue 23 item 1: FLARE's default gave project_admin shell commands (ls, cat, grep, ...) at every hospital
    and lead at its own; now a user runs them only at sites of its own organisation."""
    lead, admin = fed.session("lead@hospital1.org"), fed.session()
    try:
        own, other, by_admin = _shell(lead, "site-1"), _shell(lead, "site-2"), _shell(admin, "site-3")
    finally:
        lead.close()
        admin.close()
    assert "startup" in own, own  # hospital_1's lead at hospital_1's site
    for refused in (other, by_admin):
        assert "startup" not in refused and "not authorized" in refused.lower(), refused


def test_user_without_submit_right_is_refused(fed, tmp_path):
    with pytest.raises(SubmitError, match="refused for viewer@hospital2.org"):
        submit(job(tmp_path, "fedavg"), fed.admin_kit("viewer@hospital2.org"), progress=say)


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


def test_straggler_beyond_the_timeout_is_left_out_then_back(fed, tmp_path):
    """FedBN, 4 rounds, task_timeout 60 s (round 1 starts the job processes: a loaded machine needs ~35 s):
    site-3's job process is stopped (SIGSTOP) for 65 s after round 1, while its site process stays connected,
    then continued: left out of the rounds it missed, back after."""

    def stall(job_id):
        procs = [p for p in fed._tree([fed.pids["site-3"]]) if job_id in " ".join(p.cmdline())]
        assert procs, "site-3 runs no process of the job"
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        threading.Timer(65, lambda: [p.send_signal(signal.SIGCONT) for p in procs]).start()

    progress = on_round(1, stall)
    res = submit(job(tmp_path, "fedbn", rounds=4, task_timeout=60), fed.admin_kit(), out=tmp_path / "dl",
                 progress=progress, poll=0.5)
    assert "done" in progress.seen, "never saw round 1 finish"
    assert "timed out" in res["missing"]["site-3"]
    assert rounds_of(res, "site-1") == [1, 2, 3, 4]
    late = rounds_of(res, "site-3")
    # out of the round it was stopped in (round 1, or 2 where it had answered round 1 before the stop took effect:
    # the Executor site answers without a poll), re-admitted after
    assert late[0] == 1 and len(late) < 4 and late[-1] == 4, late
    check_per_site(res, SITES)  # and tested at the end with its own state


def test_site_restarted_mid_job_is_left_out_of_that_job_only(fed, tmp_path):
    """FedBN, 2 rounds: site-3 is killed and started again when round 1 is done. FLARE does not deploy a running job
    to a site that restarts, so site-3 stays out of the rest of this job: round 2 and the final validate and test
    tasks (each task it misses waits task_timeout, 60 s, for it; it may have answered round 2 before the kill
    landed: the Executor site answers without a poll); it connects again at once, ready for the next job."""

    def restart(_job_id):
        fed.kill("site-3")
        fed.start_participant("site-3")

    res = submit(job(tmp_path, "fedbn", rounds=2, task_timeout=60), fed.admin_kit(), out=tmp_path / "dl",
                 progress=on_round(1, restart), poll=0.5)
    assert rounds_of(res, "site-3") in ([1], [1, 2]) and rounds_of(res, "site-1") == [1, 2]
    check_per_site(res, ["site-1", "site-2"], status=("FINISHED:COMPLETED", "FINISHED:ABNORMAL"))  # not tested
    assert "site-3" in res["missing"]
    assert fed.wait_connected(timeout=120) == SITES  # back for the next job (the shutdown below needs it too)


def test_shutdown_leaves_no_process(fed):
    """Every process (site-3 restarted above included) ends on FLARE's shutdown: none is left to kill."""
    fed.intruder.kill("site-1")
    assert fed.stop(timeout=60) == []  # the processes it had to SIGKILL after the 60 s
    assert fed.processes() == [] and fed.intruder.processes() == []
