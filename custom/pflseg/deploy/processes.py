"""Process supervision for the simulator runner (``pflseg.deploy.simulator``): SIGINT / SIGTERM become an exception
while a simulator runs, and a simulator is stopped whole (every process of it has exited when ``stop_simulator``
returns)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pflseg.deploy.sampling import names


class Signalled(BaseException):
    """SIGINT or SIGTERM arrived while ``signals_raise`` was in force (``signum``: which)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def signals_raise():
    """While the simulator runs: SIGINT and SIGTERM raise ``Signalled`` (main thread only; elsewhere unchanged)."""
    with _handlers(_raise_signal):
        yield


@contextlib.contextmanager
def signals_ignored():
    """SIGINT and SIGTERM ignored in the block (main thread only), e.g. while a stop must not be cut short."""
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
    raise Signalled(signum)


def stop_simulator(proc: subprocess.Popen, workspace: Path, grace: float = 10.0) -> None:
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
        if names(p.info.get("cmdline") or [], marker):
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
