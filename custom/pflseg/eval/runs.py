"""`pflseg run`: one job in the FLARE simulator on this machine, then its tables, result files and warnings.

    run_job("fedavg", sites=2, rounds=1, workspace="runs/fedavg")   # prints what `pflseg run fedavg` prints

The workspace (default ``runs/<job>``) is locked for the whole run: a second run there fails before it touches
anything (``pflseg.deploy.simulator.workspace_lock``). ``resume`` continues the earlier run in the workspace only
when it is the same run (``run_overrides``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pflseg.config import load_job_config
from pflseg.deploy.data_sites import job_overrides, planned_sites, run_sites
from pflseg.deploy.simulator import judge, move_aside, result_warnings, run_record, run_simulator, workspace_lock
from pflseg.eval.plots import write_results
from pflseg.eval.tables import run_tables
from pflseg.flare.jobs import export_job


def run_overrides(job: str, workspace: str | Path, sets: list[str] | None = None, data: str | Path | None = None,
                  size: int | None = None, rounds: int | None = None, sites: int | None = None,
                  site_names: list[str] | None = None, resume: bool = False, say=print) -> dict:
    """The config overrides of a run of ``job``: ``sets``, ``data`` and ``size`` (``job_overrides``), ``rounds``,
    and ``min_clients`` = min(sites, 2).

    With ``resume`` the earlier run in ``workspace`` is continued (``resume: true``) only when it is the same run
    (``run.json``: the same effective config but a larger ``rounds``, data and sites); another one is moved aside to
    ``<workspace>.<timestamp>`` (said, naming the keys that differ) and this run starts afresh.
    """
    overrides = job_overrides(sets or [], data, size)
    if rounds:
        overrides["rounds"] = rounds
    names = planned_sites(data, sites, site_names)
    overrides.setdefault("min_clients", min(len(names), 2))
    if resume:
        root = Path(data).resolve() if data else None
        expected = run_record(load_job_config(job, overrides=overrides), root, names)
        verdict, lines = judge(workspace, job, expected, more_rounds=True)
        if verdict == "differs":
            moved = move_aside(workspace)
            say(f"--resume: the earlier run in {Path(workspace).resolve()} is not this run ({'; '.join(lines)}); it "
                f"is kept in {moved}, and this run starts afresh")
        else:
            for line in lines:
                say(f"--resume: {line}")
            overrides["resume"] = True
    return overrides


def run_job(job: str, workspace: str | Path | None = None, sites: int | None = None,
            site_names: list[str] | None = None, rounds: int | None = None, threads: int | None = None,
            data: str | Path | None = None, size: int | None = None, resume: bool = False,
            sets: list[str] | None = None, say=print) -> dict:
    """Export ``job`` with the run's overrides (``run_overrides``) to ``<workspace>/job``, run it in the simulator on
    ``data``'s sites or synthetic ones (``run_sites``, default 3), then ``say`` its tables (``run_tables``), the
    sites left out, the result files written (``write_results``) and the warnings (``result_warnings``).

    Returns:
        The run's results (results.json).
    """
    workspace = Path(workspace or f"runs/{job}")
    with workspace_lock(workspace):  # one run per workspace: a second fails here, before it touches anything
        overrides = run_overrides(job, workspace, sets, data, size, rounds, sites, site_names, resume, say)
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
