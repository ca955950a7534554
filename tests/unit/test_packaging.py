"""The wheel is a usable pflseg on its own: it carries app_configs/ and the provisioning template as package data
(read with importlib.resources, found from any folder), its license, py.typed, and metadata setuptools builds."""

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_metadata_license_and_markers():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    floor = next(r for r in project["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(floor.split(">=")[1].split(".")[0]) >= 77  # 68 cannot build the SPDX license field
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "the pflseg authors" in text
    assert any(d.startswith("psutil") for d in project["project"]["dependencies"])
    declared = project["tool"]["setuptools"]["package-data"]["pflseg"]
    assert all((REPO / "custom" / "pflseg" / f).is_file() for f in declared)  # py.typed declared and present


def test_the_wheel_runs_its_configs_from_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    for name in ("custom", "app_configs", "provisioning"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md"):
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w",
                    str(tmp_path / "dist")], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("pflseg-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")
    shipped = {f"pflseg/_data/app_configs/{p.name}" for p in (REPO / "app_configs").glob("*.yaml")}
    assert shipped <= names and "pflseg/_data/provisioning/project.yml" in names and "pflseg/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    code = ("import pflseg, pflseg.config as c\nfrom pflseg.deploy.provision import REPO_PROJECT\n"
            "print(pflseg.__file__); print(c.configs_dir()); print(REPO_PROJECT); "
            "print(c.load_job_config('fedavg')['name'])")
    env = {k: v for k, v in os.environ.items() if k != "PFLSEG_CONFIGS"}
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True).stdout.split()
    site = tmp_path / "site" / "pflseg"
    assert out == [str(site / "__init__.py"), str(site / "_data" / "app_configs"),
                   str(site / "_data" / "provisioning" / "project.yml"), "fedavg"]


def test_built_wheels_and_build_folders_are_not_tracked():
    """`python -m build` writes dist/ (wheel, sdist) and build/: neither belongs in a commit."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    for path in ("dist/pflseg-0.1.0-py3-none-any.whl", "build/lib/pflseg/__init__.py"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
