"""Run exported jobs in FLARE's simulator on this machine: ``nvflare simulator`` as a subprocess (as a user
would run it), or the ``python job.py`` route through FLARE's SimEnv; per-site state under the workspace.

One run per workspace at a time, recorded in ``<workspace>/run.json`` (``pflseg.deploy.workspace``). SIGINT /
SIGTERM while the simulator runs stop it whole and wait until every process of it has exited
(``pflseg.deploy.processes.stop_simulator``), then raise ``Interrupted`` naming the last completed round. The
simulator's peak memory is sampled (``pflseg.deploy.sampling``) into results.json's ``footprint``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pflseg.deploy.processes import Signalled, signals_ignored, signals_raise, stop_simulator
from pflseg.deploy.sampling import GIB, MemorySampler, tree
from pflseg.deploy.workspace import finish_record, job_config, record_run, server_state, workspace_lock
from pflseg.flare.allowlist import add_to_resources
from pflseg.flare.state import RoundStore
from pflseg.progress import PREFIX, duration


class Interrupted(BaseException):
    """SIGINT or SIGTERM stopped the command (a simulator it ran has been stopped whole and has exited).

    ``code`` is what a shell reports for the signal: 128 + its number (130 for SIGINT, 143 for SIGTERM).
    ``rounds_done``: the rounds the stopped run completed (its server state folder's latest round + 1, as the
    "round r done" lines count them; 0 when none); None when no simulator was running.
    """

    def __init__(self, signum: int, workspace: Path | None = None, rounds_done: int | None = None):
        self.signum, self.workspace, self.rounds_done, self.code = signum, workspace, rounds_done, 128 + signum
        super().__init__(self.message())

    def message(self, hint: str = "continue with --resume") -> str:
        if self.rounds_done is None:
            return f"stopped ({signal.Signals(self.signum).name})"
        return f"stopped after round {self.rounds_done}; {hint} (workspace {self.workspace})"


def raise_interrupted(signum, frame) -> None:
    """Signal handler: the signal becomes ``Interrupted`` (e.g. SIGTERM, whose default ends Python at once)."""
    raise Interrupted(signum)


#: set by ``run_side_by_side`` when a signal asks every run of this process to stop (runs in worker threads see
#: no signal themselves): each running simulator is then stopped whole, as on a signal in the main thread
_STOP: list[int] = []


def run_side_by_side(calls: dict[str, Callable[[], Any]], after: dict[str, str] | None = None,
                     workers: int = 2) -> dict[str, Any]:
    """Run ``calls`` (name -> a function that runs simulator jobs) ``workers`` at a time, in the order given; a call
    named in ``after`` (name -> the call it needs) starts once that one has returned. FLARE's start-up, its
    round-trip waits and the final test leave cores idle that a second job uses.

    Returns name -> what each call returned. On SIGINT / SIGTERM every running simulator is stopped whole and
    ``Interrupted`` is raised (naming a stopped run's workspace and rounds); an error in one call stops nothing
    else and is raised once the others have finished.
    """
    from concurrent.futures import ThreadPoolExecutor

    after = dict(after or {})
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict = {}

        def call(name):
            if name in after:
                futures[after[name]].result()
            if _STOP:  # stopped before it started
                raise Interrupted(_STOP[0])
            return calls[name]()

        for name in calls:  # a call's prerequisite is submitted before it: it runs or has run when it is awaited
            futures[name] = pool.submit(call, name)
        try:
            with signals_raise():
                for f in futures.values():
                    while not f.done():
                        time.sleep(0.2)
        except Signalled as exc:
            _STOP.append(exc.signum)
            with signals_ignored():
                stopped = [f.exception() for f in futures.values()]
            raise next((e for e in stopped if isinstance(e, Interrupted) and e.rounds_done is not None),
                       Interrupted(exc.signum)) from None
        return {name: f.result() for name, f in futures.items()}


def run_simulator(
    job_dir: str | Path,
    workspace: str | Path,
    n_sites: int = 3,
    threads: int | None = None,
    data: str | Path | None = None,
    progress=print,
    clients: list[str] | None = None,
    inputs: dict | None = None,
) -> dict:
    """Run an exported job with ``nvflare simulator`` (a subprocess, as a user would) and return its results.

    Layout: ``<workspace>/sim`` is FLARE's simulator workspace, ``<workspace>/state/<server|site>/<job>`` the
    pflseg state (checkpoints, personalized models, results.json); the state survives a re-run, so
    ``resume: true`` continues a stopped run. ``clients`` names the simulated sites (default site-1..n_sites),
    e.g. the inside sites of a leave-one-site-out split. ``<workspace>/run.json`` records the run
    (``run_record`` of the job's config, ``data``, the sites and ``inputs``: anything else the run reads, e.g.
    the record of the run whose bundle it uses), with its start and, once done, its finish time.

    The workspace is locked while the job runs (``workspace_lock``; a caller may hold it already). On SIGINT or
    SIGTERM the simulator is stopped whole and ``Interrupted`` is raised.

    A local simulation's user is also its server's operator: a post-training job (``fedsm_infer``,
    ``iopfl_route``) may read the bundle of a run in a sibling workspace (``PFLSEG_BUNDLE_ROOTS`` = the
    workspace's parent, unless set in the environment; see ``PostTrainingController.bundle_folder``).

    Raises:
        WorkspaceBusy: another run holds the workspace.
        Interrupted: SIGINT / SIGTERM stopped the run.
    """
    job_dir, workspace = Path(job_dir).resolve(), Path(workspace).resolve()
    with workspace_lock(workspace):
        return _run_locked(job_dir, workspace, n_sites, threads, data, progress, clients, inputs)


def _run_locked(job_dir: Path, workspace: Path, n_sites, threads, data, progress, clients, inputs) -> dict:
    name = job_dir.name
    n_sites = len(clients) if clients else n_sites
    # the simulated sites share this machine's cores
    env = {"PFLSEG_THREADS": str(max(1, (os.cpu_count() or 1) // n_sites)),
           "PFLSEG_BUNDLE_ROOTS": str(workspace.parent), **os.environ, "PFLSEG_STATE_DIR": str(workspace / "state")}
    if data is not None:
        data = Path(data).resolve()
        if not (data / "dataset.json").is_file():
            raise FileNotFoundError(f"--data {data}: no dataset.json there; make one with `pflseg data synth|index`")
        env["PFLSEG_DATA"] = str(data)
    add_to_resources(workspace / "sim" / "local" / "resources.json")  # package-mode jobs: pflseg classes allowed
    sites = list(clients) if clients else [f"site-{i + 1}" for i in range(n_sites)]
    record = record_run(workspace, job_dir, data, sites, inputs)
    cmd = ["nvflare", "simulator", str(job_dir), "-w", str(workspace / "sim"), "-n", str(n_sites),
           "-t", str(threads or n_sites)] + (["-c", ",".join(clients)] if clients else [])
    progress(f"[{name}] {' '.join(cmd)}")
    results_path = server_state(workspace, name) / "results.json"
    results_path.unlink(missing_ok=True)
    log_path = workspace / "simulator.log"
    t0 = time.time()
    server_log = workspace / "sim" / "server" / "log.txt"
    rounds = RoundStore(server_state(workspace, name), clean=False)
    for attempt in range(1, STARTS + 1):
        before = rounds.latest()
        proc, peak, lost = _simulate(cmd, env, name, job_dir, n_sites, workspace, log_path, results_path, progress,
                                     append=attempt > 1)
        if lost is None:
            break
        done = rounds.latest()  # a round finished in this start: the run went on past its start (resume continues it)
        went_on = done is not None and (before is None or done > before)
        if went_on or attempt == STARTS:
            raise RuntimeError(
                f"job {name}: FLARE's simulator lost a site's worker process ({lost}) "
                + (f"after round {done + 1}; continue with --resume" if went_on
                   else f"while starting it, {STARTS} times")
                + f"; see {log_path}")
        progress(f"[{name}] FLARE's simulator lost a site's worker process while starting it ({lost}); nothing had "
                 f"run yet: starting the job again ({attempt + 1} of {STARTS})")
    if not results_path.is_file():
        reason = panic_reason(server_log)
        raise RuntimeError(
            f"job {name} did not finish (simulator exit {proc.returncode})"
            + (f": the server stopped it: {reason}" if reason else "")
            + f"; see {log_path} and {server_log}"
        )
    results = json.loads(results_path.read_text())
    results["footprint"] = {"wall_seconds": time.time() - t0, "peak_rss_gib": peak.total_rss / GIB}
    results_path.write_text(json.dumps(results, indent=1, sort_keys=True))
    finish_record(workspace, record)
    return results


#: starts of a job whose simulator lost a site's worker before any round finished (``LOST``): it starts again
STARTS = 3

#: FLARE 2.9 simulator lines saying that a site's worker process is gone (its port taken by another process before
#: the worker bound it, or the worker dead): the server would wait for that site until the task timeout (an hour by
#: default), so the run is stopped at once instead (``_simulate``). Seen in 2 of about 150 runs on this project's
#: 2-core machine.
LOST = ("Communication error with client ", "Subprocess died for client ", "Failed to create connection to the child")


def _simulate(cmd: list[str], env: dict, name: str, job_dir: Path, n_sites: int, workspace: Path, log_path: Path,
              results_path: Path, progress, append: bool = False) -> tuple[subprocess.Popen, MemorySampler, str | None]:
    """Run the simulator command to its end: (process, memory sampler, None); or stop it whole at a ``LOST`` line
    before the run's results are written: (process, sampler, that line). SIGINT / SIGTERM stop it whole and raise
    ``Interrupted``; any other error stops it whole and is raised."""
    server_log = workspace / "sim" / "server" / "log.txt"
    proc = reader = peak = None
    # line-buffered: the log can be followed while it runs; a second start appends (the lost start stays readable)
    with open(log_path, "a" if append else "w", buffering=1) as log_file:
        try:
            with signals_raise():
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                peak = MemorySampler(tree(proc.pid), pss=False)  # the simulator's resident memory, in all
                peak.start()
                seen = Heard(name, _planned_rounds(job_dir), n_sites, log_path)
                reader = threading.Thread(target=_relay, args=(proc.stdout, log_file, name, progress, seen),
                                          daemon=True)
                reader.start()
                while proc.poll() is None:
                    if _STOP:  # run_side_by_side was told to stop
                        raise Signalled(_STOP[0])
                    if seen.lost and not results_path.is_file():
                        stop_simulator(proc, workspace)
                        return proc, peak, seen.lost
                    line = seen.heartbeat()  # a word every SILENCE_S of silence: what is running, since when
                    if line:
                        progress(line)
                    # FLARE 2.9's simulator idles ~6 s after the server runner has finished (fixed shutdown waits);
                    # the run is complete by then (results, checkpoints, TensorBoard events written), so end it.
                    if results_path.is_file() and _server_runner_finished(server_log):
                        stop_simulator(proc, workspace)
                    time.sleep(0.2)
                stop_simulator(proc, workspace)  # client workers FLARE left behind, if any
        except (Signalled, KeyboardInterrupt) as exc:
            with signals_ignored():  # a second Ctrl-C must not cut the stop short (SIGKILL follows after a grace)
                if proc is not None:
                    stop_simulator(proc, workspace)
            latest = RoundStore(server_state(workspace, name), clean=False).latest()
            raise Interrupted(getattr(exc, "signum", signal.SIGINT), workspace,
                              0 if latest is None else latest + 1) from None
        except Exception:  # whatever went wrong here, no simulator is left running
            if proc is not None:
                stop_simulator(proc, workspace)
            raise
        finally:
            if reader is not None:
                reader.join(timeout=30)
            if peak is not None:
                peak.stop()
    return proc, peak, None


PANIC = "Aborting current RUN due to FATAL_SYSTEM_ERROR received: "


def panic_reason(server_log: Path) -> str | None:
    """Why the server's controller ended the run (its ``panic``: a bad config, too few sites, a checkpoint that
    does not fit), from FLARE's server log; None when it says nothing of the kind."""
    try:
        lines = server_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.split(PANIC, 1)[1].strip() for line in lines if PANIC in line]
    return found[0] if found else None


