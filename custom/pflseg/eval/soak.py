"""`pflseg report soak`: does any process's memory grow round after round over a long run?

Each job (default FedAvg and FedSM, 3 sites, 100 rounds at 32 px) runs once in FLARE's simulator (``env`` sim) or in
a loopback POC federation (``env`` poc: ``pflseg.deploy.poc``, started for the job and stopped after it) while a
thread samples every ``period`` s the proportional set size (PSS) of each process (``pflseg.deploy.sampling``;
simulator: the simulator, which runs the server, and each site process; POC: each participant's parent process and,
as ``<participant> job``, the job processes it starts), and the round the server has finished (its newest
``round_NNNN.pt``). Per process, the
samples of each round are reduced to their median, and the growth is the least-squares slope of those medians over
the rounds after ``warmup`` (MiB per round): allocator pools, caches and the first rounds' imports settle before it.
A process passes when its growth is at most ``BOUND_MIB`` per round (over 100 rounds: at most 0.2 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pflseg.deploy.sampling import MemorySampler, named
from pflseg.markdown import markdown_table

MIB = 2**20
#: growth per round after the warm-up that a process may show and pass (MiB)
BOUND_MIB = 2.0
#: ``soak``'s defaults; its jobs: ``default_jobs``
DEFAULTS = {"sites": 3, "rounds": 100, "size": 32, "warmup": 5, "period": 1.0}
#: where the soaked jobs run: FLARE's simulator, or a loopback POC federation
ENVS = ("sim", "poc")


class RoundTrace(MemorySampler):
    """A ``MemorySampler`` that also keeps every sample: ``trace`` = [(round done, {part: bytes})]."""

    def __init__(self, find, rounds_done: Callable[[], int], period: float):
        super().__init__(find, period)
        self.rounds_done, self.trace = rounds_done, []

    def sample(self) -> None:
        parts, _ = self.read()
        if parts:
            self.trace.append((self.rounds_done(), parts))


def rounds_done(folder: Path) -> Callable[[], int]:
    """The newest finished round of a server state folder (its ``round_NNNN.pt``; 0 before the first)."""
    def newest() -> int:
        return max((int(p.stem.split("_")[1]) for p in folder.glob("round_*.pt")), default=0)
    return newest


def growth(trace: Sequence[tuple[int, dict[str, int]]], warmup: int) -> dict[str, dict]:
    """Per part: the median PSS of each round (MiB), and the least-squares slope over the rounds after ``warmup``.

    Returns:
        part -> {"rounds": n rounds used, "first_mib", "last_mib" (the medians of the first and last of them),
        "growth_mib_per_round" (None with fewer than 3 rounds), "passes"}.
    """
    per_round: dict[str, dict[int, list[float]]] = {}
    for r, parts in trace:
        if r > warmup:
            for part, value in parts.items():
                per_round.setdefault(part, {}).setdefault(r, []).append(value / MIB)
    out = {}
    for part, rounds in sorted(per_round.items()):
        xs = sorted(rounds)
        ys = [statistics.median(rounds[x]) for x in xs]
        slope = None
        if len(xs) >= 3:
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out[part] = {"rounds": len(xs), "first_mib": ys[0], "last_mib": ys[-1], "growth_mib_per_round": slope,
                     "passes": slope is not None and slope <= BOUND_MIB}
    return out


def default_jobs() -> tuple[str, ...]:
    """The jobs soaked when none is named: the registry's reference job, then the methods whose ``Method.reports``
    name the soak (FedAvg, FedSM)."""
    from pflseg.flare.methods import REFERENCE_JOB, report_jobs

    return (REFERENCE_JOB, *report_jobs("soak"))


def participants(fed) -> Callable[[], list]:
    """A ``MemorySampler`` finder over a running federation (``pflseg.deploy.local.LocalFederation``): each
    participant's process labelled by its name, every process it started (FLARE's job processes) ``<name> job``."""
    def find() -> list:
        import psutil

        found = []
        for name, pid in fed.pids.items():
            try:
                parent = psutil.Process(pid)
                found += [(parent, name), *((c, f"{name} job") for c in parent.children(recursive=True))]
            except psutil.Error:  # gone: nothing to sample
                continue
        return found
    return find


def soak(workspace: str | Path, methods: Sequence[str] | None = None, sites: int = DEFAULTS["sites"],
         rounds: int = DEFAULTS["rounds"], size: int = DEFAULTS["size"], warmup: int = DEFAULTS["warmup"],
         period: float = DEFAULTS["period"], env: str = "sim", progress=print) -> dict:
    """Run each of ``methods`` (default ``default_jobs``) once in ``env`` (``ENVS``) with its memory traced; write
    ``<workspace>/soak.json`` (``soak_poc.json`` for a POC)."""
    from pflseg.eval.speed import data_root, job_overrides
    from pflseg.flare.jobs import export_job

    if env not in ENVS:
        raise ValueError(f"soak env {env!r}: expected one of {', '.join(ENVS)}")
    ws = Path(workspace).resolve()
    root = data_root(ws, sites, size)
    result: dict = {"sites": sites, "rounds": rounds, "size": size, "warmup": warmup, "bound_mib": BOUND_MIB,
                    "period": period, "env": env, "jobs": {}}
    for job in default_jobs() if methods is None else methods:
        run = ws / env / job
        job_dir = export_job(job, run / "job", overrides=job_overrides(sites, rounds, size))
        progress(f"soak: {job} in {'the simulator' if env == 'sim' else 'a loopback POC'}, {sites} sites, {rounds} "
                 f"rounds at {size} px ...")
        seconds, trace = (_sim if env == "sim" else _poc)(run, job, job_dir, sites, root, period)
        result["jobs"][job] = {"seconds": seconds, "samples": len(trace), "processes": growth(trace, warmup)}
    (ws / ("soak.json" if env == "sim" else f"soak_{env}.json")).write_text(json.dumps(result, indent=1))
    return result


def _sim(run: Path, job: str, job_dir: Path, sites: int, root: Path, period: float) -> tuple[float, list]:
    from pflseg.deploy.simulator import run_simulator
    from pflseg.deploy.workspace import server_state

    t0 = time.monotonic()
    with RoundTrace(named(run / "sim"), rounds_done(server_state(run, job)), period) as trace:
        run_simulator(job_dir, run, n_sites=sites, data=root, progress=lambda m: None)
    return time.monotonic() - t0, trace.trace


def _poc(run: Path, job: str, job_dir: Path, sites: int, root: Path, period: float) -> tuple[float, list]:
    from pflseg.deploy.poc import PocFederation
    from pflseg.deploy.submit import submit

    fed = PocFederation(run / "poc", n_sites=sites, progress=lambda m: None)
    fed.provision({"data": str(root)})
    try:
        fed.start()
        fed.wait_connected()
        t0 = time.monotonic()
        state = fed.kit(fed.server()) / "pflseg_state" / job  # a deployed server's state (``pflseg.flare.state``)
        with RoundTrace(participants(fed), rounds_done(state), period) as trace:
            results = submit(job_dir, fed.admin_kit(), out=run / "results", progress=lambda m: None)
        if results.get("status") != "FINISHED:COMPLETED":
            raise RuntimeError(f"soak: {job} in the POC ended {results.get('status')}; see {run / 'results'}")
        return time.monotonic() - t0, trace.trace
    finally:
        fed.stop()


def to_markdown(result: dict) -> str:
    rows = [[job, part, p["rounds"], f"{p['first_mib']:.0f}", f"{p['last_mib']:.0f}",
             "-" if p["growth_mib_per_round"] is None else f"{p['growth_mib_per_round']:+.2f}",
             "yes" if p["passes"] else "**no**"]
            for job, run in result["jobs"].items() for part, p in run["processes"].items()]
    where = "a loopback POC" if result.get("env") == "poc" else "FLARE's simulator"
    head = (f"Memory over {result['rounds']} rounds ({result['sites']} sites, {result['size']} px, {where}): "
            f"per process, its PSS (median of each round's samples, every {result['period']:g} s) after round "
            f"{result['warmup']} and at the end, and the least-squares growth per round after round "
            f"{result['warmup']}; "
            f"a process passes at <= {result['bound_mib']:g} MiB per round.")
    return "\n".join([head, "", markdown_table(["job", "process", "rounds", "PSS first (MiB)", "PSS last (MiB)",
                                                "growth (MiB/round)", "passes"], rows)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soak-methods", nargs="+", metavar="JOB",
                        help="jobs to soak (default: the reference job and the registry's soak methods)")
    parser.add_argument("--soak-rounds", type=int, metavar="N", help=f"rounds (default {DEFAULTS['rounds']})")
    parser.add_argument("--soak-env", choices=ENVS, default="sim",
                        help="where the jobs run: sim (FLARE's simulator, default) or poc (a loopback POC federation)")


def name_defaults(parser: argparse.ArgumentParser) -> None:
    """--soak-methods' help naming ``default_jobs`` (read from the registry when the command is parsed)."""
    for action in parser._actions:
        if action.dest == "soak_methods":
            action.help = f"jobs to soak (default: {' '.join(default_jobs())})"


def report(workspace: str | Path | None = None, soak_methods=None, soak_rounds=None, sites=None, size=None,
           soak_env="sim", **_) -> str:
    """``pflseg report soak``: ``soak`` in ``workspace`` (default ``runs/soak``); its Markdown."""
    return to_markdown(soak(workspace or "runs/soak", soak_methods or default_jobs(), sites or DEFAULTS["sites"],
                            soak_rounds or DEFAULTS["rounds"], size or DEFAULTS["size"], env=soak_env))
