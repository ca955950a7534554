"""Deployment pieces without processes: loopback project, job modes, GPU resource_spec, tables."""

import json

import pytest
import yaml

from pflseg.deploy.provision import REPO_PROJECT, loopback_project
from pflseg.deploy.submit import metrics_table
from pflseg.flare.jobs import export_job, gpu_resource_spec


def test_loopback_project_binds_localhost_and_keeps_its_storage(tmp_path):
    project = yaml.safe_load(REPO_PROJECT.read_text())
    lo = loopback_project(project, tmp_path, 12345)
    (server,) = [p for p in lo["participants"] if p["type"] == "server"]
    assert server["name"] == "localhost" and server["fed_learn_port"] == 12345
    (builder,) = [b for b in lo["builders"] if b["path"] == "pflseg.deploy.provision.PflsegBuilder"]
    assert builder["args"]["storage_root"] == str(tmp_path / "storage")
    assert builder["args"]["heart_beat_timeout"] == 60  # a dead site is dropped after 60 s (FLARE's default: 600)
    assert project["participants"][0]["name"] == "server1"  # the original is untouched
    roles = {p["name"]: p.get("role") for p in project["participants"] if p["type"] == "admin"}
    assert sorted(roles.values()) == ["lead", "member", "project_admin"]


def test_package_job_carries_no_code_and_byoc_carries_pflseg(tmp_path):
    pkg = export_job("fedavg", tmp_path)
    assert sorted(p.name for p in (pkg / "app").iterdir()) == ["config"]
    client = json.loads((pkg / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"] == {"path": "pflseg.flare.executor.SiteExecutor", "args": {}}
    byoc = export_job("fedavg", tmp_path, mode="byoc", job_name="fedavg_byoc")
    custom = byoc / "app" / "custom"
    assert (custom / "job_client.py").is_file() and (custom / "pflseg" / "flare" / "client.py").is_file()
    assert not list(custom.rglob("__pycache__"))
    assert json.loads((byoc / "meta.json").read_text())["name"] == "fedavg_byoc"
    with pytest.raises(ValueError, match="job mode 'docker'"):
        export_job("fedavg", tmp_path, mode="docker")


def test_gpu_resource_spec(tmp_path):
    assert gpu_resource_spec(4) == {"@default": {"num_of_gpus": 1}}
    assert gpu_resource_spec(3.5, ["site-1", "site-2"])["site-2"] == {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 3.5}
    with pytest.raises(ValueError, match="positive"):
        gpu_resource_spec(0)
    job = export_job("fedbn", tmp_path, gpu_mem_gib=2, sites=["site-1"])
    assert (json.loads((job / "meta.json").read_text())["resource_spec"]
            == {"site-1": {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 2}})


def test_metrics_table_names_sites_left_out():
    res = {"job": "fedbn", "method": "fedbn", "rounds": 3, "sites": ["site-1", "site-2"], "job_id": "abc",
           "history": [{"val_dice": {"site-1": 0.5}}], "missing": {"site-2": "no result"},
           "test": {"site-1": {"site": {"dice": 0.61}}}}
    table = metrics_table(res)
    assert "| site-1 | - | - | 0.6100 | 0.5000 |" in table and "| site-2 | - | - | - | - |" in table
    assert "left out: site-2: no result" in table


def _built_kits(tmp_path, **args):
    """PflsegBuilder run on the repo project's participants (stand-ins for FLARE's project and context), each
    kit's local/ holding what FLARE's StaticFileBuilder writes before it."""
    from types import SimpleNamespace

    from pflseg.deploy.provision import PflsegBuilder

    project = yaml.safe_load(REPO_PROJECT.read_text())
    people = [SimpleNamespace(**p) for p in project["participants"]]
    server = next(p for p in people if p.type == "server")
    clients = [p for p in people if p.type == "client"]
    for p in (server, *clients):
        local = tmp_path / p.name / "local"
        local.mkdir(parents=True)
        res = {"format_version": 2, "allow_log_streaming": True, "components": []}
        if p is server:
            res = {"format_version": 2, "snapshot_persistor": {"args": {"storage": {"args": {"root_dir": "/tmp"}}}},
                   "components": [{"id": "job_manager", "args": {"uri_root": "/tmp"}}]}
        (local / "resources.json.default").write_text(json.dumps(res))
        (tmp_path / p.name / "startup").mkdir()
        (tmp_path / p.name / "startup" / "sub_start.sh").write_text("#!/usr/bin/env bash\nexec python3 -m x\n")
    ctx = SimpleNamespace(get_local_dir=lambda p: str(tmp_path / p.name / "local"),
                          get_kit_dir=lambda p: str(tmp_path / p.name / "startup"),
                          get={"admin_port": 8003, "fed_learn_port": 8002}.get)
    PflsegBuilder(storage_root=str(tmp_path / "storage"), **args).build(
        SimpleNamespace(get_server=lambda: server, get_clients=lambda: clients), ctx)
    return project, server, clients


def _allowed(local, site_org, right, user):
    from nvflare.fuel.sec.authz import AuthzContext, Person
    from nvflare.security.security import FLAuthorizer

    policy = json.loads((local / "authorization.json.default").read_text())
    ok, _ = FLAuthorizer(site_org,
                         policy).authorize(AuthzContext(right=right, user=Person(*user), submitter=Person(*user)))
    return ok


def test_every_kit_gets_the_site_policy_no_byoc_no_shell_across_orgs(tmp_path):
    """Issue 23 item 1: FLARE's default policy (kept before) gave lead byoc "any" and project_admin shell
    commands at every site."""
    project, server, clients = _built_kits(tmp_path)
    admins = {p["name"]: (p["name"], p["org"], p["role"]) for p in project["participants"] if p["type"] == "admin"}
    lead, admin, viewer = admins["lead@hospital1.org"], admins["admin@pflseg.org"], admins["viewer@hospital2.org"]
    for p in (server, *clients):
        local = tmp_path / p.name / "local"
        for user in admins.values():
            assert not _allowed(local, p.org, "byoc", user), (p.name, user)  # no custom code from anyone
        own = {"shell": p.org == "hospital_1"}  # the lead's own organisation
        for cmd in ("ls", "cat", "grep", "tail"):
            assert _allowed(local, p.org, cmd, lead) == own["shell"], (p.name, cmd)
            assert _allowed(local, p.org, cmd, admin) == (p.org == "pflseg"), (p.name, cmd)
        assert _allowed(local, p.org, "submit_job", lead) and _allowed(local, p.org, "submit_job", admin)
        assert not _allowed(local, p.org, "submit_job", viewer)
        assert _allowed(local, p.org, "shutdown", admin)  # `pflseg deploy stop` still stops every site
    for c in clients:  # FLARE 2.9's kits stream site logs to the server: off at every site
        resources = json.loads((tmp_path / c.name / "local" / "resources.json.default").read_text())
        assert resources["allow_log_streaming"] is False


def test_byoc_can_be_granted_to_the_own_organisation_only(tmp_path):
    project, server, clients = _built_kits(tmp_path, byoc="o:site")
    lead = ("lead@hospital1.org", "hospital_1", "lead")
    assert [_allowed(tmp_path / c.name / "local", c.org, "byoc", lead) for c in clients] == [True, False, False]
    with pytest.raises(ValueError, match="byoc='yes'"):
        _built_kits(tmp_path / "x", byoc="yes")
