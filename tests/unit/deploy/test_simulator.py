"""The simulator runner's guards, without a simulator: one run per workspace (the lock names its holder), the run
record (run.json) that decides whether an earlier run is read back / resumed or kept aside, and the stop message."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pflseg.cli import _run_overrides, build_parser, main
from pflseg.config import load_job_config
from pflseg.data import make_synthetic
from pflseg.deploy.simulator import Interrupted, run_side_by_side
from pflseg.deploy.workspace import (
    WorkspaceBusy,
    differences,
    judge,
    move_aside,
    read_record,
    run_record,
    workspace_lock,
)
from pflseg.flare.state import RoundStore


@pytest.fixture
def holder(tmp_path):
    """Another process holding the workspace lock of ``tmp_path / "ws"``."""
    ws = tmp_path / "ws"
    code = textwrap.dedent(f"""
        import sys, time
        from pflseg.deploy.workspace import workspace_lock
        with workspace_lock({str(ws)!r}):
            print("held", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, "run", "fedavg"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield ws, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_in_a_workspace_fails_at_once_naming_the_holder_and_the_workspace(holder, capsys):
    ws, pid = holder
    with pytest.raises(WorkspaceBusy) as err:
        with workspace_lock(ws):
            pass
    msg = str(err.value)
    assert f"workspace {ws.resolve()} is in use by pid {pid}" in msg
    assert "`-c run fedavg`" in msg and "started 20" in msg and f"kill -INT {pid}" in msg
    (ws / "job").mkdir()  # the first run's exported job: a second `pflseg run` must not re-export over it
    (ws / "job" / "mine").write_text("x")
    assert main(["run", "fedavg", "--workspace", str(ws)]) == 2
    assert f"is in use by pid {pid}" in capsys.readouterr().err
    assert (ws / "job" / "mine").read_text() == "x" and not (ws / "simulator.log").exists()


def test_the_lock_is_reentrant_in_one_process_and_free_after(tmp_path):
    with workspace_lock(tmp_path / "ws"):
        with workspace_lock(tmp_path / "ws"):  # the command holds it, the runner takes it again
            holder = json.loads((tmp_path / "ws" / ".lock").read_text())
            assert holder["pid"] > 0 and holder["since"]
    with workspace_lock(tmp_path / "ws"):
        pass


def test_interrupted_names_the_round_and_the_shell_exit_code(tmp_path):
    stop = Interrupted(signal.SIGINT, tmp_path, 3)
    assert stop.code == 130 and Interrupted(signal.SIGTERM).code == 143
    assert stop.message() == f"stopped after round 3; continue with --resume (workspace {tmp_path})"
    assert Interrupted(signal.SIGTERM).message() == "stopped (SIGTERM)"


def test_the_record_holds_config_data_and_sites_and_names_what_differs(tmp_path):
    root = make_synthetic(tmp_path / "root", n_sites=3, cases=2, size=16, depth=2)
    cfg = load_job_config("fedavg", overrides={"resume": True})
    one = run_record(cfg, root, ["site-1", "site-2"])
    assert "resume" not in one["config"] and one["config"]["train"]["lr"] == 0.001
    assert sorted(one["data"]["datalists"]) == ["site-1", "site-2"] and "sites" not in one["data"]["dataset"]
    assert run_record(load_job_config("fedavg"), root, ["site-1", "site-2"])["sha256"] == one["sha256"]  # resume aside
    other = run_record(load_job_config("fedavg", overrides={"train": {"lr": 0.01}, "rounds": 30}), root,
                       ["site-1", "site-2"])
    assert differences(one, other) == ["rounds: 20 -> 30", "train.lr: 0.001 -> 0.01"]
    assert differences(one, other, more_rounds=True) == ["train.lr: 0.001 -> 0.01"]  # resume may extend a run
    (root / "site-2" / "datalist.json").write_text("{}")  # the site's data changed
    changed = run_record(cfg, root, ["site-1", "site-2"])
    assert [d.split(":")[0] for d in differences(one, changed)] == ["data.datalists.site-2"]
    other_sites = run_record(cfg, root, ["site-1", "site-3"])
    assert 'sites: ["site-1", "site-2"] -> ["site-1", "site-3"]' in differences(one, other_sites)


def test_side_by_side_runs_two_at_a_time_a_post_training_call_after_its_run():
    import time

    running, peak, order = [], [0], []

    def call(name, seconds):
        def go():
            running.append(name)
            peak[0] = max(peak[0], len(running))
            time.sleep(seconds)
            order.append(name)
            running.remove(name)
            return name.upper()
        return go

    out = run_side_by_side({"a": call("a", 0.3), "b": call("b", 0.05), "a_after": call("a_after", 0.0)},
                           after={"a_after": "a"})
    assert out == {"a": "A", "b": "B", "a_after": "A_AFTER"} and peak[0] == 2
    assert order.index("a_after") > order.index("a")


def test_a_stop_request_reaches_calls_in_worker_threads(monkeypatch):
    from pflseg.deploy import simulator

    monkeypatch.setattr(simulator, "_STOP", [signal.SIGTERM])  # as after a SIGTERM in the main thread
    with pytest.raises(Interrupted) as stopped:
        run_side_by_side({"a": lambda: "never started"})
    assert stopped.value.code == 143


def test_another_methods_section_does_not_change_a_run_but_its_own_does():
    fedavg, iopfl = load_job_config("fedavg"), load_job_config("iopfl")
    for cfg in (fedavg, iopfl):
        cfg["iopfl"]["lr"], cfg["grace"]["beta"] = 0.5, 7.0  # an iopfl key and another method's key change
    assert differences(run_record(load_job_config("fedavg")), run_record(fedavg)) == []
    assert differences(run_record(load_job_config("iopfl")), run_record(iopfl)) == ["iopfl.lr: 0.001 -> 0.5"]
    route = load_job_config("iopfl_route")
    assert run_record(route)["sha256"] != run_record({**route, "iopfl": {**route["iopfl"], "lr": 0.5}})["sha256"]


def test_judge_reads_back_resumes_or_keeps_aside(tmp_path):
    ws, job = tmp_path / "runs" / "fedavg", "fedavg"
    record = run_record(load_job_config(job), None, ["site-1", "site-2"])
    assert judge(ws, job, record) == ("none", [])
    ws.mkdir(parents=True)
    (ws / "run.json").write_text(json.dumps(record))
    RoundStore(ws / "state" / "server" / job).save(0, {"round": 0})
    assert judge(ws, job, record) == ("stopped", [])
    (ws / "state" / "server" / job / "results.json").write_text("{}")
    assert judge(ws, job, record) == ("finished", [])
    verdict, lines = judge(ws, job, run_record(load_job_config(job, overrides={"seed": 1}), None, ["site-1", "site-2"]))
    assert verdict == "differs" and lines == ["seed: 0 -> 1"]
    with workspace_lock(ws):
        moved = move_aside(ws)
    assert moved.name.startswith("fedavg.") and (moved / "state" / "server" / job / "results.json").is_file()
    assert sorted(p.name for p in ws.iterdir()) == [".lock"]  # nothing deleted, the lock stayed
    (ws / "state" / "server" / job).mkdir(parents=True)
    (ws / "state" / "server" / job / "results.json").write_text("{}")
    assert judge(ws, job, record)[0] == "differs"  # results without any record of their settings


def test_a_run_from_before_run_json_is_judged_by_its_exported_job(tmp_path):
    from pflseg.flare.jobs import export_job

    ws, job = tmp_path / "ws", "fedavg"
    export_job(job, ws / "job", overrides={"resume": True, "rounds": 2})
    (ws / "state" / "server" / job).mkdir(parents=True)
    (ws / "state" / "server" / job / "results.json").write_text("{}")
    assert read_record(ws, job)["legacy"]
    verdict, note = judge(ws, job, run_record(load_job_config(job, overrides={"rounds": 2}), None, ["site-1"]))
    assert verdict == "finished" and "data and sites were not recorded" in note[0]
    assert judge(ws, job, run_record(load_job_config(job), None, ["site-1"]))[1] == ["rounds: 2 -> 20"]


def test_resume_continues_only_the_same_run_and_keeps_another_aside(tmp_path, capsys):
    ws = tmp_path / "ws"
    ws.mkdir()
    earlier = run_record(load_job_config("fedavg", overrides={"min_clients": 2}), None, ["site-1", "site-2", "site-3"])
    (ws / "run.json").write_text(json.dumps(earlier))
    RoundStore(ws / "state" / "server" / "fedavg").save(0, {"round": 0})
    args = build_parser().parse_args(["run", "fedavg", "--workspace", str(ws), "--resume", "--rounds", "40"])
    assert _run_overrides(args, ws)["resume"] is True  # the same run, extended to 40 rounds
    args = build_parser().parse_args(["run", "fedavg", "--workspace", str(ws), "--resume", "--set", "train.lr=0.01"])
    over = _run_overrides(args, ws)
    out = capsys.readouterr().out
    assert "resume" not in over and "is not this run (train.lr: 0.001 -> 0.01)" in out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("ws.")]
    assert f"kept in {aside}" in out and RoundStore(aside / "state" / "server" / "fedavg").latest() == 0


