"""The admin's per-site table (pflseg.deploy.submit.metrics_table): what one site sent cannot break it."""

import pytest

from pflseg.deploy.submit import metrics_table


def test_a_sites_malformed_metrics_are_named_and_the_rest_is_shown():
    """Before: one site's non-numeric Dice (or a test entry that is no dict) raised in the admin's table."""
    res = {"job": "fedbn", "method": "fedbn", "rounds": 3, "sites": ["site-1", "site-2", "site-3"], "job_id": "abc",
           "history": [{"val_dice": {"site-1": 0.5, "site-2": "0.7; rm -rf /", "site-3": 0.25}}], "missing": {},
           "test": {"site-1": {"global": {"dice": 0.4}, "site": {"dice": 0.61}, "data_source": "site data"},
                    "site-2": {"global": {"dice": 7.0}, "site": "oops", "data_source": "synthetic"},
                    "site-3": ["not", "a", "dict"]}}
    table = metrics_table(res)
    assert "| site-1 | site data | 0.4000 | 0.6100 | 0.5000 |" in table
    assert "| site-2 | synthetic | ? | ? | ? |" in table and "| site-3 | - | - | - | 0.2500 |" in table
    assert "malformed: site site-2: test.global.dice is 7.0, not a Dice in [0, 1]" in table
    assert "malformed: site site-2: test.site is 'oops', not a dict" in table
    assert "malformed: site site-2: history[-1].val_dice is '0.7; rm -rf /', not a Dice in [0, 1]" in table
    assert "malformed: site site-3: test is ['not', 'a', 'dict'], not a dict of its models' metrics" in table


def test_a_table_without_sites_or_history_still_renders():
    table = metrics_table({"job": "x", "method": "fedavg", "rounds": 1, "test": {"site-1": {"site": {"dice": 0.5}}}})
    assert "| site-1 | - | - | 0.5000 | - |" in table and "malformed: results: 'sites' is None" in table


class _Session:
    """A FLARE API session whose job ends as ``meta`` says (or whose wait ``raises``)."""

    def __init__(self, download, meta=None, raises=None):
        self.download, self.meta, self.raises = download, meta, raises

    def submit_job(self, path):
        return "job-1"

    def monitor_job_and_return_job_meta(self, job_id, timeout, poll_interval, cb):
        if self.raises:
            raise self.raises
        return None, self.meta

    def get_job_logs(self, job_id, target):
        return {"logs": {}}

    def download_job_result(self, job_id, destination=None):
        return str(self.download)

    def close(self):
        pass


def _submit_setup(tmp_path, monkeypatch, session):
    job, kit = tmp_path / "jobs" / "fedavg", tmp_path / "admin@pflseg.org"
    job.mkdir(parents=True)
    (job / "meta.json").write_text("{}")
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_admin.json").write_text("{}")
    monkeypatch.setattr("nvflare.fuel.flare_api.flare_api.new_secure_session", lambda *a, **k: session)
    return job, kit


def test_a_refused_job_names_the_servers_reason_and_its_fix(tmp_path, monkeypatch, capsys):
    from pflseg.cli import main

    download = tmp_path / "transfer" / "job-1"
    (download / "workspace").mkdir(parents=True)
    (download / "workspace" / "log.txt").write_text(
        "2026 - ServerRunner - ERROR - [identity=pflseg] - Aborting current RUN due to FATAL_SYSTEM_ERROR received: "
        "task 'train': only 0 of 2 site(s) answered usably, min_clients=2. Problems: site-1: the site's policy "
        "refuses a fedavg job of exactly two sites; run the job with three or more sites, or allow it at the site "
        "(`pflseg site init --allow-two-sites`)\n")
    job, kit = _submit_setup(tmp_path, monkeypatch, _Session(download, {"status": "FINISHED:EXECUTION_EXCEPTION"}))
    assert main(["submit", str(job), "--kit", str(kit)]) == 2
    err = capsys.readouterr().err
    assert "job job-1 ended FINISHED:EXECUTION_EXCEPTION without results: the server stopped it: task 'train'" in err
    assert "`pflseg site init --allow-two-sites`" in err and f"Server log: {download / 'workspace/log.txt'}" in err


def test_ctrl_c_says_the_job_goes_on_at_the_server_and_how_to_follow_or_abort_it(tmp_path, monkeypatch, capsys):
    from pflseg.cli import main

    job, kit = _submit_setup(tmp_path, monkeypatch, _Session(tmp_path, raises=KeyboardInterrupt()))
    assert main(["submit", str(job), "--kit", str(kit)]) == 130
    captured = capsys.readouterr()
    assert "Ctrl-C stops following it, not the job" in captured.out
    assert captured.err.strip() == (
        f"pflseg: stopped following job job-1 (SIGINT); the job goes on at the server. Follow or abort it in the admin "
        f"console {kit}/startup/fl_admin.sh: `list_jobs`, `download_job job-1`, `abort_job job-1`")


class _Flaky(_Session):
    """A server that does not answer the first ``lost`` polls (FLARE's NoConnection), then says the job is done."""

    def __init__(self, download, lost):
        super().__init__(download, {"status": "FINISHED:COMPLETED"})
        self.lost = lost

    def monitor_job_and_return_job_meta(self, job_id, timeout, poll_interval, cb):
        from nvflare.fuel.flare_api.api_spec import NoConnection

        if self.lost > 0:
            self.lost -= 1
            raise NoConnection("cannot connect to server: ERROR_SERVER_CONNECTION")
        return None, self.meta


def test_a_server_that_does_not_answer_for_a_while_is_followed_on(tmp_path, monkeypatch):
    """Before: one lost admin connection (FLARE's API retries ~1.5 s; a busy server answered later) ended `submit`
    while the job ran on; now it is tried again until ``reconnect`` s pass without an answer."""
    from nvflare.fuel.flare_api.api_spec import NoConnection

    from pflseg.deploy.submit import submit

    download = tmp_path / "transfer" / "job-1"
    download.mkdir(parents=True)
    (download / "results.json").write_text('{"job": "fedavg"}')
    said = []
    job, kit = _submit_setup(tmp_path, monkeypatch, _Flaky(download, lost=3))
    res = submit(job, kit, progress=said.append, poll=0.01, reconnect=30)
    assert res["job"] == "fedavg" and res["status"] == "FINISHED:COMPLETED"
    assert sum("no answer from the server" in m for m in said) == 1  # said once per outage
    monkeypatch.setattr("nvflare.fuel.flare_api.flare_api.new_secure_session",
                        lambda *a, **k: _Flaky(download, lost=10**9))
    with pytest.raises(NoConnection):  # gone for good: given up after reconnect seconds
        submit(job, kit, progress=said.append, poll=0.01, reconnect=0.2)
