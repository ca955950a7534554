"""Ditto in the real FLARE simulator on tiny data (2 sites, 2 rounds, 32 px): it completes with both models scored at
every site, and a run stopped after round 1 (-t 1) and resumed (-t 2) ends with the models of an uninterrupted -t 2
run, bit for bit (server checkpoint and every site's state, v_k included)."""

import pytest

from pflseg.data import make_synthetic
from pflseg.flare.state import RoundStore
from tests.integration.test_simulator import assert_same_states, run, server_state, stop_after_round_1

pytestmark = pytest.mark.slow


def test_ditto_reports_both_models_and_resumes_exactly(tmp_path, monkeypatch):
    data = make_synthetic(tmp_path / "data", n_sites=2, cases=5, size=32, depth=6)
    straight = run("ditto", tmp_path / "straight", data, sites=2, threads=2, rounds=2)
    sites = ["site-1", "site-2"]
    assert straight["sites"] == sites and not straight["missing"]
    assert [h["round"] for h in straight["history"]] == [1, 2]
    for h in straight["history"]:  # the personalized model scored every round beside the received global one
        assert all(0.0 <= h["site_metrics"][s]["val_dice_person"] <= 1.0 for s in sites)
    for s in sites:
        test = straight["test"][s]
        assert 0.0 <= test["global"]["dice"] <= 1.0 and 0.0 <= test["site"]["dice"] <= 1.0
        assert test["site"]["selected_round"] in (1, 2)  # a v_k, never the initial model
    stop_after_round_1(lambda progress: run("ditto", tmp_path / "resumed", data, sites=2, threads=1, rounds=2,
                                            progress=progress), monkeypatch)
    resumed = run("ditto", tmp_path / "resumed", data, sites=2, threads=2, rounds=2, resume=True)
    assert [h["round"] for h in resumed["history"]] == [1, 2]
    assert resumed["test"] == straight["test"]
    assert_same_states(server_state(tmp_path / "straight", "ditto"), server_state(tmp_path / "resumed", "ditto"))
    for s in sites:
        a = RoundStore(tmp_path / "straight" / "state" / s / "ditto")
        b = RoundStore(tmp_path / "resumed" / "state" / s / "ditto")
        assert a.latest() == b.latest() == 1 and any(k.startswith("person.") for k in a.load(1))
        assert_same_states(a.load(1), b.load(1))
