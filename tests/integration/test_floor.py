"""FLARE's floor job (pflseg.flare.floor) in the real FLARE simulator, the way `pflseg report speed` runs it beside a
job: the Client API kind (FLARE runs pflseg/flare/floor.py itself as the sites' script), 2 sites, 3 rounds."""

import json

import pytest

from pflseg.eval import speed

pytestmark = pytest.mark.slow


def test_the_floor_job_times_every_round_in_the_simulator(tmp_path):
    setting = {"kind": "client_api", "sites": 2, "rounds": 3, "parameters": 1000}
    run = speed.run_floor_sim(tmp_path, "tiny", setting, progress=lambda m: None)
    history = run["history"]
    assert [h["round"] for h in history] == [1, 2, 3]
    assert all(h["wall_seconds"] > 0 for h in history)
    assert all(h["site_compute_seconds"] == {"site-1": 0.0, "site-2": 0.0} for h in history)
    # the floor: the median wall of the measured rounds (round 1 also starts the sites' script)
    assert speed.floor_seconds(history) == pytest.approx((history[1]["wall_seconds"] + history[2]["wall_seconds"]) / 2)
    ws = tmp_path / "sim" / "tiny" / "floor"
    state = json.loads((ws / "state" / "server" / "tiny_floor" / "results.json").read_text())
    flare_run = json.loads(next((ws / "sim" / "server").rglob("results.json")).read_text())  # what a download holds
    state.pop("footprint")  # run_simulator's addition
    assert state == flare_run and state["parameters"] == 1000 and state["sites"] == ["site-1", "site-2"]
