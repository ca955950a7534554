"""A provisioned federation on this machine: server and sites as separate processes, loopback only.

    fed = LocalFederation("runs/federation"); fed.provision(); fed.start(); fed.wait_connected()
    ... submit jobs with fed.admin_kit() ...
    fed.stop()   # shutdown through the FLARE API, then checks that no process is left

Every participant runs its provisioned kit's own ``startup/sub_start.sh --once`` (what ``start.sh`` runs,
without the restart watchdog) in its own process session; the workspace has its own HOME and job storage.
``federation.json`` in the workspace records the processes (pid, start time and command line), so ``pflseg deploy
stop`` can stop a federation that ``pflseg deploy local`` left running; a recorded pid that now belongs to another
process (the pid was reused after a reboot or a crash) is left alone: only a process with the recorded pid and
start time is signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import yaml

from pflseg.deploy.provision import REPO_PROJECT, loopback_env, provision_loopback
from pflseg.flare.state import private_dir, write_text

PROJECT_ADMIN = "admin@pflseg.org"


class LocalFederation:
    """Provision, start, wait for and stop a loopback federation in ``workspace``."""

    admin = PROJECT_ADMIN

    def __init__(self, workspace: str | Path, project_yml: str | Path = REPO_PROJECT, progress=print,
                 allow_list: str | None = None):
        self.workspace = Path(workspace).resolve()
        self.allow_list = allow_list  # the kits' class allow list, narrow | broad (None: the project's builder's)
        self.project_yml = Path(project_yml)
        self.progress = progress
        self.kits = self._kits()
        self.pids: dict[str, int] = {}
        self.started: dict[str, dict] = {}  # name -> {"pid", "create_time", "cmdline"} of what this federation started
        self._popen: list[subprocess.Popen] = []  # reaped in stop() when started by this process
        self.killed: set[str] = set()  # sites killed on purpose (the server still lists them until it times out)
        record = self.workspace / "federation.json"
        if record.is_file():
            saved = json.loads(record.read_text())
            self.pids, self.started = saved["pids"], saved.get("started", {})

    def _kits(self) -> Path:
        return self.workspace / "provision" / yaml.safe_load(self.project_yml.read_text())["name"] / "prod_00"

    # ---- participants ---------------------------------------------------------------------------
    def _project(self) -> dict:
        return yaml.safe_load((self.workspace / "project.yml").read_text())

    def sites(self) -> list[str]:
        return sorted(p["name"] for p in self._project()["participants"] if p["type"] == "client")

    def admins(self) -> dict[str, str]:
        return {p["name"]: p.get("role", "") for p in self._project()["participants"] if p["type"] == "admin"}

    def kit(self, name: str) -> Path:
        return self.kits / name

    def admin_kit(self, user: str | None = None) -> Path:
        return self.kit(user or self.admin)

    # ---- lifecycle ------------------------------------------------------------------------------
    def provision(self, site_config: dict | None = None) -> Path:
        """Provision on loopback (fresh kits, free port). ``site_config``: written as every site's
        ``local/pflseg_site.json`` (what ``pflseg site init`` writes)."""
        if self.running():
            raise RuntimeError(f"a federation from {self.workspace} is still running; stop it first (pflseg deploy "
                               "stop)")
        self._provision()
        for site in self.sites():
            cfg = {"threads": max(1, (os.cpu_count() or 1) // len(self.sites())), **(site_config or {})}
            write_text(self.kit(site) / "local" / "pflseg_site.json", json.dumps(cfg, indent=1))  # mode 0600
        self.progress(f"provisioned {self.kits} (server localhost, sites {', '.join(self.sites())})")
        return self.kits

    def _provision(self) -> None:
        provision_loopback(self.workspace, self.project_yml, allow_list=self.allow_list)

    def start_participant(self, name: str) -> int:
        kit = self.kit(name)
        log = open(kit / "console.log", "a")
        proc = subprocess.Popen(["bash", str(kit / "startup" / "sub_start.sh"), "--once"], cwd=kit,
                                env=loopback_env(self.workspace), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids[name] = proc.pid
        try:  # Popen returns after the exec: this is the participant's own start time and command line
            started = psutil.Process(proc.pid)
            self.started[name] = {"pid": proc.pid, "create_time": started.create_time(), "cmdline": started.cmdline()}
        except psutil.Error:  # it ended already: nothing to recognise later
            self.started.pop(name, None)
        self._popen.append(proc)
        # started again: no longer a killed site that stop() must release, else stop() removes the running site from
        # the server before shutdown_system, which then never tells it to stop (it was killed 60 s later instead)
        self.killed.discard(name)
        self._record()
        return proc.pid

    def server(self) -> str:
        """The server participant's name (its kit folder)."""
        return next(p["name"] for p in self._project()["participants"] if p["type"] == "server")

    def start(self) -> None:
        self.start_participant(self.server())
        for site in self.sites():
            self.start_participant(site)
        self.progress(f"started server and {len(self.sites())} site(s) (pids {self.pids})")

    def session(self, user: str | None = None, timeout: float = 30.0):
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        return new_secure_session(user or self.admin, str(self.admin_kit(user)), timeout=timeout)

    def connected(self, sess) -> list[str]:
        return sorted(c.name for c in sess.get_system_info().client_info)

    def wait_connected(self, sites: list[str] | None = None, timeout: float = 180.0) -> list[str]:
        """Wait until ``sites`` (default: all) are connected to the server; return the connected sites."""
        want, t0 = set(sites or self.sites()), time.time()
        sess = None
        try:
            while True:
                try:
                    sess = sess or self.session()
                    now = self.connected(sess)
                    if want <= set(now):
                        self.progress(f"connected: {', '.join(now)} after {time.time() - t0:.1f} s")
                        return now
                except Exception as exc:  # server still starting: no admin connection yet
                    now = [f"(server not ready: {exc.__class__.__name__})"]
                if time.time() - t0 > timeout:
                    raise RuntimeError(f"only {now} connected after {timeout:.0f} s; see {self.kits}/*/log.txt")
                time.sleep(1.0)
        finally:
            if sess is not None:
                sess.close()

    def kill(self, name: str) -> None:
        """Kill a participant at once with everything it started (a crashed host)."""
        for proc in self._tree(self._participants([name])):
            _signal(proc, signal.SIGKILL)
        self.killed.add(name)

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Shut the system down through the FLARE API, wait, clean up; return processes that had to be killed."""
        if not self.processes():
            return []
        try:
            sess = self.session(timeout=10.0)
            try:
                self._abort_jobs(sess)
                for site in sorted(self.killed & set(self.connected(sess))):
                    sess.remove_client(site)  # else the server waits 30 s for it to say goodbye
                sess.shutdown_system()
            finally:
                sess.close()
        except Exception as exc:
            self.progress(f"FLARE API shutdown failed ({exc}); stopping the processes directly")
        t0 = time.time()
        while self.processes() and time.time() - t0 < timeout:
            time.sleep(0.5)
        killed = []
        for proc in self.processes():
            killed.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(self.processes(), timeout=10)
        for proc in self._popen:
            proc.wait(timeout=10)
        self.pids, self.started = {}, {}
        self._record()
        self.progress(f"stopped in {time.time() - t0:.1f} s" + (f"; killed leftovers {killed}" if killed else ""))
        return killed

    def _abort_jobs(self, sess, timeout: float = 30.0) -> None:
        """FLARE refuses to shut down while a job runs: abort running jobs first and wait for them to end. A job the
        server refuses to abort (a server killed mid-job and started again lists that job as RUNNING for good, and
        answers "not running") is not waited for: before, its error ended the API shutdown, and every process was
        SIGKILLed after ``stop``'s timeout."""
        active = ("SUBMITTED", "DISPATCHED", "RUNNING")
        running = []
        for job_id in [j["job_id"] for j in sess.list_jobs() if j.get("status") in active]:
            self.progress(f"aborting running job {job_id}")
            try:
                sess.abort_job(job_id)
            except Exception as exc:  # FLARE's API raises on a refusal
                self.progress(f"job {job_id} not aborted ({exc}); not waited for")
                continue
            running.append(job_id)
        t0 = time.time()
        while running and time.time() - t0 < timeout:
            time.sleep(1.0)
            running = [j["job_id"] for j in sess.list_jobs() if j.get("status") in active and j["job_id"] in running]

    # ---- processes ------------------------------------------------------------------------------
    def processes(self) -> list[psutil.Process]:
        """Every live process of this federation: the started ones, their descendants, and any process
        whose command line names this workspace (job processes)."""
        found = {p.pid: p for p in self._tree(self._participants(self.pids))}
        marker = str(self.kits)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.info["cmdline"] and any(marker in arg for arg in proc.info["cmdline"]):
                    found.setdefault(proc.pid, proc)
            except psutil.Error:
                pass
        return [p for p in found.values() if _alive(p)]

    def running(self) -> bool:
        return bool(self.processes())

    def rss_bytes(self) -> int:
        """Summed resident memory of every process of the federation."""
        total = 0
        for proc in self.processes():
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _participants(self, names) -> list[psutil.Process]:
        """The live processes of the recorded participants ``names`` that are still what this federation started:
        the recorded pid with the recorded start time (a record without it, from an older pflseg: a command line
        naming this federation's kits). A pid now used by another process is named in the progress and left out."""
        out = []
        for name in names:
            pid, seen = self.pids.get(name), self.started.get(name)
            try:
                proc = psutil.Process(pid)
                cmdline = proc.cmdline()
                # pid + start time name one process (its command line may change: the kit's script execs)
                ours = (abs(proc.create_time() - seen["create_time"]) < 1e-3 if seen
                        else any(str(self.kits) in arg for arg in cmdline))
            except (psutil.Error, TypeError, ValueError):  # gone (or no pid recorded): nothing to signal
                continue
            if ours:
                out.append(proc)
            else:
                self.progress(f"pid {pid} of {name} (federation.json) now belongs to another process "
                              f"({' '.join(cmdline)[:80] or '?'}); left alone")
        return out

    @staticmethod
    def _tree(roots) -> list[psutil.Process]:
        """``roots`` (processes or pids) and all their descendants."""
        out = []
        for root in roots:
            try:
                root = root if isinstance(root, psutil.Process) else psutil.Process(root)
                out += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def _record(self) -> None:
        private_dir(self.workspace)
        write_text(self.workspace / "federation.json", json.dumps({"pids": self.pids, "started": self.started},
                                                                  indent=1))


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(proc: psutil.Process, sig) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def deploy_local(workspace: str | Path, project_yml: str | Path | None = None, data: str | Path | None = None,
                 sites: int | None = None, site_names: list[str] | None = None, device: str = "auto",
                 timeout: float = 180.0, say=print, allow_list: str | None = None) -> LocalFederation:
    """``pflseg deploy local``: provision ``project_yml`` (default: the repository's) in ``workspace`` on loopback,
    start the server and every site with ``device``, wait up to ``timeout`` seconds until all are connected, and
    ``say`` how to submit to it and stop it; the federation is left running.

    With ``data`` the data root's sites (``sites``: the first N, ``site_names``: those; ``data_sites``) replace the
    project's sites (``<workspace>/project.data.yml``) and every site reads that root; without it, ``site_names`` or
    ``sites`` (``site-1`` .. ``site-N``) replace them (``<workspace>/project.sites.yml``) and the sites make a job's
    synthetic data when it opts in (``data.allow_synthetic``).

    Every site of this researcher's federation on one machine allows jobs of two sites (``LOOPBACK_POLICY``: one
    person holds every site, so what a site receives from the other is no secret; said at provisioning): a
    hospital's own site decides that for itself (``pflseg site init --allow-two-sites``). ``allow_list``: the kits'
    class allow list, narrow (the project's default) or broad (``pflseg.deploy.provision.PflsegBuilder``).
    """
    from pflseg.deploy.data_sites import data_sites, project_with_sites

    project_yml = Path(project_yml) if project_yml else REPO_PROJECT
    site_cfg = {"device": device, "policy": dict(LOOPBACK_POLICY)}
    ws = Path(workspace).resolve()
    chosen = None
    if data:
        root, mapping = data_sites(data, ws, sites, site_names, say)
        site_cfg["data"] = str(root)
        chosen, name = list(mapping), "project.data.yml"
    elif site_names or sites:
        chosen, name = site_names or [f"site-{i + 1}" for i in range(sites)], "project.sites.yml"
    if chosen:
        project = project_with_sites(yaml.safe_load(project_yml.read_text()), chosen)
        private_dir(ws)
        project_yml = ws / name
        project_yml.write_text(yaml.safe_dump(project, sort_keys=False))
    fed = LocalFederation(workspace, project_yml, progress=say, allow_list=allow_list)
    fed.provision(site_cfg)
    say("every site allows jobs of two sites (policy.two_sites: true): this federation's sites are all yours; a "
        "hospital's site decides that itself (`pflseg site init --allow-two-sites`)")
    fed.start()
    fed.wait_connected(timeout=timeout)
    kit = fed.admin_kit()
    say(f"federation running ({fed.rss_bytes() / 2**30:.2f} GiB resident); admin kit: {kit}")
    n = len(fed.sites())
    source = f"--data {Path(data).resolve()}" if data else "--set data.allow_synthetic=true"
    say(f"  a job for these {n} sites: pflseg jobs export fedavg --out runs/jobs {source} --set min_clients="
        f"{min(n, 2)} --set rounds=2")
    say(f"  submit:  pflseg submit runs/jobs/fedavg --kit {kit}")
    say(f"  console: {kit}/startup/fl_admin.sh")
    say(f"  stop:    pflseg deploy stop --workspace {workspace}")
    return fed


