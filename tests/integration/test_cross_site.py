"""Cross-site evaluation in the real FLARE simulator: a 1-round training run, then the cross_site job on its bundle."""

import json

import pytest

from pflseg.data import make_synthetic
from pflseg.deploy.simulator import run_simulator
from pflseg.flare.jobs import export_job

pytestmark = pytest.mark.slow
TINY = {"rounds": 1, "min_clients": 2, "data": {"size": 32}, "net": {"channels": [4, 8, 16], "strides": [2, 2]},
        "train": {"batch_size": 8, "epochs": 1}}


def test_the_matrix_of_a_fedbn_run_repeats_its_own_test_at_every_site(tmp_path):
    """FedBN keeps each site's model at the site (task own_model, published by the default policy): every cell
    is filled, and the global row and each site's own cell equal the training run's final test (one evaluation
    path, same data, same models)."""
    data = make_synthetic(tmp_path / "data", n_sites=2, cases=5, size=32, depth=6)
    sites = ["site-1", "site-2"]
    job = export_job("fedbn", tmp_path / "jobs", overrides=TINY)
    trained = run_simulator(job, tmp_path / "train", n_sites=2, data=data, progress=lambda m: None)
    bundle = tmp_path / "train" / "state" / "server" / "fedbn"
    # net and data: the trained run's replace this job's defaults (64 px, the default net)
    over = {"min_clients": 2, "cross_site": {"bundle": str(bundle)}}
    job = export_job("cross_site", tmp_path / "jobs", overrides=over)
    res = run_simulator(job, tmp_path / "xs", n_sites=2, data=data, progress=lambda m: None)
    matrix = json.loads((tmp_path / "xs" / "state" / "server" / "cross_site" / "cross_val_results.json").read_text())
    flare = tmp_path / "xs" / "sim" / "server" / "simulate_job" / "cross_site_val" / "cross_val_results.json"
    assert json.loads(flare.read_text()) == matrix == res["cross_site"]["matrix"] and not res["missing"]
    assert res["cross_site"]["models"] == ["global", *sites]
    assert sorted(matrix) == sites and all(sorted(row) == sorted(["global", *sites]) for row in matrix.values())
    for site in sites:
        test = trained["test"][site]
        assert abs(matrix[site]["global"]["dice"] - test["global"]["dice"]) < 1e-6
        assert abs(matrix[site][site]["dice"] - test["site"]["dice"]) < 1e-6
        assert matrix[site][site]["n_cases"] == test["site"]["n_cases"] and "per_case" not in matrix[site][site]
    md = (tmp_path / "xs" / "state" / "server" / "cross_site" / "cross_val_results.md").read_text()
    assert "| site \\ model | global | site-1 | site-2 |" in md
