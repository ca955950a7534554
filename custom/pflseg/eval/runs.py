"""`pflseg run`: one job in the FLARE simulator on this machine, then its tables, result files and warnings.

    run_job("fedavg", sites=2, rounds=1, workspace="runs/fedavg")   # prints what `pflseg run fedavg` prints

The workspace (default ``runs/<job>``) is locked for the whole run: a second run there fails before it touches
anything (``pflseg.deploy.workspace.workspace_lock``). An earlier run there is never overwritten without a word
(``plan_run``): another run, or the same one without ``resume``, is kept in ``<workspace>.<timestamp>``; with
``resume`` the same run continues at the round after its last completed one, or is read back when it is already
complete. A bad job name, ``--set`` or data (what ``pflseg data check`` refuses) fails before the workspace is made.
"""

from __future__ import annotations

import json
from pathlib import Path

from pflseg.config import load_job_config
from pflseg.deploy.data_sites import check_run_data, job_overrides, planned_sites, run_sites
from pflseg.deploy.simulator import result_warnings, run_simulator
from pflseg.deploy.workspace import judge, move_aside, read_record, run_record, server_state, workspace_lock
from pflseg.eval.plots import write_results
from pflseg.eval.tables import run_tables
from pflseg.flare.jobs import export_job
from pflseg.flare.state import RoundStore


def run_overrides(job: str, workspace: str | Path, sets: list[str] | None = None, data: str | Path | None = None,
                  size: int | None = None, rounds: int | None = None, sites: int | None = None,
                  site_names: list[str] | None = None, resume: bool = False, say=print) -> dict:
    """The config overrides of a run of ``job`` (``plan_run``'s, without its verdict)."""
    return plan_run(job, workspace, sets, data, size, rounds, sites, site_names, resume, say)[0]


def plan_run(job: str, workspace: str | Path, sets: list[str] | None = None, data: str | Path | None = None,
             size: int | None = None, rounds: int | None = None, sites: int | None = None,
             site_names: list[str] | None = None, resume: bool = False, say=print) -> tuple[dict, str]:
    """The config overrides of a run of ``job`` (``sets``, ``data`` and ``size``: ``job_overrides``, ``rounds``,
    ``min_clients`` = min(sites, 2)) and what becomes of the earlier run in ``workspace``, always said:

    - none there: ``"fresh"``;
    - another run (other settings, data or sites; named key by key): kept in ``<workspace>.<timestamp>``,
      ``"fresh"``;
    - the same run without ``resume``: kept in ``<workspace>.<timestamp>`` (finished or stopped, it is never
      overwritten), ``"fresh"``;
    - the same run with ``resume``: ``"complete"`` when it finished every round asked (read back, nothing runs),
      else ``"resume"`` (``resume: true``: it continues at the round after its last completed one, a finished
      run extended to more rounds too).

    Returns:
        ``(overrides, "fresh" | "resume" | "complete")``.
    """
    overrides = job_overrides(sets or [], data, size)
    if rounds:
        overrides["rounds"] = rounds
    names = planned_sites(data, sites, site_names)
    overrides.setdefault("min_clients", min(len(names), 2))
    root = Path(data).resolve() if data else None
    cfg = load_job_config(job, overrides=overrides)
    expected = run_record(cfg, root, names)
    ws = Path(workspace).resolve()
    verdict, lines = judge(ws, job, expected, more_rounds=resume)
    if verdict == "none":
        return overrides, "fresh"
    flag = "--resume: " if resume else ""
    if verdict == "differs":
        moved = move_aside(ws)
        say(f"{flag}the earlier run in {ws} is not this run ({'; '.join(lines)}); it is kept in {moved}, and this "
            "run starts afresh")
        return overrides, "fresh"
    done = rounds_done(ws, job)
    earlier = (read_record(ws, job) or {}).get("config", {}).get("rounds", done)
    if not resume:
        what = (f"a finished run of these settings ({done} round(s))" if verdict == "finished" else
                f"a stopped run of these settings ({done} of {earlier} round(s) done)")
        moved = move_aside(ws)
        say(f"found {what} in {ws}; it is kept in {moved}, and this run starts afresh (--resume would "
            f"{'read it back' if verdict == 'finished' else 'continue it'})")
        return overrides, "fresh"
    for line in lines:
        say(f"--resume: {line}")
    if verdict == "finished" and cfg["rounds"] <= done:
        say(f"--resume: the run in {ws} is already complete ({done} of {cfg['rounds']} round(s)); its results are "
            "read back, nothing runs (more rounds: --rounds N)")
        return overrides, "complete"
    say(f"--resume: resuming the run in {ws} at round {done + 1} of {cfg['rounds']}"
        + (f" (it finished {done} round(s); extended to {cfg['rounds']})" if verdict == "finished" else ""))
    overrides["resume"] = True
    return overrides, "resume"


def rounds_done(workspace: str | Path, job: str) -> int:
    """Rounds the run of ``job`` in ``workspace`` completed: its results' (a finished run), else its server state's
    latest round + 1; 0 when none."""
    server = server_state(workspace, job)
    try:
        return int(json.loads((server / "results.json").read_text())["rounds"])
    except (OSError, ValueError, KeyError, TypeError):
        latest = RoundStore(server, clean=False).latest()
        return 0 if latest is None else latest + 1


def run_job(job: str, workspace: str | Path | None = None, sites: int | None = None,
            site_names: list[str] | None = None, rounds: int | None = None, threads: int | None = None,
            data: str | Path | None = None, size: int | None = None, resume: bool = False,
            sets: list[str] | None = None, say=print) -> dict:
    """Export ``job`` with the run's overrides (``plan_run``) to ``<workspace>/job``, run it in the simulator on
    ``data``'s sites or synthetic ones (``run_sites``, default 3), then ``say`` its tables (``run_tables``), the
    sites left out, the result files written (``write_results``) and the warnings (``result_warnings``). A run
    ``plan_run`` finds already complete (``resume``) is read back instead of run.

    Nothing is made before the job's name, its config and ``data`` check out (``check_run_data``: what ``pflseg
    data check`` refuses is refused here, before FLARE starts).

    Returns:
        The run's results (results.json).
    """
    workspace = Path(workspace or f"runs/{job}")
    if data:
        check_run_data(data, sites, site_names, job)
    load_job_config(job, overrides=job_overrides(sets or [], data, size))  # a bad name or --set: before the workspace
    with workspace_lock(workspace):  # one run per workspace: a second fails here, before it touches anything
        overrides, plan = plan_run(job, workspace, sets, data, size, rounds, sites, site_names, resume, say)
        if plan == "complete":
            results = json.loads((server_state(workspace, job) / "results.json").read_text())
        else:
            root, clients, n = run_sites(data, workspace, sites, site_names, say=say)
            job_dir = export_job(job, workspace / "job", overrides=overrides)
            results = run_simulator(job_dir, workspace, n_sites=n, threads=threads, data=root, progress=say,
                                    clients=clients)
        for table in run_tables(results, job):
            say(table)
        if results["missing"]:
            say(f"sites left out: {json.dumps(results['missing'])}")
        for line in write_results(results, workspace) + result_warnings(results):
            say(line)
    return results
