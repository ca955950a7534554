"""Issue 39 F3 in the real FLARE simulator: a site's failures carry no patient-like file name to the server.

Three sites, one round: site-3's data holds a corrupt image named like a patient (its data check refuses it: a data
problem), and site-2's training opens a missing file named like a patient (a FileNotFoundError from Python itself,
injected into the simulator's site processes by a ``sitecustomize`` this test writes; the error path is the real
one). Everything on the server's side (FLARE's server workspace with its log, pflseg's server state with
results.json, i.e. what an admin downloads) is searched byte for byte, and so is the rest of the run (the sites' FLARE
logs, which FLARE can stream); only the sites' local error logs keep the detail."""

import json
import os
from pathlib import Path

import pytest

from pflseg.data import make_synthetic
from pflseg.deploy.simulator import run_simulator
from pflseg.flare.jobs import export_job

pytestmark = [pytest.mark.slow, pytest.mark.extended]
NAME = "Smith_John_MRN4711_1960-01-01"
SECRETS = (b"Smith", b"MRN4711")
TINY = {"rounds": 1, "min_clients": 1, "data": {"size": 32}, "net": {"channels": [4, 8], "strides": [2]},
        "train": {"batch_size": 8}}

#: site-2's training opens a file that is not there, named like a patient (only in the site processes of this test)
SITECUSTOMIZE = f'''
import importlib.abc, importlib.util, os, sys

LEAKY = os.environ.get("PFLSEG_TEST_LEAKY_SITE")


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pflseg.flare.sites.base":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.Site.train

            def train(self, msg):
                if self.name == LEAKY:
                    open("/data/hospital/{NAME}.png", "rb")
                return real(self, msg)

            module.Site.train = train

        spec.loader.exec_module = exec_module
        return spec


if LEAKY:
    sys.meta_path.insert(0, _AfterImport())
'''


def corrupt_with_a_patient_name(root: Path, site: str) -> None:
    dl_path = root / site / "datalist.json"
    dl = json.loads(dl_path.read_text())
    entry = dl["training"][0]
    bad = (root / site / entry["image"]).with_name(f"{NAME}.nii.gz")
    bad.write_bytes(b"not a nifti of " + NAME.encode())
    entry["image"] = str(bad.relative_to(root / site))
    dl_path.write_text(json.dumps(dl))


def files_holding(folder: Path, secrets) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and any(s in p.read_bytes() for s in secrets)]


def test_no_patient_file_name_reaches_the_server(tmp_path, monkeypatch):
    data = make_synthetic(tmp_path / "data", n_sites=3, cases=4, size=32, depth=4)
    corrupt_with_a_patient_name(data, "site-3")
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PFLSEG_TEST_LEAKY_SITE", "site-2")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH")) if p))
    job = export_job("fedavg", tmp_path / "jobs", overrides=TINY)
    ws = tmp_path / "ws"
    res = run_simulator(job, ws, n_sites=3, data=data, progress=lambda m: None)
    missing = res["missing"]
    assert "FileNotFoundError (ENOENT) [file-" in missing["site-2"], missing  # the code and a pseudonym
    assert "data problem(s)" in missing["site-3"] and "[file-" in missing["site-3"], missing
    assert "site-1" in res["test"]  # the honest site trained and tested
    server_side = [ws / "sim" / "server", ws / "state" / "server"]
    assert (ws / "state" / "server" / "fedavg" / "results.json").is_file()
    assert any((ws / "sim" / "server").rglob("log.txt"))
    leaked = [f for folder in server_side for f in files_holding(folder, SECRETS)]
    assert not leaked, leaked
    # nor anything else of the run but the sites' local error logs (the sites' FLARE logs, the simulator's output)
    local = {str(ws / "state" / site / "site_errors.log") for site in ("site-1", "site-2", "site-3")}
    assert not set(files_holding(ws, SECRETS)) - local, set(files_holding(ws, SECRETS)) - local
    for site in ("site-2", "site-3"):  # the operator's detail, with the file's name, stays at the site
        assert NAME.encode() in (ws / "state" / site / "site_errors.log").read_bytes()
