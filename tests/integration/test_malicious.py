"""One site that lies, in the real FLARE simulator (issue 23 item 2): every float it sends is 1e30, its n_k 1e6,
its validation Dice 1.0 (injected by tests/integration/evil/sitecustomize.py). The job must finish with finite
results and that site named in "missing"."""

import math
import os
from pathlib import Path

import pytest

from pflseg.data import make_synthetic
from pflseg.deploy.simulator import run_simulator
from pflseg.flare.jobs import export_job

pytestmark = pytest.mark.slow
EVIL = Path(__file__).resolve().parent / "evil"
TINY = {"rounds": 2, "min_clients": 2, "data": {"size": 32}, "net": {"channels": [4, 8], "strides": [2]},
        "train": {"batch_size": 8}}


def numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers(v)
    elif isinstance(obj, float):
        yield obj


def test_a_1e30_site_with_n_k_1e6_is_left_out_and_the_job_finishes(tmp_path, monkeypatch):
    data = make_synthetic(tmp_path / "data", n_sites=3, cases=4, size=32, depth=4)
    monkeypatch.setenv("PFLSEG_TEST_EVIL_SITE", "site-3")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(EVIL), os.environ.get("PYTHONPATH")) if p))
    job = export_job("fedavg", tmp_path / "jobs", overrides=TINY)
    res = run_simulator(job, tmp_path / "ws", n_sites=3, data=data, progress=lambda m: None)
    assert set(res["missing"]) == {"site-3"} and "update norm" in res["missing"]["site-3"]
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(set(h["val_dice"]) == {"site-1", "site-2"} for h in res["history"])  # left out of every round
    assert 0.0 <= res["history"][-1]["val_dice_mean"] < 1.0  # its Dice 1.0 counted nowhere
    for site in ("site-1", "site-2", "site-3"):  # every site tests the (honest) best global model
        assert 0.0 <= res["test"][site]["global"]["dice"] <= 1.0
    assert all(math.isfinite(x) for x in numbers(res["test"])) and "aggregates_rejected" not in res
