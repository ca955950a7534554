"""Deployment pieces without processes: loopback project, job modes, GPU resource_spec, tables."""

import json
from pathlib import Path

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
    assert json.loads((job / "meta.json").read_text())["resource_spec"] == {"site-1": {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 2}}


def test_metrics_table_names_sites_left_out():
    res = {"job": "fedbn", "method": "fedbn", "rounds": 3, "sites": ["site-1", "site-2"], "job_id": "abc",
           "history": [{"val_dice": {"site-1": 0.5}}], "missing": {"site-2": "no result"},
           "test": {"site-1": {"site": {"dice": 0.61}}}}
    table = metrics_table(res)
    assert "| site-1 | - | 0.6100 | 0.5000 |" in table and "| site-2 | - | - | - |" in table
    assert "left out: site-2: no result" in table
