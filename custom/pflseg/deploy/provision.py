"""Provisioning: the pflseg builder for ``nvflare provision`` and a loopback variant of project.yml.

``PflsegBuilder`` (listed in provisioning/project.yml after FLARE's StaticFileBuilder) writes into every
startup kit what a package-mode deployment needs:

- the server's and every site's ``local/resources.json.default`` get a ``class_allow_list`` that lets jobs without
  custom code run (``pflseg.flare.allowlist``): by default the narrow one, the classes pflseg's jobs name and
  nothing else (``allow_list: narrow``); ``allow_list: broad`` keeps FLARE's 88 default classes and adds pflseg's
  (a federation whose jobs also add FLARE's own privacy filters, ``privacy.update.filters``);
- the server's job store and snapshots go to ``storage_root`` (FLARE's kits default to the shared
  ``/tmp/nvflare/jobs-storage``): one folder per deployment;
- every kit's ``local/authorization.json.default`` gets pflseg's policy (``site_policy``) instead of FLARE's
  default (which lets a ``lead`` of any organisation run custom code, BYOC, at every site and gives
  ``project_admin`` shell commands everywhere): no BYOC (package-mode jobs carry configuration only), shell
  commands for a site's own organisation only, job submission for ``project_admin`` and ``lead``;
- every site's ``local/resources.json.default`` turns FLARE's log streaming off (``allow_log_streaming``,
  true in FLARE 2.9's kits): a site's logs stay at the site;
- every kit without a ``local/comm_config.json`` of its own gets one that keeps the process's internal listener off
  the server's ports (``internal_ports``): FLARE 2.9 picks that listener's port at random in 1025-65535 and checks
  it free before the server's external listener has bound, so one server start in about 64,000 took its own port
  and never listened (seen once in this project's test suite: the admin connection refused for 180 s);
- the server's ``startup/sub_start.sh`` fixes glibc's mmap threshold of the server and its job processes
  (``server_malloc``): FLARE's server job process otherwise grows 2.2-3.4 MiB per round (docs/speed.md);
- the provisioning state folder (``<workspace>/<project>/state``) is made ``0700`` and its ``cert.json``
  ``0600``: FLARE's CertBuilder keeps the root CA's and EVERY participant's private key in that file and writes it
  with the umask's mode (0644 as a rule). The kits' own ``*.key`` files FLARE writes ``0600`` itself.

``provision_loopback`` provisions the same project on this machine only: the server is ``localhost`` on a
free port, storage inside the workspace, HOME inside the workspace (nvflare writes ~/.nvflare).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import yaml
from nvflare.lighter.constants import CtxKey
from nvflare.lighter.spec import Builder

from pflseg.config import resource_dir
from pflseg.flare.allowlist import LISTS, add_to_resources
from pflseg.flare.state import private_dir

#: the deployment template: the checkout's provisioning/project.yml, or an installed wheel's copy of it
REPO_PROJECT = (resource_dir("provisioning") or Path("provisioning")) / "project.yml"
CLIENT_OUTCOME_WAIT_S = 10


#: who may run custom code (BYOC) where: "none", "o:site" (a submitter of the site's own organisation) or "any"
BYOC_CONDITIONS = ("none", "o:site", "any")


def site_policy(byoc: str = "none") -> dict:
    """pflseg's FLARE authorization policy (``local/authorization.json``), the same file for every participant:
    FLARE evaluates ``o:site`` against the organisation of the site that checks (each site checks the commands
    and jobs that reach it with its own file).

    - ``project_admin``: submits, manages and downloads any job and operates (starts, stops) every site, but
      runs shell commands (ls, cat, grep, ...) only at sites of its own organisation;
    - ``lead``: submits jobs, manages and downloads its own, operates and runs shell commands only at its own
      organisation's sites;
    - ``org_admin``: no submission; manages its organisation's jobs, operates its own sites;
    - ``member``: views only;
    - ``get_job_log`` (FLARE 2.9 files the server's job log under no command category, so a policy that does not
      name it refuses it; ``pflseg deploy submit`` follows a job's rounds with it): as ``download_job``;
    - custom code (``byoc``) for ``project_admin`` and ``lead``: ``byoc`` (default none: pflseg jobs run in
      package mode, FLARE builds only classes on the site's ``class_allow_list``); never for the others.
    """
    if byoc not in BYOC_CONDITIONS:
        raise ValueError(f"PflsegBuilder byoc={byoc!r}: expected one of {BYOC_CONDITIONS}")
    common = {"view": "any", "byoc": "none", "server-predeployed-flwr": "none"}
    return {
        "format_version": "1.0",
        "permissions": {
            "project_admin": {**common, "submit_job": "any", "clone_job": "any", "manage_job": "any",
                              "download_job": "any", "get_job_log": "any", "operate": "any", "shell_commands": "o:site",
                              "byoc": byoc},
            "org_admin": {**common, "submit_job": "none", "clone_job": "none", "manage_job": "o:submitter",
                          "download_job": "o:submitter", "get_job_log": "o:submitter", "operate": "o:site",
                          "shell_commands": "o:site"},
            "lead": {**common, "submit_job": "any", "clone_job": "n:submitter", "manage_job": "n:submitter",
                     "download_job": "n:submitter", "get_job_log": "n:submitter", "operate": "o:site",
                     "shell_commands": "o:site", "byoc": byoc},
            "member": {"view": "any"},
        },
    }


class PflsegBuilder(Builder):
    """Adds pflseg's classes to every kit's class allow list, gives the server its own job storage, writes
    pflseg's authorization policy into every kit and turns log streaming off at every site.

    Args:
        storage_root: the server's folder for submitted jobs (``jobs-storage``) and snapshots
            (``snapshot-storage``); one per deployment.
        heart_beat_timeout: seconds without a heartbeat after which the server drops a site as dead and
            ends its tasks (FLARE's dead-client path); written into the server's ``startup/fed_server.json``.
            None keeps FLARE's default, 600 s. A dead site's task ends after min(this, the job's
            ``task_timeout``).
        byoc: who may submit jobs with custom code, for ``project_admin`` and ``lead`` (``site_policy``):
            "none" (default), "o:site" (only at sites of the submitter's own organisation) or "any" (FLARE's
            default for ``lead``: a research federation that trusts its submitters).
        allow_list: the kits' ``class_allow_list``: "narrow" (default: the classes pflseg's jobs name,
            ``pflseg.flare.allowlist.narrow_list``) or "broad" (FLARE's default list plus pflseg's classes).
    """

    def __init__(self, storage_root: str = "/var/lib/pflseg/flare", heart_beat_timeout: int | None = None,
                 byoc: str = "none", allow_list: str = "narrow"):
        self.storage_root = storage_root
        self.heart_beat_timeout = heart_beat_timeout
        self.byoc = byoc
        self.allow_list = allow_list
        site_policy(byoc)  # a wrong value fails before provisioning starts
        if allow_list not in LISTS:
            raise ValueError(f"PflsegBuilder allow_list={allow_list!r}: expected one of {', '.join(LISTS)} (narrow: "
                             "the classes pflseg's jobs name; broad: FLARE's default list plus pflseg's classes)")

    def initialize(self, project, ctx):
        protect_ca_state(Path(ctx.get_state_dir()))

    def finalize(self, project, ctx):
        """Runs just before FLARE's CertBuilder writes ``cert.json`` (builders finalize in reverse order): the file is
        made ``0600`` now (created empty when absent), so that FLARE's rewrite keeps that mode."""
        protect_ca_state(Path(ctx.get_state_dir()), create=True)

    def build(self, project, ctx):
        server = project.get_server()
        policy = json.dumps(site_policy(self.byoc), indent=2)
        for participant in [server, *project.get_clients()]:
            local = Path(ctx.get_local_dir(participant))
            resources = local / "resources.json.default"
            add_to_resources(resources, self.allow_list)
            if participant is server:
                _set_storage(resources, Path(self.storage_root))
            else:
                _no_log_streaming(resources)
            (local / "authorization.json.default").write_text(policy + "\n")
            keep_internal_off(local, ctx.get(CtxKey.ADMIN_PORT), ctx.get(CtxKey.FED_LEARN_PORT))
        server_malloc(Path(ctx.get_kit_dir(server)) / "sub_start.sh")
        if self.heart_beat_timeout is not None:
            fed_server = Path(ctx.get_kit_dir(server)) / "fed_server.json"
            conf = json.loads(fed_server.read_text())
            for entry in conf["servers"]:
                entry["heart_beat_timeout"] = int(self.heart_beat_timeout)
            fed_server.write_text(json.dumps(conf, indent=2))


#: glibc's mmap threshold fixed in the server's processes (bytes; glibc's own start value): a fixed value stops glibc
#: raising it to the largest block freed, after which FLARE's 512 KiB message buffers come from a heap that keeps
#: what is freed. Measured on a loopback POC, 3 sites, 50 rounds at 32 px, two runs each: the server's job process
#: grew 2.17 / 2.17 MiB per round (FedAvg) and 2.72 / 3.35 (FedSM) without, 1.99 / 1.79 and 1.05 / 1.04 with it, at
#: the same wall time; set for every process it also cost the sites about 20 % (docs/speed.md), so sites keep glibc's.
SERVER_MMAP_THRESHOLD = 131072


def server_malloc(sub_start: Path) -> None:
    """Make a server kit's ``startup/sub_start.sh`` export ``MALLOC_MMAP_THRESHOLD_`` (``SERVER_MMAP_THRESHOLD``, unless
    the environment sets one) before it starts the server; once."""
    line = f'export MALLOC_MMAP_THRESHOLD_="${{MALLOC_MMAP_THRESHOLD_:-{SERVER_MMAP_THRESHOLD}}}"  # pflseg\n'
    text = sub_start.read_text()
    if line not in text:
        head, _, rest = text.partition("\n")
        sub_start.write_text(f"{head}\n{line}{rest}" if head.startswith("#!") else line + text)


def keep_internal_off(local: Path, *taken: int | None) -> None:
    """Write ``internal_ports(*taken)`` as a kit's ``local/comm_config.json``, unless the kit has one of its own
    (FLARE's StaticFileBuilder writes one for a ``listening_host``)."""
    comm = Path(local) / "comm_config.json"
    if not comm.exists():
        comm.write_text(json.dumps(internal_ports(*taken), indent=2) + "\n")


def internal_ports(*taken: int | None) -> dict:
    """A ``comm_config.json`` whose internal listener (FLARE's default: tcp on localhost, a random free port) may
    take any port but ``taken``."""
    edges = [1024, *sorted({int(p) for p in taken if p}), 65536]
    ranges = [f"{lo + 1}-{hi - 1}" for lo, hi in zip(edges, edges[1:]) if hi - lo > 1]
    return {"internal": {"scheme": "tcp", "resources": {"host": "localhost", "ports": ranges}}}


#: FLARE's provisioning state: the root CA's and every participant's private key (``nvflare.lighter.impl.cert``)
CERT_STATE = "cert.json"


def protect_ca_state(state: Path, create: bool = False) -> Path:
    """``state`` (a provisioning workspace's ``state`` folder) made ``0700`` and its ``cert.json`` ``0600``;
    ``create``: an absent ``cert.json`` is created empty with that mode (for FLARE to fill). Returns the file."""
    private_dir(state)
    os.chmod(state, 0o700)
    cert = state / CERT_STATE
    if cert.exists() or create:
        fd = os.open(cert, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    return cert


def _set_storage(resources_file: Path, root: Path) -> None:
    res = json.loads(resources_file.read_text())
    res["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(root / "snapshot-storage")
    for comp in res["components"]:
        if comp["id"] == "job_manager":
            comp["args"]["uri_root"] = str(root / "jobs-storage")
    resources_file.write_text(json.dumps(res, indent=2))


def _no_log_streaming(resources_file: Path) -> None:
    res = json.loads(resources_file.read_text())
    res["allow_log_streaming"] = False
    resources_file.write_text(json.dumps(res, indent=2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: a loopback federation's dead-site detection (FLARE's default, 600 s, suits hosts on real networks)
LOOPBACK_HEART_BEAT_TIMEOUT = 60


def loopback_project(project: dict, workspace: Path, port: int, allow_list: str | None = None) -> dict:
    """``project`` (parsed project.yml) made to run on this machine: server ``localhost:port``, storage in
    ``workspace``, a site without heartbeat for ``LOOPBACK_HEART_BEAT_TIMEOUT`` s dropped as dead; ``allow_list``
    (narrow | broad) given: the kits' class allow list (``PflsegBuilder``), else the project's."""
    project = json.loads(json.dumps(project))
    servers = [p for p in project["participants"] if p["type"] == "server"]
    if len(servers) != 1:
        raise ValueError(f"project {project.get('name')}: expected one server participant, found {len(servers)}")
    servers[0].update(name="localhost", fed_learn_port=port)
    servers[0].pop("admin_port", None)
    for b in project["builders"]:
        if b["path"].endswith("PflsegBuilder"):
            b["args"] = {"heart_beat_timeout": LOOPBACK_HEART_BEAT_TIMEOUT, **(b.get("args") or {}),
                         "storage_root": str(workspace / "storage")}
            if allow_list is not None:
                b["args"]["allow_list"] = allow_list
    return project


def provision_loopback(workspace: str | Path, project_yml: str | Path = REPO_PROJECT, port: int | None = None,
                       allow_list: str | None = None) -> Path:
    """Provision ``project_yml`` for loopback into ``workspace`` (``allow_list``: ``loopback_project``); return the
    folder of the startup kits."""
    workspace = Path(workspace).resolve()
    project = yaml.safe_load(Path(project_yml).read_text())
    project = loopback_project(project, workspace, port or free_port(), allow_list)
    private_dir(workspace / "home")
    path = workspace / "project.yml"
    path.write_text(yaml.safe_dump(project, sort_keys=False))
    shutil.rmtree(workspace / "provision", ignore_errors=True)  # fresh kits (and a fresh CA) every time
    cmd = ["nvflare", "provision", "-p", str(path), "-w", str(workspace / "provision")]
    proc = subprocess.run(cmd, env=loopback_env(workspace), capture_output=True, text=True)
    kits = workspace / "provision" / project["name"] / "prod_00"
    if proc.returncode != 0 or not kits.is_dir():
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                           f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    protect_ca_state(kits.parent / "state")  # also for a project.yml without PflsegBuilder
    return kits


def loopback_env(workspace: Path) -> dict:
    """Environment of every process of a loopback deployment: its own HOME, this Python first on PATH."""
    import sys

    env = {**os.environ, "HOME": str(workspace / "home")}
    # the server waits this long for a dead site's job outcome before closing a job (FLARE default: 900 s)
    env.setdefault("NVFLARE_CLIENT_OUTCOME_WAIT_TIMEOUT", str(CLIENT_OUTCOME_WAIT_S))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for var in ("PFLSEG_DATA", "PFLSEG_STATE_DIR", "PFLSEG_SITE_CONFIG", "PFLSEG_BUNDLE_ROOTS", "NVFL_WORKSPACE"):
        env.pop(var, None)
    return env
