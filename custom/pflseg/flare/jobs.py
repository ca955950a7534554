"""Effective config -> FLARE FedJob, and export of ``jobs/<name>/`` folders.

A job is: the method's controller (carrying the whole effective config), the TensorBoard receiver on the
server, and on every site the one client script (``pflseg.flare.client``) run by FLARE's Client API
executor with torch tensors end to end. Two ways to ship the code:

- ``package`` (default): sites pip-install pflseg; the job carries no code at all (no ``app/custom``), its
  site executor is ``pflseg.flare.executor.SiteExecutor`` (runs the installed launcher), and FLARE only
  builds the job's pflseg classes because provisioning put them on every site's ``class_allow_list``.
  No ``byoc`` right is needed.
- ``byoc``: the job carries the pflseg package and the three-line launcher ``job_client.py`` in
  ``app/custom`` (FLARE puts that folder first on the job's import path); needs the ``byoc`` right.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.client.config import ExchangeFormat
from nvflare.job_config.api import FedJob
from nvflare.job_config.script_runner import ScriptRunner

from pflseg.config import job_names, load_job_config
from pflseg.deploy.allowlist import add_to_resources
from pflseg.flare.controllers import CONTROLLERS
from pflseg.flare.executor import SiteExecutor

CLIENT_SCRIPT = Path(__file__).with_name("job_client.py")  # runs pflseg.flare.client.main

#: server poll interval (seconds) the sites use to ask for tasks; FLARE's default is 2 s
TASK_REQUEST_INTERVAL = 0.2


MODES = ("package", "byoc")


def build_job(cfg: dict, mode: str = "package") -> FedJob:
    """The FLARE job of effective config ``cfg`` (from ``pflseg.config.load_job_config``) in ``mode`` (see MODES)."""
    if mode not in MODES:
        raise ValueError(f"job mode '{mode}' is unknown; use one of {', '.join(MODES)}")
    job = FedJob(name=cfg["name"], min_clients=cfg["min_clients"])
    job.to_server(CONTROLLERS[cfg["method"]](config=cfg), id="controller")
    job.to_server(TBAnalyticsReceiver(events=["fed.analytix_log_stats", "analytix_log_stats"]), id="receiver")
    job.to_server({"server": {"task_request_interval": TASK_REQUEST_INTERVAL}})
    if mode == "package":
        job.to_clients(SiteExecutor(), tasks=["*"])
    else:  # relative to the script's folder, so that the job carries it as app/custom/job_client.py (see _in_script_dir)
        job.to_clients(ScriptRunner(script=CLIENT_SCRIPT.name, server_expected_format=ExchangeFormat.PYTORCH))
    job.to_clients(ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed."), id="event_to_fed")
    job.set_app_packages(["pflseg"])
    return job


def export_job(name: str, out_dir: str | Path, overrides: dict | None = None, mode: str = "package",
               gpu_mem_gib: float | None = None, sites: list[str] | None = None, job_name: str | None = None) -> Path:
    """Write ``<out_dir>/<job_name or name>/`` (meta.json, app/config/*.json; in byoc mode also app/custom/).

    Args:
        mode: ``package`` (no code in the job) or ``byoc`` (pflseg + launcher in app/custom).
        gpu_mem_gib: ask every site for one GPU with at least this much free memory (meta.json resource_spec);
            None = no GPU requirement (sites use CUDA when they have it, CPU otherwise).
        sites: site names for a per-site resource_spec (needed to state GPU memory); without them the
            requirement is ``{"@default": {"num_of_gpus": 1}}`` (any GPU size).
        job_name: folder and FLARE job name (default: the config name).
    """
    out_dir = Path(out_dir).resolve()
    cfg = load_job_config(name, overrides=overrides)
    if job_name:
        cfg["name"] = job_name
    target = out_dir / cfg["name"]
    if target.exists():
        shutil.rmtree(target)
    with _in_script_dir():
        build_job(cfg, mode).export_job(str(out_dir))
    if mode == "byoc":
        shutil.copytree(Path(__file__).resolve().parents[1], target / "app" / "custom" / "pflseg",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if gpu_mem_gib is not None:
        meta_path = target / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["resource_spec"] = gpu_resource_spec(gpu_mem_gib, sites)
        meta_path.write_text(json.dumps(meta, indent=4))
    return target


def gpu_resource_spec(mem_gib: float, sites: list[str] | None = None) -> dict:
    """meta.json ``resource_spec``: one GPU per site with at least ``mem_gib`` GiB.

    FLARE's GPUResourceManager compares this with the ``mem_per_gpu_in_GiB`` a site declares (its project.yml
    ``capacity``); a nominal "16 GB" card has about 14.6-15.9 GiB usable, so ask for what the job needs
    (measure it), never for a card's nominal size. ``@default`` can only carry the GPU count.
    """
    if mem_gib <= 0:
        raise ValueError(f"GPU memory {mem_gib} GiB: give a positive number of GiB (what one site's training needs)")
    if not sites:
        return {"@default": {"num_of_gpus": 1}}
    return {site: {"num_of_gpus": 1, "mem_per_gpu_in_GiB": mem_gib} for site in sites}


def _in_script_dir():
    """FLARE resolves the client script relative to the working directory when it builds or exports."""
    return contextlib.chdir(CLIENT_SCRIPT.parent)


def export_all(out_dir: str | Path) -> list[Path]:
    return [export_job(name, out_dir) for name in job_names()]


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
    """
    job_dir, workspace = Path(job_dir).resolve(), Path(workspace).resolve()
    name = job_dir.name
    n_sites = len(clients) if clients else n_sites
    # the simulated sites share this machine's cores
    env = {"PFLSEG_THREADS": str(max(1, (os.cpu_count() or 1) // n_sites)), **os.environ,
           "PFLSEG_STATE_DIR": str(workspace / "state")}
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
    with _in_script_dir():
        job = build_job(load_job_config(name, overrides=overrides))
        Recipe(job).execute(SimEnv(num_clients=n_sites, num_threads=threads or n_sites,
                                   workspace_root=str(workspace / "sim")))
    return Path(os.environ["PFLSEG_STATE_DIR"]) / "server" / name / "results.json"