#: the policy of every site of ``pflseg deploy local`` (``pflseg.flare.policy``): one researcher's sites
LOOPBACK_POLICY = {"two_sites": True}


def federation_status(workspace: str | Path, say=print) -> bool:
    """``pflseg deploy status``: ``say`` the connected sites, the processes and their resident memory of the
    federation that ``deploy_local`` left running in ``workspace``. Returns False when none is running (said, with
    how to start one)."""
    fed = LocalFederation(workspace)
    if not fed.processes():
        say(f"no federation running from {fed.workspace} (start one: pflseg deploy local --workspace {workspace})")
        return False
    sess = fed.session()
    try:
        say(f"connected sites: {', '.join(fed.connected(sess)) or 'none'}")
    finally:
        sess.close()
    say(f"{len(fed.processes())} process(es), {fed.rss_bytes() / 2**30:.2f} GiB resident")
    return True


def stop_federation(workspace: str | Path, say=print) -> bool:
    """``pflseg deploy stop``: shut the federation in ``workspace`` down (``LocalFederation.stop``); ``say`` how
    many leftover processes were killed and how many are still alive. Returns True when none is left."""
    fed = LocalFederation(workspace, progress=say)
    killed = fed.stop()
    left = fed.processes()
    say(f"stopped; {len(killed)} leftover process(es) killed; {len(left)} still alive")
    return not left
