"""FLARE's PocEnv for pflseg's recipes: pflseg's project on loopback (PflsegBuilder: pflseg's allow list and policy),
the given sites, one researcher's sites allowing two-site jobs; nothing started here."""

import json
import os

import pytest
import yaml

from pflseg.deploy.poc_env import pflseg_poc_env


def _restored(monkeypatch):
    """pflseg_poc_env sets these in this process: monkeypatch puts back what was there (setenv records it)."""
    for name in ("NVFLARE_POC_WORKSPACE", "PFLSEG_SITE_CONFIG"):
        monkeypatch.setenv(name, "")


def test_pocenv_provisions_pflsegs_project_on_loopback(tmp_path, monkeypatch):
    _restored(monkeypatch)
    env = pflseg_poc_env(tmp_path / "ws", clients=["a", "b"])
    assert env.poc_workspace == os.environ["NVFLARE_POC_WORKSPACE"] == str(tmp_path / "ws" / "poc")
    project = yaml.safe_load((tmp_path / "ws" / "poc_project.yml").read_text())
    assert env.project_conf_path == str(tmp_path / "ws" / "poc_project.yml") and env.username == "admin@pflseg.org"
    participants = {p["name"]: p for p in project["participants"]}
    assert [n for n, p in participants.items() if p["type"] == "client"] == ["a", "b"]
    assert participants["localhost"]["type"] == "server"  # loopback only, on a free port
    builder = next(b for b in project["builders"] if b["path"].endswith("PflsegBuilder"))
    assert builder["args"]["storage_root"] == str(tmp_path / "ws" / "storage")
    settings = json.loads((tmp_path / "ws" / "poc_site.json").read_text())
    assert os.environ["PFLSEG_SITE_CONFIG"] == str(tmp_path / "ws" / "poc_site.json")
    assert settings["policy"] == {"two_sites": True}


def test_a_project_without_pflsegs_builder_is_refused(tmp_path, monkeypatch):
    _restored(monkeypatch)
    bare = tmp_path / "project.yml"
    bare.write_text(yaml.safe_dump({"api_version": 3, "name": "p", "participants": [], "builders": []}))
    with pytest.raises(ValueError, match="no pflseg.deploy.provision.PflsegBuilder"):
        pflseg_poc_env(tmp_path / "ws", project_yml=bare)
