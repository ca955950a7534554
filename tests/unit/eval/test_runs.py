"""`pflseg run` into a workspace that holds an earlier run: it is never overwritten without a word (kept aside,
read back or resumed, always said), and what `pflseg data check` refuses is refused before anything starts.
No simulator runs here: ``run_simulator`` is replaced by a stub that fails the test when called."""

import json

import numpy as np
import pytest

from pflseg.cli import main
from pflseg.config import load_job_config
from pflseg.deploy.workspace import run_record
from pflseg.flare.state import RoundStore


def _results(rounds: int) -> dict:
    test = {s: {"data_source": "synthetic", "global": {"dice": 0.5, "n_cases": 2}} for s in ("site-1", "site-2")}
    history = [{"round": r, "wall_seconds": 1.0, "site_compute_seconds": {"site-1": 0.5, "site-2": 0.5},
                "val_dice": {"site-1": 0.4, "site-2": 0.4}} for r in range(rounds)]
    return {"job": "fedavg", "method": "fedavg", "rounds": rounds, "sites": ["site-1", "site-2"], "test": test,
            "history": history, "missing": {}, "best_global_round": rounds}


def _earlier(ws, rounds: int, finished: bool = True, done: int | None = None):
    """A run of fedavg on 2 synthetic sites in ``ws``, as ``pflseg run`` leaves it."""
    record = run_record(load_job_config("fedavg", overrides={"rounds": rounds, "min_clients": 2}), None,
                        ["site-1", "site-2"])
    ws.mkdir(parents=True)
    (ws / "run.json").write_text(json.dumps(record))
    server = ws / "state" / "server" / "fedavg"
    RoundStore(server).save((rounds if done is None else done) - 1, {"round": 0})
    if finished:
        (server / "results.json").write_text(json.dumps(_results(rounds)))


@pytest.fixture
def no_simulator(monkeypatch):
    calls = []

    def fake(job_dir, workspace, **kwargs):
        calls.append(job_dir)
        (workspace / "state" / "server" / "fedavg").mkdir(parents=True, exist_ok=True)
        return _results(1)

    monkeypatch.setattr("pflseg.eval.runs.run_simulator", fake)
    monkeypatch.setattr("pflseg.eval.runs.write_results", lambda results, ws: [])
    return calls


def _run(ws, *flags):
    return main(["run", "fedavg", "--workspace", str(ws), "--sites", "2", *flags])


def test_a_finished_run_is_kept_aside_and_said_not_overwritten(tmp_path, capsys, no_simulator):
    ws = tmp_path / "fa3"
    _earlier(ws, rounds=3)
    assert _run(ws, "--rounds", "1") == 0
    out = capsys.readouterr().out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("fa3.")]
    assert f"the earlier run in {ws} is not this run (rounds: 3 -> 1); it is kept in {aside}" in out
    assert json.loads((aside / "state/server/fedavg/results.json").read_text())["rounds"] == 3
    assert len(no_simulator) == 1


def test_the_same_finished_run_again_is_kept_aside_too(tmp_path, capsys, no_simulator):
    ws = tmp_path / "fa3"
    _earlier(ws, rounds=3)
    assert _run(ws, "--rounds", "3") == 0
    out = capsys.readouterr().out
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("fa3.")]
    assert (f"found a finished run of these settings (3 round(s)) in {ws}; it is kept in {aside}, and this run "
            "starts afresh (--resume would read it back)") in out


def test_resume_of_a_finished_run_says_already_complete_and_runs_nothing(tmp_path, capsys, no_simulator):
    ws = tmp_path / "fa3"
    _earlier(ws, rounds=3)
    assert _run(ws, "--rounds", "3", "--resume") == 0
    out = capsys.readouterr().out
    assert f"--resume: the run in {ws} is already complete (3 of 3 round(s))" in out
    assert "| site-1 | 0.5000 |" in out  # its tables, read back
    assert no_simulator == [] and not [p for p in tmp_path.iterdir() if p.name.startswith("fa3.")]


def test_resume_names_the_round_it_continues_at(tmp_path, capsys, no_simulator):
    ws = tmp_path / "fa3"
    _earlier(ws, rounds=3, finished=False, done=1)
    assert _run(ws, "--rounds", "3", "--resume") == 0
    assert f"--resume: resuming the run in {ws} at round 2 of 3" in capsys.readouterr().out
    assert len(no_simulator) == 1
    other = tmp_path / "fa4"
    _earlier(other, rounds=1)
    assert _run(other, "--rounds", "3", "--resume") == 0
    assert (f"--resume: resuming the run in {other} at round 2 of 3 (it finished 1 round(s); extended to 3)"
            in capsys.readouterr().out)


def test_a_stopped_run_without_resume_is_kept_aside_naming_its_rounds(tmp_path, capsys, no_simulator):
    ws = tmp_path / "fa3"
    _earlier(ws, rounds=3, finished=False, done=2)
    assert _run(ws, "--rounds", "3") == 0
    assert "found a stopped run of these settings (2 of 3 round(s) done)" in capsys.readouterr().out


def test_an_unknown_job_leaves_no_workspace_behind(tmp_path, capsys):
    assert main(["run", "nosuch", "--workspace", str(tmp_path / "nosuch")]) == 2
    assert "no job config" in capsys.readouterr().err and not (tmp_path / "nosuch").exists()


def test_run_refuses_what_data_check_refuses_before_anything_starts(tmp_path, capsys, no_simulator):
    from tests.unit.data.helpers import write_png

    raw = tmp_path / "raw"
    for site, n in (("big", 3), ("one", 1)):
        for k in range(n):
            write_png(raw / site / "images" / f"c{k}.png", np.arange(64).reshape(8, 8))
            mask = np.zeros((8, 8))
            mask[2:5, 2:5] = 1
            write_png(raw / site / "masks" / f"c{k}.png", mask)
    assert main(["data", "index", "--layout", "generic", "--root", str(raw), "--out", str(tmp_path / "data")]) == 0
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "data")]) == 1
    checked = {line for line in capsys.readouterr().out.splitlines() if line.startswith("[one]")}
    ws = tmp_path / "ws"
    assert main(["run", "fedavg", "--workspace", str(ws), "--data", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "2 problem(s) in the run's sites big, one; nothing was started" in err
    assert checked and all(line in err for line in checked)  # one wording: data check's
    assert no_simulator == [] and not ws.exists()
    assert main(["run", "fedavg", "--workspace", str(ws), "--data", str(tmp_path / "data"), "--site-names", "big",
                 "--rounds", "1"]) == 0  # the good site alone runs


def test_a_data_root_that_is_not_there_names_no_internal_function(tmp_path, capsys):
    assert main(["run", "fedavg", "--workspace", str(tmp_path / "ws"), "--data", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "data root not found" in err and "make_synthetic" not in err and not (tmp_path / "ws").exists()


def test_a_bad_override_leaves_no_workspace(tmp_path, capsys):
    assert main(["run", "fedavg", "--workspace", str(tmp_path / "ws"), "--set", "net.norm=group"]) == 2
    assert "command-line overrides (net.norm" in capsys.readouterr().err and not (tmp_path / "ws").exists()
