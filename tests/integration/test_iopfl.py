"""IOP-FL in the real FLARE simulator on tiny data: training (thread count and resume invariant, P_k on the
sites' disks, routing bundle) and test-time routing at an outside site (predictions and metrics)."""

import pytest
import torch

from pflseg.data import make_synthetic
from pflseg.deploy.simulator import run_simulator
from pflseg.flare.jobs import export_job
from pflseg.flare.state import RoundStore, load_file
from tests.integration.test_simulator import TINY, assert_same_states, server_state, stop_after_round_1

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("iopfl")]  # one worker: shared module fixture


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("data") / "root", n_sites=3, cases=5, size=32, depth=6)


def run(name, ws, data, sites=2, threads=None, progress=lambda m: None, **over):
    job = export_job(name, ws / "jobs", overrides={**TINY, "min_clients": sites, **over})
    return run_simulator(job, ws, n_sites=sites, threads=threads, data=data, progress=progress)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    """Uninterrupted 2-round run with 2 threads (the reference of the comparison, and the routing bundle)."""
    ws = tmp_path_factory.mktemp("straight")
    return ws, run("iopfl", ws, data, threads=2, rounds=2)


def test_one_thread_resumed_equals_two_threads_uninterrupted(trained, tmp_path, data, monkeypatch):
    """-t 1 until a stop after round 1 (no final tasks run: with one thread each is a process per site), then
    resumed with -t 2: the same models, P_k and bundle as the uninterrupted -t 2 run."""
    ws, straight = trained
    assert sorted(straight["test"]) == ["site-1", "site-2"] and not straight["missing"]
    for h in straight["history"]:
        assert set(h["val_dice"]) == {"site-1", "site-2"}
    stop_after_round_1(lambda progress: run("iopfl", tmp_path, data, threads=1, rounds=2, progress=progress),
                       monkeypatch)
    resumed = run("iopfl", tmp_path, data, threads=2, rounds=2, resume=True)  # -t 1 before the stop, -t 2 after
    assert [h["round"] for h in resumed["history"]] == [1, 2]
    assert resumed["test"] == straight["test"]
    assert_same_states(server_state(ws, "iopfl"), server_state(tmp_path, "iopfl"))
    for site in straight["sites"]:  # P_k, Adam moments, the round's global model: on the site's disk
        a, b = RoundStore(ws / "state" / site / "iopfl"), RoundStore(tmp_path / "state" / site / "iopfl")
        state = a.load(a.latest())
        assert any(k.startswith("person.") for k in state) and a.latest() == 1
        assert_same_states(state, b.load(b.latest()))
        assert_same_states(load_file(a.root / "best.pt"), load_file(b.root / "best.pt"))
    bundle_a, bundle_b = load_file(straight["bundle"]), load_file(resumed["bundle"])
    assert bundle_a["sites"] == ["site-1", "site-2"]
    assert_same_states(bundle_a, bundle_b)
    # the published P_k is the site's best by validation, not the global model
    assert not torch.equal(bundle_a["person.site-1.model.0.conv.unit0.conv.weight"],
                           bundle_a["global.model.0.conv.unit0.conv.weight"])


def test_routing_at_an_outside_site_writes_predictions_and_metrics(trained, tmp_path, data):
    ws, _ = trained
    res = run("iopfl_route", tmp_path, data, sites=3,
              iopfl={"bundle": str(ws / "state" / "server" / "iopfl"), "epochs": 1})
    assert res["inside_sites"] == ["site-1", "site-2"] and res["targets"] == ["site-3"]
    out = res["route"]["site-3"]
    assert sorted(out["methods"]) == sorted(["global", "global_bn", "average", "average_bn", "ensemble", "ensemble_bn",
                                             "tent", "tent_epochs", "tent_average", "routing_global", "routing_layer",
                                             "routing", "routing_final"])
    prior = res["prior"]  # the size prior: the inside sites' training-label foreground fractions, from the bundle
    assert len(prior) == 1 and 0 < prior[0] < 1 and out["diagnostics"]["settings"]["size_prior"] > 0
    for m in out["methods"].values():
        assert 0.0 <= m["dice"] <= 1.0 and "per_case" not in m  # aggregate metrics only (privacy.per_case: false)
    assert out["predictions"] == "written at the site: iopfl_route/predictions"
    assert out["seconds_per_sample"] > 0
    preds = list((tmp_path / "state" / "site-3" / "iopfl_route" / "predictions").glob("*.nii.gz"))
    assert len(preds) == out["n_cases"] == 5

