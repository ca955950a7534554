"""`pflseg deploy stop` signals only the processes the federation started (pflseg.deploy.local)."""

import json
import subprocess
import sys
import time

from pflseg.deploy.local import LocalFederation


def test_a_recorded_pid_now_used_by_another_process_is_left_alone(tmp_path):
    """Before: `pflseg deploy stop` SIGKILLed whatever process had a pid federation.json recorded (after a reboot or
    a crash the pid may belong to anything)."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    said = []
    try:
        ws = tmp_path / "federation"
        ws.mkdir()
        participant = {"pid": other.pid, "create_time": 1.0, "cmdline": ["bash", "startup/sub_start.sh", "--once"]}
        for record in ({"pids": {"site-1": other.pid}},  # an older pflseg's record: pids only
                       {"pids": {"site-1": other.pid}, "started": {"site-1": participant}}):
            (ws / "federation.json").write_text(json.dumps(record))
            fed = LocalFederation(ws, progress=said.append)
            assert fed.processes() == [] and fed.stop(timeout=1) == []
            fed.pids = record["pids"]
            fed.kill("site-1")
            assert other.poll() is None  # still running
        assert any(f"pid {other.pid} of site-1 (federation.json) now belongs to another process" in m for m in said)
    finally:
        other.kill()
        other.wait()


def test_what_the_federation_started_is_recognised_from_its_record(tmp_path):
    ws = tmp_path / "federation"
    fed = LocalFederation(ws, progress=lambda m: None)
    startup = fed.kit("site-1") / "startup"
    startup.mkdir(parents=True)
    (startup / "sub_start.sh").write_text("exec sleep 60\n")
    pid = fed.start_participant("site-1")
    try:
        again = LocalFederation(ws, progress=lambda m: None)  # `pflseg deploy stop` in another process
        assert [p.pid for p in again.processes()] == [pid]
        again.kill("site-1")
        fed._popen[0].wait(timeout=10)
        assert fed._popen[0].returncode == -9
    finally:
        if fed._popen[0].poll() is None:
            fed._popen[0].kill()


class _Federation:
    """LocalFederation without processes: records what deploy_local asks of it."""

    made: list = []

    def __init__(self, workspace, project_yml, progress=print, allow_list=None):
        import yaml

        self.workspace, self.project = workspace, yaml.safe_load(open(project_yml))
        self.allow_list = allow_list
        _Federation.made.append(self)

    def sites(self):
        return [p["name"] for p in self.project["participants"] if p["type"] == "client"]

    def provision(self, site_config):
        self.site_config = site_config

    def start(self):
        pass

    def wait_connected(self, timeout):
        return self.sites()

    def rss_bytes(self):
        return 0

    def admin_kit(self):
        return self.workspace / "admin"


def test_deploy_local_makes_a_federation_whose_sites_take_two_site_jobs(tmp_path, monkeypatch):
    """Before: `pflseg deploy local --sites 2` ignored --sites without --data, and every site refused every training
    job of two sites (policy.two_sites false), said only in the server's log."""
    from pflseg.deploy.local import deploy_local

    monkeypatch.setattr("pflseg.deploy.local.LocalFederation", _Federation)
    said = []
    deploy_local(tmp_path / "fed", sites=2, say=said.append)
    fed = _Federation.made[-1]
    assert fed.sites() == ["site-1", "site-2"] and fed.site_config["policy"] == {"two_sites": True}
    assert fed.allow_list is None  # the project's builder's: narrow (`--allow-list broad` passes "broad")
    assert any("every site allows jobs of two sites (policy.two_sites: true)" in line for line in said)
    assert any("pflseg jobs export fedavg --out runs/jobs --set data.allow_synthetic=true --set min_clients=2" in line
               for line in said)


def test_a_killed_participant_started_again_is_stopped_by_shutdown_not_released(tmp_path):
    """Before: a site killed and started again stayed in ``killed``, so ``stop`` removed the running site from the
    server before ``shutdown_system`` (which then never told it to stop): it was SIGKILLed after ``stop``'s timeout."""
    fed = LocalFederation(tmp_path / "federation", progress=lambda m: None)
    startup = fed.kit("site-1") / "startup"
    startup.mkdir(parents=True)
    (startup / "sub_start.sh").write_text("exec sleep 60\n")
    try:
        fed.start_participant("site-1")
        fed.kill("site-1")
        assert fed.killed == {"site-1"}
        fed.start_participant("site-1")
        assert fed.killed == set()
    finally:
        for proc in fed._popen:
            proc.kill()
            proc.wait(timeout=10)


def test_a_job_the_server_will_not_abort_is_not_waited_for(tmp_path):
    """A server killed mid-job and started again lists that job as RUNNING for good and answers abort_job with "not
    running". Before: that error ended stop()'s API shutdown, and every process was SIGKILLed after the timeout."""

    class Session:
        aborted: list = []

        def list_jobs(self):
            return [{"job_id": "stale", "status": "RUNNING"}, {"job_id": "live", "status": "RUNNING"},
                    {"job_id": "done", "status": "FINISHED:COMPLETED"}][:1 if self.aborted == ["live"] else 3]

        def abort_job(self, job_id):
            if job_id == "stale":
                raise RuntimeError("server internal error: Job stale is not running.")
            self.aborted.append(job_id)

    said = []
    fed = LocalFederation(tmp_path / "federation", progress=said.append)
    t0 = time.time()
    fed._abort_jobs(Session(), timeout=30)
    assert time.time() - t0 < 10 and Session.aborted == ["live"]  # "live" ended once aborted; "stale" not waited for
    assert "job stale not aborted (server internal error: Job stale is not running.); not waited for" in said