def result_warnings(results: dict) -> list[str]:
    """What a person must know before trusting a finished run's numbers: the best global model (chosen on
    validation Dice among the model each round started from and the final one) is the untrained initial model."""
    if results.get("best_global_round") == 0:
        return [f"warning: the best global model by validation Dice is the untrained initial model (the one round 1 "
                f"started from; rounds={results.get('rounds')}): the global numbers are of a network that never "
                "trained. Run more rounds (--rounds), or check train.lr and the data (pflseg data check)"]
    return []


#: seconds without a line on the terminal after which ``pflseg run`` says what is running (``Heard.heartbeat``)
SILENCE_S = 15.0


class Heard:
    """What the terminal has been told of a running simulator, and what to say after ``SILENCE_S`` of silence.

    Round lines ("round k done in W s") get an ETA for the rounds left (the mean wall of the rounds after the first,
    which holds the sites' start-up); progress lines of the sites (``pflseg.progress``: data synthesis,
    inference, routing) are relayed as they come. ``rounds`` is 0 for a post-training job (no rounds).
    """

    def __init__(self, name: str, rounds: int, n_sites: int, log_path: Path, clock=time.monotonic):
        self.name, self.rounds, self.n_sites, self.log_path, self.clock = name, rounds, n_sites, log_path, clock
        self.t0 = self.last = self.round_t0 = clock()
        self.walls: list[float] = []
        self.lost: str | None = None  # the first LOST line: FLARE's simulator lost a site's worker process

    def round_done(self, msg: str) -> str:
        """A round line with the ETA of the rounds left."""
        try:
            self.walls.append(float(msg.split(" done in ", 1)[1].split(" s", 1)[0]))
        except (IndexError, ValueError):
            return msg
        self.round_t0 = self.clock()
        k, left = len(self.walls), self.rounds - len(self.walls)
        if left <= 0:
            return f"{msg}; the final validation and test next"
        steady = self.walls[1:] or self.walls
        eta = sum(steady) / len(steady) * left
        which = f"round {k + 1}" if left == 1 else f"rounds {k + 1}-{self.rounds}"
        return f"{msg}; ETA {duration(eta)} for {which}, then the final test"

    def said(self) -> None:
        self.last = self.clock()

    def heartbeat(self) -> str | None:
        """A line when nothing was said for ``SILENCE_S``: FLARE's start-up, the round running (with its ETA), the
        final test or a post-training job's work; None otherwise."""
        now = self.clock()
        if now - self.last < SILENCE_S:
            return None
        self.last = now
        k = len(self.walls)
        if self.rounds and not k:
            what = (f"starting: FLARE's simulator and {self.n_sites} site(s); each site reads (or makes) and caches "
                    f"its data before round 1 ({duration(now - self.t0)} so far)")
        elif self.rounds and k < self.rounds:
            steady = self.walls[1:] or self.walls
            mean = sum(steady) / len(steady)
            left = max(mean - (now - self.round_t0), 0) + mean * (self.rounds - k - 1)
            what = f"round {k + 1}/{self.rounds} running ({duration(now - self.round_t0)}); ETA {duration(left)}"
        elif self.rounds:
            what = f"final validation and test running ({duration(now - self.round_t0)})"
        else:
            what = f"post-training job running at the sites ({duration(now - self.t0)} so far)"
        return f"[{self.name}] {what}; full log: {self.log_path}"


