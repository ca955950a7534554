"""Ctrl-C stops `pflseg run` whole, as a user presses it: the simulator (its own session) and FLARE's client workers
(sessions of their own) exit, the message names the last completed round, the exit code is 130, no traceback."""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from pflseg.deploy.workspace import workspace_lock
from pflseg.flare.state import RoundStore

pytestmark = pytest.mark.slow


def workspace_processes(ws) -> list:
    """Live processes whose command line names the workspace (the simulator and its workers name ``<ws>/sim``)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(ws) in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


def test_ctrl_c_stops_the_whole_simulator_and_names_the_last_round(tmp_path):
    ws = tmp_path / "ws"
    cmd = [sys.executable, "-m", "pflseg.cli", "run", "fedavg", "--workspace", str(ws), "--sites", "2",
           "--rounds", "50", "--size", "16", "--set", "net.channels=[4,8]", "--set", "net.strides=[2]",
           "--set", "train.epochs=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    out, deadline = [], time.monotonic() + 300
    try:
        while not any(" done in " in line for line in out):  # "[fedavg] round 1 done in 1.23 s ..."
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)[-3000:]
            try:
                out.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    while not lines.empty():
        out.append(lines.get())
    text = "".join(out)
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text
    done = int(re.search(r"stopped after round (\d+); continue with --resume", text).group(1))
    assert done >= 1 and done == RoundStore(ws / "state" / "server" / "fedavg", clean=False).latest() + 1
    assert not workspace_processes(ws)  # nothing trains on in the background
    with workspace_lock(ws):  # and the workspace is free for the --resume
        pass
