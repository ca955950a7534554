"""Run exported jobs in FLARE's simulator on this machine: ``nvflare simulator`` as a subprocess (as a user
would run it), or the ``python job.py`` route through FLARE's SimEnv; per-site state under the workspace.

One run per workspace at a time: ``workspace_lock`` holds ``<workspace>/.lock`` (``fcntl.flock``) and writes
the holder (pid, command, start time) into it; a second run there fails at once naming the holder
(``WorkspaceBusy``). Every run records what makes it the run it is in ``<workspace>/run.json``
(``run_record``: its effective config, its data (dataset.json and each site's datalist.json, by content and
hash), its sites and other inputs); ``judge`` tells whether an earlier run of a workspace is the same run
(read back, resumed) or another one, naming the keys that differ, and ``move_aside`` keeps another one at
``<workspace>.<timestamp>`` (results are never deleted).

SIGINT / SIGTERM while the simulator runs stop it whole and wait until every process of it has exited (see
``_stop_simulator``), then raise ``Interrupted`` naming the last completed round.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pflseg.data.datalist import DATALIST_JSON
from pflseg.flare.allowlist import add_to_resources
from pflseg.flare.methods import own_config
from pflseg.flare.state import RoundStore, write_text
from pflseg.train.progress import PREFIX, duration

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

LOCK, RECORD = ".lock", "run.json"
#: workspaces whose lock this process holds: absolute path -> [lock file descriptor, nesting depth]
_LOCKS: dict[str, list[int]] = {}


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace."""


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


def server_state(workspace: str | Path, job: str) -> Path:
    """Where a run in ``workspace`` keeps job ``job``'s server state: its rounds, ``results.json``, the bundle a
    post-training job reads."""
    return Path(workspace) / "state" / "server" / job


def raise_interrupted(signum, frame) -> None:
    """Signal handler: the signal becomes ``Interrupted`` (e.g. SIGTERM, whose default ends Python at once)."""
    raise Interrupted(signum)


