"""The researchers' quick path: FLARE POC on this machine, loopback only, one job, stop.

``nvflare poc prepare`` (with the workspace's own HOME and NVFLARE_POC_WORKSPACE), then its kits are
bound to ``localhost`` on a free port, get pflseg's classes on their allow lists and keep their internal
listeners off that port (``pflseg.deploy.provision.internal_ports``), and the server gets the kits' fixed mmap
threshold (``server_malloc``); server and sites start
as separate processes like ``pflseg deploy local``; the job goes in through the FLARE API. Its provisioning state
(``cert.json``: every private key) is made private (``pflseg.deploy.provision.protect_ca_state``). Every POC site is
the researcher's own, so each site's policy allows a job of two sites (``two_sites``; a POC's default is 2).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from pflseg.deploy.local import LocalFederation
from pflseg.deploy.provision import free_port, keep_internal_off, loopback_env, protect_ca_state, server_malloc
from pflseg.flare.allowlist import add_to_resources
from pflseg.flare.state import private_dir


class PocFederation(LocalFederation):
    """A FLARE POC workspace (``nvflare poc prepare -n N``, or ``-c NAME ...`` with ``clients``) run as a
    LocalFederation."""

    admin = "admin@nvidia.com"

    def __init__(self, workspace: str | Path, n_sites: int = 2, progress=print, clients: list[str] | None = None):
        self.n_sites, self.clients = n_sites, clients
        super().__init__(workspace, progress=progress)

    def _kits(self) -> Path:
        return self.workspace / "poc" / "example_project" / "prod_00"

    def provision(self, site_config: dict | None = None) -> Path:
        """As ``LocalFederation.provision``; every site's policy allows two-site jobs (one researcher's sites)."""
        kits = super().provision({"policy": {"two_sites": True}, **(site_config or {})})
        self.progress("every POC site allows jobs of two sites (policy.two_sites: true): a POC's sites are all yours")
        return kits

    def _provision(self) -> None:
        private_dir(self.workspace / "home")
        env = {**loopback_env(self.workspace), "NVFLARE_POC_WORKSPACE": str(self.workspace / "poc")}
        sites = ["-c", *self.clients] if self.clients else ["-n", str(self.n_sites)]
        cmd = ["nvflare", "poc", "prepare", *sites, "--force"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not self.kits.is_dir():
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                               f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        for cert in (self.workspace / "poc").rglob("cert.json"):  # FLARE writes every private key into it, 0644
            protect_ca_state(cert.parent)
        shutil.copy(self.workspace / "poc" / "project.yml", self.workspace / "project.yml")
        port = free_port()
        server = self.server()
        server_malloc(self.kit(server) / "startup" / "sub_start.sh")
        _edit(self.kit(server) / "startup" / "fed_server.json",
              lambda c: [s.update(admin_port=port, service={**s["service"], "target": f"localhost:{port}"})
                         for s in c["servers"]])
        for site in self.sites():
            _edit(self.kit(site) / "startup" / "fed_client.json",
                  lambda c: [s["service"].update(target=f"localhost:{port}") for s in c["servers"]])
        for name in self.admins():
            _edit(self.kit(name) / "startup" / "fed_admin.json",
                  lambda c: c["admin"].update(host="localhost", port=port))
        for name in [server, *self.sites()]:  # POC writes resources.json too, and it wins over the .default
            for res in ("resources.json", "resources.json.default"):
                if (self.kit(name) / "local" / res).is_file():
                    add_to_resources(self.kit(name) / "local" / res)
            keep_internal_off(self.kit(name) / "local", port)


def _edit(path: Path, change) -> None:
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def run_poc(job: str | None = None, workspace: str | Path = "runs/poc", sites: int | None = None,
            site_names: list[str] | None = None, rounds: int = 2, data: str | Path | None = None,
            size: int | None = None, sets: list[str] | None = None, say=print) -> dict:
    """``pflseg poc``: prepare a POC federation in ``workspace`` (``data``'s sites under their FLARE names, else
    ``site_names`` or ``sites`` (default 2) sites making the job's synthetic data), start it, export ``job`` with
    ``sets``, ``data`` and ``size`` (``job_overrides``), ``rounds`` and ``min_clients`` unless ``sets`` name them,
    submit it through the FLARE API, ``say`` its per-site metrics, and stop the federation. ``job`` None: the
    registry's reference job (``pflseg.flare.methods.REFERENCE_JOB``).

    Returns:
        The job's results (``pflseg.deploy.submit.submit``).
    """
    from pflseg.deploy.data_sites import job_overrides, run_sites
    from pflseg.deploy.submit import metrics_table, submit
    from pflseg.flare.jobs import export_job
    from pflseg.flare.methods import REFERENCE_JOB

    job = job or REFERENCE_JOB
    ws = Path(workspace).resolve()
    overrides = job_overrides(sets or [], data, size)
    root, clients, n = run_sites(data, ws, sites, site_names, default=2, say=say)
    if not data:  # a researcher's POC on this machine: its sites make the job's synthetic data (a deployment refuses)
        overrides.setdefault("data", {}).setdefault("allow_synthetic", True)
    overrides.setdefault("rounds", rounds)
    overrides.setdefault("min_clients", min(n, 2))
    fed = PocFederation(ws, n_sites=n, progress=say, clients=clients)
    fed.provision({"data": str(root)} if root else None)
    try:
        fed.start()
        fed.wait_connected()
        results = submit(export_job(job, fed.workspace / "jobs", overrides=overrides), fed.admin_kit(),
                         out=fed.workspace / "results", progress=say)
        say(metrics_table(results))
    finally:
        fed.stop()
    return results