def test_a_workspace_that_is_a_file_is_an_error_naming_it_not_a_traceback(tmp_path, capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("not a workspace")
    for ws in (afile, afile / "run"):
        assert main(["run", "fedavg", "--workspace", str(ws), "--rounds", "1"]) == 2
        err = capsys.readouterr().err
        assert f"{afile} is a file, not a folder" in err and "--workspace" in err and "Traceback" not in err
    assert afile.read_text() == "not a workspace"


def test_the_reason_the_server_stopped_a_run_is_read_from_its_log(tmp_path):
    from pflseg.deploy.simulator import panic_reason

    log = tmp_path / "log.txt"
    log.write_text("2026 - ServerRunner - ERROR - [identity=simulator_server, run=simulate_job]: Aborting current RUN "
                   "due to FATAL_SYSTEM_ERROR received: resume: the config no longer matches the checkpoint x.pt\n")
    assert panic_reason(log) == "resume: the config no longer matches the checkpoint x.pt"
    assert panic_reason(tmp_path / "none.txt") is None


def test_a_run_whose_best_global_model_is_the_untrained_one_says_so():
    from pflseg.deploy.simulator import result_warnings

    (line,) = result_warnings({"best_global_round": 0, "rounds": 1})
    assert "untrained initial model" in line and "rounds=1" in line and "--rounds" in line
    assert result_warnings({"best_global_round": 1, "rounds": 1}) == []  # the trained final model was best


def test_round_lines_carry_an_eta_and_silence_says_what_is_running(tmp_path):
    """Before: `pflseg run` printed nothing while FLARE started (20-40 s) and nothing between round lines."""
    import io

    from pflseg.deploy import simulator
    from pflseg.deploy.simulator import Heard, _relay

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock, said = Clock(), []
    seen = Heard("fedavg", rounds=3, n_sites=2, log_path=tmp_path / "simulator.log", clock=clock)
    clock.now = simulator.SILENCE_S
    assert seen.heartbeat().startswith("[fedavg] starting: FLARE's simulator and 2 site(s); each site reads (or makes)")
    assert seen.heartbeat() is None  # once per silence
    log = ("2026 - INFO - progress: synthetic prostate data in /x 30/60 cases (50 %), 10 s, ETA 10 s\n"
           "2026 - FedAvgController - INFO - [identity=sim] - round 1 done in 20.00 s (site compute max 4 s)\n"
           "2026 - FedAvgController - INFO - [identity=sim] - round 2 done in 2.00 s (site compute max 1 s)\n"
           "2026 - INFO - a line nobody needs\n")
    _relay(io.StringIO(log), io.StringIO(), "fedavg", said.append, seen)
    assert said == ["[fedavg] progress: synthetic prostate data in /x 30/60 cases (50 %), 10 s, ETA 10 s",
                    "[fedavg] round 1 done in 20.00 s (site compute max 4 s); ETA 40 s for rounds 2-3, then the "
                    "final test",
                    "[fedavg] round 2 done in 2.00 s (site compute max 1 s); ETA 2 s for round 3, then the "
                    "final test"]
    clock.now += simulator.SILENCE_S
    assert seen.heartbeat().startswith("[fedavg] round 3/3 running (15 s); ETA 0 s")
    post = Heard("iopfl_route", rounds=0, n_sites=1, log_path=tmp_path / "log", clock=clock)
    clock.now += simulator.SILENCE_S
    assert post.heartbeat().startswith("[iopfl_route] post-training job running at the sites (15 s so far)")


def test_a_site_worker_lost_while_starting_starts_the_job_again_not_an_hour_later(tmp_path, monkeypatch):
    """FLARE 2.9's simulator can lose a site's worker as it starts it (its port taken before the worker bound it: 2 of
    ~120 runs of a busy bench); its server then waits for that site until the task timeout, an hour. A stand-in
    `nvflare` logs that the first time and hangs; the second time it writes the run's results."""
    from pflseg.deploy.simulator import run_simulator
    from pflseg.flare.jobs import export_job

    job = export_job("fedavg_tiny", tmp_path / "job")
    bin_dir, ws = tmp_path / "bin", tmp_path / "ws"
    bin_dir.mkdir()
    fake = bin_dir / "nvflare"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, pathlib, sys, time
        starts = pathlib.Path({str(tmp_path / "starts")!r})
        starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
        if len(starts.read_text()) == 1:
            print("2026 - SimulatorClientRunner - ERROR - Communication error with client site-2: [Errno 104] "
                  "Connection reset by peer", flush=True)
            time.sleep(120)
        out = pathlib.Path(os.environ["PFLSEG_STATE_DIR"]) / "server" / {job.name!r}
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({{"rounds": 1}}))
    """))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    RoundStore(ws / "state" / "server" / job.name).save(3, {"round": 3})  # an earlier run's round (a resumed job)
    said, t0 = [], time.monotonic()
    results = run_simulator(job, ws, n_sites=2, progress=said.append)
    assert results["rounds"] == 1 and time.monotonic() - t0 < 60
    assert (tmp_path / "starts").read_text() == "xx"
    (again,) = [line for line in said if "lost a site's worker" in line]
    assert "Communication error with client site-2" in again and "starting the job again (2 of 3)" in again
    assert "Connection reset by peer" in (ws / "simulator.log").read_text()  # the lost start's log is kept


def test_a_site_worker_lost_every_time_is_an_error_naming_the_line(tmp_path, monkeypatch):
    from pflseg.deploy import simulator
    from pflseg.flare.jobs import export_job

    job = export_job("fedavg_tiny", tmp_path / "job")
    fake = tmp_path / "bin" / "nvflare"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport time\nprint('x - ERROR - run_client_thread error: RuntimeError: "
                    "Failed to create connection to the child process in SimulatorClientRunner', flush=True)\n"
                    "time.sleep(120)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(simulator, "STARTS", 2)
    with pytest.raises(RuntimeError) as err:
        simulator.run_simulator(job, tmp_path / "ws", n_sites=2, progress=lambda m: None)
    msg = str(err.value)
    assert "lost a site's worker process (run_client_thread error" in msg and "while starting it, 2 times" in msg