class _Signal(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


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
            with _signals_raise():
                for f in futures.values():
                    while not f.done():
                        time.sleep(0.2)
        except _Signal as exc:
            _STOP.append(exc.signum)
            with _signals_ignored():
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
    proc = reader = peak = None
    with open(log_path, "w", buffering=1) as log_file:  # line-buffered: the log can be followed while it runs
        try:
            with _signals_raise():
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                peak = _PeakMemory(proc.pid)
                seen = Heard(name, _planned_rounds(job_dir), n_sites, log_path)
                reader = threading.Thread(target=_relay, args=(proc.stdout, log_file, name, progress, seen),
                                          daemon=True)
                reader.start()
                while proc.poll() is None:
                    if _STOP:  # run_side_by_side was told to stop
                        raise _Signal(_STOP[0])
                    line = seen.heartbeat()  # a word every SILENCE_S of silence: what is running, since when
                    if line:
                        progress(line)
                    # FLARE 2.9's simulator idles ~6 s after the server runner has finished (fixed shutdown waits);
                    # the run is complete by then (results, checkpoints, TensorBoard events written), so end it.
                    if results_path.is_file() and _server_runner_finished(server_log):
                        _stop_simulator(proc, workspace)
                    time.sleep(0.2)
                _stop_simulator(proc, workspace)  # client workers FLARE left behind, if any
        except (_Signal, KeyboardInterrupt) as exc:
            with _signals_ignored():  # a second Ctrl-C must not cut the stop short (SIGKILL follows after a grace)
                if proc is not None:
                    _stop_simulator(proc, workspace)
            latest = RoundStore(server_state(workspace, name), clean=False).latest()
            raise Interrupted(getattr(exc, "signum", signal.SIGINT), workspace,
                              0 if latest is None else latest + 1) from None
        except Exception:  # whatever went wrong here, no simulator is left running
            if proc is not None:
                _stop_simulator(proc, workspace)
            raise
        finally:
            if reader is not None:
                reader.join(timeout=30)
            if peak is not None:
                peak.stop()
    if not results_path.is_file():
        reason = panic_reason(server_log)
        raise RuntimeError(
            f"job {name} did not finish (simulator exit {proc.returncode})"
            + (f": the server stopped it: {reason}" if reason else "")
            + f"; see {log_path} and {server_log}"
        )
    results = json.loads(results_path.read_text())
    results["footprint"] = {"wall_seconds": time.time() - t0, "peak_rss_gib": peak.peak / 2**30}
    results_path.write_text(json.dumps(results, indent=1, sort_keys=True))
    write_text(workspace / RECORD, json.dumps({**record, "finished": _now()}, indent=1, sort_keys=True))
    return results


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
    which holds the sites' start-up); progress lines of the sites (``pflseg.train.progress``: data synthesis,
    inference, routing) are relayed as they come. ``rounds`` is 0 for a post-training job (no rounds).
    """

    def __init__(self, name: str, rounds: int, n_sites: int, log_path: Path, clock=time.monotonic):
        self.name, self.rounds, self.n_sites, self.log_path, self.clock = name, rounds, n_sites, log_path, clock
        self.t0 = self.last = self.round_t0 = clock()
        self.walls: list[float] = []

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


# ---- stopping the simulator -------------------------------------------------------------------------------
@contextlib.contextmanager
def _signals_raise():
    """While the simulator runs: SIGINT and SIGTERM raise ``_Signal`` (main thread only; elsewhere unchanged)."""
    with _handlers(_raise_signal):
        yield


@contextlib.contextmanager
def _signals_ignored():
    with _handlers(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _handlers(handler):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _raise_signal(signum, frame) -> None:
    raise _Signal(signum)


def _stop_simulator(proc: subprocess.Popen, workspace: Path, grace: float = 10.0) -> None:
    """Stop the simulator whole and wait until every process of it has exited: SIGTERM, SIGKILL after ``grace`` s.

    ``nvflare simulator`` runs in a session of its own (``start_new_session=True``: its process group id is
    its pid, and a terminal's Ctrl-C never reaches it), and FLARE starts each client worker in yet another
    session (``preexec_fn=os.setsid`` in nvflare's simulator_runner.py), so one ``killpg`` of the simulator's
    group misses the workers, which then train on. Every process of the run is signalled with its own process
    group: the simulator's descendants, and any process whose command line names this workspace's FLARE folder
    (``<workspace>/sim``: the workers name it), e.g. a worker whose parent has gone already.
    """
    import psutil

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        procs = _simulator_processes(proc, workspace)
        if not procs:
            break
        for p in procs:
            _send(p, sig)
        deadline = time.monotonic() + wait
        psutil.wait_procs([p for p in procs if p.pid != proc.pid], timeout=wait)  # the simulator: Popen reaps it
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _simulator_processes(proc: subprocess.Popen, workspace: Path) -> list:
    """The simulator (while not yet reaped: its pid is still its own), its descendants and every process whose
    command line names ``<workspace>/sim``; never this process or its ancestors."""
    import psutil

    found = {}
    if proc.poll() is None:
        try:
            root = psutil.Process(proc.pid)
            found = {p.pid: p for p in (root, *root.children(recursive=True))}
        except psutil.Error:
            pass
    marker = str(workspace / "sim")
    for p in psutil.process_iter(["cmdline"]):
        args = p.info.get("cmdline") or []
        if any(a == marker or a.startswith(marker + os.sep) for a in args):
            found.setdefault(p.pid, p)
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    return [p for q, p in found.items() if q not in mine and p.is_running()]


def _send(p, sig: int) -> None:
    """``sig`` to ``p``'s process group (unless it is this process's group), and to ``p`` itself."""
    try:
        group = os.getpgid(p.pid)
        if group != os.getpgrp():
            os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.send_signal(sig)
    except Exception:  # psutil.NoSuchProcess, AccessDenied: gone or not ours
        pass


# ---- one run per workspace --------------------------------------------------------------------------------
@contextlib.contextmanager
def workspace_lock(workspace: str | Path):
    """Hold ``<workspace>/.lock`` (``fcntl.flock``) while the block runs and write the holder into it (pid,
    command, start time). Re-entrant within this process (a command that prepares a run takes it, the runner
    takes it again); released at the end of the block or of the process.

    Raises:
        WorkspaceBusy: another process holds it (names the workspace and the holder).
    """
    ws = Path(workspace).resolve()
    held = _LOCKS.get(str(ws))
    if held is not None:
        held[1] += 1
        try:
            yield ws
        finally:
            held[1] -= 1
        return
    check_workspace(ws)
    fd = os.open(ws / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise WorkspaceBusy(_busy(ws)) from None
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": _command(), "since": _now()}).encode(), 0)
    _LOCKS[str(ws)] = [fd, 1]
    try:
        yield ws
    finally:
        del _LOCKS[str(ws)]
        os.ftruncate(fd, 0)
        os.close(fd)


def check_workspace(workspace: str | Path) -> Path:
    """Make ``workspace`` (a folder) if it is not there; returns it.

    Raises:
        NotADirectoryError: it, or a folder above it, is a file (names the file and the fix).
        PermissionError: it cannot be made or written there.
    """
    ws = Path(workspace).resolve()
    blocker = next((p for p in [ws, *ws.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise NotADirectoryError(f"workspace {ws}: {blocker} is a file, not a folder; give --workspace a folder (a "
                                 "new one is made) or move the file away")
    try:
        ws.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        raise PermissionError(f"workspace {ws}: cannot make or write it ({exc.strerror}); give --workspace a folder "
                              "you may write") from None
    if not os.access(ws, os.W_OK | os.X_OK):
        raise PermissionError(f"workspace {ws}: not writable; give --workspace a folder you may write")
    return ws


def _busy(ws: Path) -> str:
    try:
        holder = json.loads((ws / LOCK).read_text())
        who = f"pid {holder['pid']} (`{holder['command']}`, started {holder['since']})"
        stop = f"stop it (Ctrl-C in its terminal, or kill -INT {holder['pid']})"
    except (OSError, ValueError, KeyError, TypeError):
        who, stop = "another process (it has not named itself yet)", "stop it"
    return (f"workspace {ws} is in use by {who}, which holds {ws / LOCK}; wait until it ends, {stop}, or give "
            "this run another workspace (--workspace)")


def _command() -> str:
    return shlex.join([Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]])


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ---- what a run is: run.json --------------------------------------------------------------------------------
def job_config(job_dir: str | Path) -> dict:
    """The effective config an exported job carries (its server controller's ``config`` argument)."""
    path = Path(job_dir) / "app" / "config" / "config_fed_server.json"
    for workflow in json.loads(path.read_text()).get("workflows", []):
        cfg = workflow.get("args", {}).get("config")
        if isinstance(cfg, dict):
            return cfg
    raise ValueError(f"{path}: no controller with a pflseg config in it")


def run_record(cfg: dict, data: str | Path | None = None, sites: list[str] | dict[str, str] | None = None,
               inputs: dict | None = None) -> dict:
    """What makes a run the run it is: its effective config (without ``resume``, which only says how it
    starts), its data, its sites and other ``inputs``, each by content, and the sha256 of all of it.

    Args:
        cfg: the effective job config (``load_job_config`` = what an exported job carries, ``job_config``).
        data: the data root (None: synthetic data made at each site from the config's ``data.synth_*``).
        sites: the FLARE site names, or ``{FLARE name: the site's folder under data}`` (a renamed site).
        inputs: anything else the run reads, e.g. ``{"bundle_run": <sha256 of the training run's record>}``.

    Returns:
        ``{"config", "data", "sites", "inputs", "sha256"}``; ``data`` holds the root (not compared: a root may
        move), dataset.json's content (without its ``sites`` list) and each site's datalist.json sha256.
    """
    cfg = json.loads(json.dumps(cfg, sort_keys=True))
    cfg.pop("resume", None)
    names = dict(sites) if isinstance(sites, dict) else {s: s for s in sites or []}
    if data is None:
        fingerprint: dict = {"synthetic": "made at each site from the config's data.synth_* settings"}
    else:
        root = Path(data).resolve()
        info = json.loads((root / "dataset.json").read_text())
        info.pop("sites", None)  # a view of the root lists its sites under their FLARE names
        fingerprint = {"root": str(root), "dataset": info,
                       "datalists": {n: _file_sha(root / folder / DATALIST_JSON) for n, folder in names.items()}}
    body = {"config": cfg, "data": fingerprint, "sites": list(names), "inputs": dict(inputs or {})}
    return {**body, "sha256": _sha(_comparable(body))}


def record_run(workspace: Path, job_dir: Path, data: Path | None, sites: list[str], inputs: dict | None) -> dict:
    """Write ``<workspace>/run.json`` for a run of the exported ``job_dir`` about to start; returns the record."""
    try:
        cfg = job_config(job_dir)
    except (OSError, ValueError):  # not a pflseg job folder: FLARE will say what is wrong with it
        cfg = {}
    record = {**run_record(cfg, data, sites, inputs), "job": Path(job_dir).name, "command": _command(),
              "started": _now(), "finished": None}
    write_text(Path(workspace) / RECORD, json.dumps(record, indent=1, sort_keys=True))
    return record


def read_record(workspace: str | Path, job: str) -> dict | None:
    """The record of the earlier run in ``workspace``: its run.json, else (a run made before run.json existed)
    the config of its exported job ``<workspace>/job/<job>`` marked ``"legacy": true``; None when neither."""
    ws = Path(workspace)
    try:
        return json.loads((ws / RECORD).read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return {"unreadable": str(ws / RECORD)}
    try:
        cfg = job_config(ws / "job" / job)
    except (OSError, ValueError):
        return None
    cfg = {k: v for k, v in cfg.items() if k != "resume"}
    return {"config": cfg, "legacy": True}


def differences(earlier: dict, now: dict, more_rounds: bool = False) -> list[str]:
    """``"key: earlier -> now"`` for every key in which two run records differ (config keys dotted, e.g.
    ``train.lr``; ``data.…``, ``sites``, ``inputs.…``). A legacy record (config only) is compared on its config.
    ``more_rounds``: a larger ``rounds`` now is no difference (resuming a finished run extends it)."""
    if "unreadable" in earlier:
        return [f"the earlier run's record {earlier['unreadable']} cannot be read"]
    a, b = _comparable(earlier), _comparable(now)
    for section in ("data", "sites", "inputs"):
        if section not in a:
            b.pop(section, None)
    rounds_a, rounds_b = a.get("config", {}).get("rounds"), b.get("config", {}).get("rounds")
    if more_rounds and isinstance(rounds_a, int) and isinstance(rounds_b, int) and rounds_b >= rounds_a:
        b["config"]["rounds"] = rounds_a
    flat_a, flat_b = _flat(a), _flat(b)
    unset = "(unset)"
    out = []
    for key in [*flat_b, *(k for k in flat_a if k not in flat_b)]:
        va, vb = flat_a.get(key, unset), flat_b.get(key, unset)
        if va != vb:
            label = key[len("config."):] if key.startswith("config.") else key
            out.append(f"{label}: {_short(va)} -> {_short(vb)}")
    return out


def judge(workspace: str | Path, job: str, expected: dict, more_rounds: bool = False) -> tuple[str, list[str]]:
    """What the earlier run of ``job`` in ``workspace`` is to a run with the record ``expected``.

    Returns:
        ``(verdict, lines)``. Verdicts: "none" (nothing to reuse: no earlier run, or one of these settings that
        completed no round), "finished" (these settings, results there: read it back), "stopped" (these
        settings, stopped after a completed round: resume it), "differs" (``lines`` name what differs: keep it
        aside and run afresh). With "finished" / "stopped", ``lines`` may hold a note (a legacy record:
        its data and sites were not recorded, so only its config was compared).
    """
    ws = Path(workspace)
    server = server_state(ws, job)
    results = (server / "results.json").is_file()
    rounds = RoundStore(server, clean=False).latest() is not None
    earlier = read_record(ws, job)
    if earlier is None:
        if results or rounds:
            return "differs", [f"no record of the earlier run's settings ({ws / RECORD})"]
        return "none", []
    diffs = differences(earlier, expected, more_rounds)
    if diffs:
        return "differs", diffs
    note = ["run made before run.json existed: its config (exported job) matches; its data and sites were not "
            "recorded"] if earlier.get("legacy") else []
    if results:
        return "finished", note
    return ("stopped", note) if rounds else ("none", [])


def move_aside(workspace: str | Path) -> Path:
    """Move everything in ``workspace`` (but its lock) to ``<workspace>.<YYYYmmdd-HHMMSS>`` (``.2``, ... when
    taken), never deleting anything; returns that folder."""
    ws = Path(workspace).resolve()
    base = ws.with_name(f"{ws.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = base, 1
    while aside.exists():
        n += 1
        aside = base.with_name(f"{base.name}.{n}")
    aside.mkdir(parents=True)
    for entry in ws.iterdir():
        if entry.name != LOCK:
            os.rename(entry, aside / entry.name)
    return aside


def _comparable(record: dict) -> dict:
    """The part of a record that decides identity (no root path, times, command or hash)."""
    out = {k: json.loads(json.dumps(record[k])) for k in ("config", "data", "sites", "inputs") if k in record}
    if isinstance(out.get("config"), dict):  # another method's section does not change what this run is
        out["config"] = own_config(out["config"])
    if isinstance(out.get("data"), dict):
        out["data"].pop("root", None)
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v, n: int = 60) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= n else text[: n - 3] + "..."


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class _PeakMemory(threading.Thread):
    """Samples the summed resident memory of a process and all its children (the whole simulator)."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period, self.peak, self._stop_event = pid, period, 0, threading.Event()
        self.start()

    def run(self):
        import psutil

        while not self._stop_event.wait(self.period):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.peak = max(self.peak, sum(_rss(p) for p in procs))
            except psutil.Error:
                pass

    def stop(self):
        self._stop_event.set()
        self.join()


def _rss(proc) -> int:
    try:
        return proc.memory_info().rss
    except Exception:
        return 0


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