def _planned_rounds(job_dir: Path) -> int:
    """The rounds an exported job runs: its config's ``rounds``, 0 for a post-training job (or an unknown one)."""
    from pflseg.flare.methods import METHODS

    try:
        cfg = job_config(job_dir)
    except (OSError, ValueError):
        return 0
    entry = METHODS.get(cfg.get("method"))
    return 0 if entry is None or entry.after is not None else int(cfg.get("rounds") or 0)


def _relay(stream, log_file, name: str, progress, seen: Heard | None = None) -> None:
    try:
        for line in stream:
            log_file.write(line)
            if seen is not None and seen.lost is None and any(m in line for m in LOST):
                seen.lost = line.rstrip().split(" - ")[-1][:300]
            if "pflseg" in line or "round " in line and "done" in line or "ERROR" in line or PREFIX in line:
                msg = line.rstrip().split(" - ")[-1]
                if "round " in msg and " done in " in msg:
                    progress(f"[{name}] {seen.round_done(msg[:300]) if seen else msg[:300]}")
                elif "left out" in msg or "ERROR" in line or msg.startswith(PREFIX):
                    progress(f"[{name}] {msg[:300]}")
                else:
                    continue
                if seen is not None:
                    seen.said()
    except (ValueError, OSError):  # the log was closed: the run was stopped and a stray process still writes
        pass


def _server_runner_finished(server_log: Path) -> bool:
    try:
        with open(server_log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            return b"Server runner finished." in f.read()
    except OSError:
        return False


def run_simenv(name: str, workspace: str | Path, n_sites: int = 3, threads: int | None = None,
               overrides: dict | None = None) -> Path:
    """The ``python job.py`` route: job ``name`` as a pflseg recipe (``pflseg.flare.recipes``) run with FLARE's SimEnv
    in this process: FLARE's workspace in ``<workspace>/sim``, pflseg's state in ``<workspace>/state``. Returns the
    path of its ``results.json``."""
    from nvflare.recipe.sim_env import SimEnv

    from pflseg.flare.recipes import STATE_DIR, PflsegRecipe

    workspace = Path(workspace).resolve()
    recipe = PflsegRecipe(name, overrides=overrides)
    env = SimEnv(num_clients=n_sites, num_threads=threads or n_sites, workspace_root=str(workspace / "sim"),
                 extra={STATE_DIR: str(workspace / "state")})
    recipe.execute(env)
    return recipe.results(env)
