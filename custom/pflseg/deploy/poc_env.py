"""FLARE's PocEnv for pflseg's recipes: ``recipe.execute(pflseg_poc_env("runs/poc_env"))``.

FLARE's PocEnv does not attach to a running POC. On every ``execute`` it finds its POC workspace
(``$NVFLARE_POC_WORKSPACE``, else ``poc_workspace.path`` in ~/.nvflare/config.conf, else /tmp/nvflare/poc), stops a
POC running there and deletes it, provisions a new one, starts server and sites as processes, and submits the job
through the FLARE API as the project admin. Its default project (FLARE's) gives the sites FLARE's class allow list
only, so a pflseg job (package mode) would be refused. ``pflseg_poc_env`` hands PocEnv pflseg's own project instead
(``provisioning/project.yml``: ``PflsegBuilder`` puts pflseg's classes on every allow list and writes pflseg's
authorization policy), made for this machine as ``pflseg deploy local`` makes it: server ``localhost`` on a free port,
job storage inside the workspace, the given sites. Every POC site is the researcher's own: each site's policy allows
a job of two sites (``two_sites``), as ``pflseg poc`` writes it; the job must allow synthetic data
(``data.allow_synthetic: true``) when the sites have none configured.

To submit to a federation that is already running (``pflseg deploy local``, another provisioned one), use
FLARE's ProdEnv with its admin startup kit instead (``python job.py JOB --env prod --startup-kit KIT``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from nvflare.recipe.poc_env import PocEnv

from pflseg.deploy.data_sites import project_with_sites
from pflseg.deploy.provision import REPO_PROJECT, free_port, loopback_project
from pflseg.flare.state import private_dir, write_text


def pflseg_poc_env(workspace: str | Path, n_sites: int = 2, clients: list[str] | None = None,
                   project_yml: str | Path = REPO_PROJECT, two_sites: bool = True) -> PocEnv:
    """A PocEnv that provisions pflseg's project on loopback in ``<workspace>/poc``.

    Sets, in this process's environment (PocEnv's processes inherit it): ``NVFLARE_POC_WORKSPACE`` =
    ``<workspace>/poc`` and ``PFLSEG_SITE_CONFIG`` = ``<workspace>/poc_site.json``, the POC sites' settings (a policy
    that allows two-site jobs when ``two_sites``; torch threads sharing this machine's cores).

    Args:
        workspace: folder of the POC's project file, workspace and job storage.
        n_sites: sites ``site-1`` .. ``site-N`` (unless ``clients`` names them).
        clients: the sites' FLARE names.
        project_yml: the project to provision (pflseg's by default; it must list ``PflsegBuilder``).
        two_sites: every site allows a training job of exactly two sites (one researcher's sites).
    """
    ws = Path(workspace).resolve()
    sites = list(clients) if clients else [f"site-{i + 1}" for i in range(n_sites)]
    project = yaml.safe_load(Path(project_yml).read_text())
    if not any(str(b.get("path", "")).endswith("PflsegBuilder") for b in project.get("builders", [])):
        raise ValueError(f"{project_yml}: no pflseg.deploy.provision.PflsegBuilder among its builders: its sites would "
                         "allow none of pflseg's classes")
    project = project_with_sites(loopback_project(project, ws, free_port()), sites)
    private_dir(ws)
    path = ws / "poc_project.yml"  # outside the POC workspace, which PocEnv deletes and makes anew
    path.write_text(yaml.safe_dump(project, sort_keys=False))
    settings = {"threads": max(1, (os.cpu_count() or 1) // len(sites)), "policy": {"two_sites": bool(two_sites)}}
    write_text(ws / "poc_site.json", json.dumps(settings, indent=1))
    os.environ["NVFLARE_POC_WORKSPACE"] = str(ws / "poc")
    os.environ["PFLSEG_SITE_CONFIG"] = str(ws / "poc_site.json")
    admin = next(p["name"] for p in project["participants"] if p["type"] == "admin" and p.get("role") ==
                 "project_admin")
    return PocEnv(project_conf_path=str(path), username=admin)
