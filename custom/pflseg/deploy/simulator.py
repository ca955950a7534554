"""Run exported jobs in FLARE's simulator on this machine: ``nvflare simulator`` as a subprocess (as a user
would run it), or the ``python job.py`` route through FLARE's SimEnv; per-site state under the workspace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pflseg.config import load_job_config
from pflseg.flare.allowlist import add_to_resources
from pflseg.flare.jobs import build_job, in_script_dir


def run_simulator(
    job_dir: str | Path,
    workspace: str | Path,
    n_sites: int = 3,
    threads: int | None = None,
    data: str | Path | None = None,
    progress=print,
    clients: list[str] | None = None,
) -> dict:
    """Run an exported job with ``nvflare simulator`` (a subprocess, as a user would) and return its results.

    Layout: ``<workspace>/sim`` is FLARE's simulator workspace, ``<workspace>/state/<server|site>/<job>`` the
    pflseg state (checkpoints, personalized models, results.json); the state survives a re-run, so
    ``resume: true`` continues a stopped run. ``clients`` names the simulated sites (default site-1..n_sites),
    e.g. the inside sites of a leave-one-site-out split.

    A local simulation's user is also its server's operator: a post-training job (``fedsm_infer``,
    ``iopfl_route``) may read the bundle of a run in a sibling workspace (``PFLSEG_BUNDLE_ROOTS`` = the
    workspace's parent, unless set in the environment; see ``PostTrainingController.bundle_folder``).
    """
    job_dir, workspace = Path(job_dir).resolve(), Path(workspace).resolve()
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
    workspace.mkdir(parents=True, exist_ok=True)
    add_to_resources(workspace / "sim" / "local" / "resources.json")  # package-mode jobs: pflseg classes allowed
    cmd = ["nvflare", "simulator", str(job_dir), "-w", str(workspace / "sim"), "-n", str(n_sites),
           "-t", str(threads or n_sites)] + (["-c", ",".join(clients)] if clients else [])
    progress(f"[{name}] {' '.join(cmd)}")
    results_path = workspace / "state" / "server" / name / "results.json"
    results_path.unlink(missing_ok=True)
    log_path = workspace / "simulator.log"
    t0 = time.time()
    server_log = workspace / "sim" / "server" / "log.txt"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        peak = _PeakMemory(proc.pid)
        reader = threading.Thread(target=_relay, args=(proc.stdout, log_file, name, progress), daemon=True)
        reader.start()
        while proc.poll() is None:
            # FLARE 2.9's simulator idles ~6 s after the server runner has finished (fixed shutdown waits);
            # the run is complete by then (results, checkpoints, TensorBoard events written), so end it.
            if results_path.is_file() and _server_runner_finished(server_log):
                _end_process_group(proc)
            time.sleep(0.2)
        reader.join()
        peak.stop()
    if not results_path.is_file():
        raise RuntimeError(
            f"job {name} did not finish (simulator exit {proc.returncode}); see {log_path} and "
            f"{workspace / 'sim' / 'server' / 'log.txt'}"
        )
    results = json.loads(results_path.read_text())
    results["footprint"] = {"wall_seconds": time.time() - t0, "peak_rss_gib": peak.peak / 2**30}
    results_path.write_text(json.dumps(results, indent=1, sort_keys=True))
    return results


def _relay(stream, log_file, name: str, progress) -> None:
    for line in stream:
        log_file.write(line)
        if "pflseg" in line or "round " in line and "done" in line or "ERROR" in line:
            msg = line.rstrip().split(" - ")[-1]
            if ("round " in msg and " done in " in msg) or "left out" in msg or "ERROR" in line:
                progress(f"[{name}] {msg[:300]}")


def _server_runner_finished(server_log: Path) -> bool:
    try:
        with open(server_log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            return b"Server runner finished." in f.read()
    except OSError:
        return False


def _end_process_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the simulator's whole process group, SIGKILL what is left after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


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
    """The ``python job.py`` route: build the job in Python and run it with FLARE's SimEnv (in this process)."""
    from nvflare.recipe.sim_env import SimEnv
    from nvflare.recipe.spec import Recipe

    workspace = Path(workspace).resolve()
    os.environ.setdefault("PFLSEG_STATE_DIR", str(workspace / "state"))
    add_to_resources(workspace / "sim" / name / "local" / "resources.json")  # SimEnv's workspace for this job
    with in_script_dir():
        job = build_job(load_job_config(name, overrides=overrides))
        Recipe(job).execute(SimEnv(num_clients=n_sites, num_threads=threads or n_sites,
                                   workspace_root=str(workspace / "sim")))
    return Path(os.environ["PFLSEG_STATE_DIR"]) / "server" / name / "results.json"
