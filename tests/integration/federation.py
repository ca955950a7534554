"""A provisioned 3-site federation on loopback (separate processes, mutual TLS) for one test module, and
what its tests share. Each module gets its own federation (its own xdist group), so two modules' waits
(task timeouts, FLARE's dead-client detection) overlap instead of adding up."""

import json
import time

import yaml

from pflseg.data import make_synthetic
from pflseg.deploy.local import LocalFederation
from pflseg.deploy.provision import REPO_PROJECT, provision_loopback
from pflseg.flare.jobs import export_job

SITES = ["site-1", "site-2", "site-3"]
TINY = {"rounds": 2, "min_clients": 2, "task_timeout": 300, "data": {"size": 32},
        "net": {"channels": [4, 8, 16], "strides": [2, 2]}, "train": {"batch_size": 8, "epochs": 1}}


def federation(tmp_path_factory, intruder: bool = False, heart_beat_timeout: int | None = None):
    """Provision, start and yield a loopback federation (with ``intruder``: also a client of another project
    aiming at the same server, as ``federation.intruder``; with ``heart_beat_timeout``: the seconds without a
    heartbeat after which its server drops a site as dead, set in its project file as a deployment would, instead of
    the loopback kits' 60); stopped at the end."""
    ws = tmp_path_factory.mktemp("federation")
    data = make_synthetic(ws / "data", n_sites=3, cases=5, size=32, depth=6)
    project = REPO_PROJECT
    if heart_beat_timeout is not None:
        spec = yaml.safe_load(REPO_PROJECT.read_text())
        (builder,) = [b for b in spec["builders"] if b["path"].endswith("PflsegBuilder")]
        builder["args"] = {**(builder.get("args") or {}), "heart_beat_timeout": heart_beat_timeout}
        project = ws / "project.yml"
        project.write_text(yaml.safe_dump(spec, sort_keys=False))
    fed = LocalFederation(ws / "fed", project_yml=project, progress=say)
    fed.provision({"data": str(data), "device": "cpu"})
    fed.start()
    fed.intruder = None
    if intruder:  # its own root CA, the same name as a real site: wrong certificates
        client_cfg = json.loads((fed.kit("site-1") / "startup" / "fed_client.json").read_text())
        port = client_cfg["servers"][0]["service"]["target"]
        fed.intruder = LocalFederation(ws / "intruder", progress=say)
        provision_loopback(fed.intruder.workspace, REPO_PROJECT, port=int(port.split(":")[1]))
        fed.intruder.start_participant("site-1")
    try:
        fed.wait_connected(timeout=180)
        yield fed
    finally:
        if fed.intruder is not None:
            fed.intruder.kill("site-1")
        fed.stop(timeout=30)


def say(msg: str) -> None:
    """Progress of the federation and its jobs, timed: pytest shows it with a failing test's output (``-rP``: with
    every test's), where a slow step or a wait shows up."""
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def job(tmp_path, name, mode="package", **over):
    cfg = {**TINY, **over}
    return export_job(name, tmp_path / "jobs", overrides=cfg, mode=mode, job_name=f"{name}_{mode}")


def flare_settings(folder, **settings):
    """``settings`` (FLARE's configuration variables, e.g. ``dead_client_grace_period``) into the job ``folder``'s
    server app config, where FLARE's job process reads them; returns ``folder``."""
    path = folder / "app" / "config" / "config_fed_server.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}, indent=4))
    return folder


def check_per_site(res, sites, status=("FINISHED:COMPLETED",)):
    assert res["status"] in status and sorted(res["test"]) == sites
    for site in sites:
        assert 0.0 <= res["test"][site]["site"]["dice"] <= 1.0 and res["test"][site]["site"]["n_cases"] >= 1


def on_round(n, action):
    """A submit() progress callback that runs ``action(job_id)`` once, when the server logs round n done."""
    seen = {}

    def progress(msg):
        say(msg)
        if " as job " in msg:
            seen["job"] = msg.split(" as job ")[1].split()[0]
        if f"round {n} done" in msg and "done" not in seen:
            seen["done"] = time.time()
            action(seen["job"])

    progress.seen = seen
    return progress


def rounds_of(res, site):
    return [h["round"] for h in res["history"] if site in h.get("site_metrics", {})]
