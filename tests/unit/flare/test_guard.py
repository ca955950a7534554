"""One lying site against the server (pflseg.flare.guard wired in the controllers), with stubbed sends."""

import math
from types import SimpleNamespace

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import ConfigError, load_job_config
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.guard import result_notes
from pflseg.flare.state import prefixed, unprefixed
from tests.unit.flare.controllers.conftest import BATCH, Stub, make, models_of, scaled

N = {"site-1": 10, "site-2": 120, "site-3": 60}  # 12:1 between honest sites, as on the synthetic data
MEAN = {"median_rounds": 0}  # round 1 by the weighted mean, as in every later round (the default 1 is the median)
STEP = {"site-1": 1.0, "site-2": 2.0, "site-3": 3.0}  # honest updates: the global model scaled by 1 + 0.01 * STEP


def key_of(state: dict) -> str:
    return next(k for k, v in state.items() if v.is_floating_point() and v.abs().sum() > 0)


def honest(site, data, dice=0.5):
    state = unprefixed("global", data.params)
    return FLModel(params=prefixed("global", scaled(state, 1 + 0.01 * STEP[site])), metrics={"val_dice": dice},
                   meta={"NUM_STEPS_CURRENT_ROUND": N[site]})


def evil(data):
    """Every float 1e30, n_k 1e6, validation Dice 1.0: the issue's attack."""
    state = {k: (torch.full_like(v, 1e30) if v.is_floating_point() else v) for k,
             v in unprefixed("global", data.params).items()}
    return FLModel(params=prefixed("global", state), metrics={"val_dice": 1.0},
                   meta={"NUM_STEPS_CURRENT_ROUND": 1_000_000})


def test_honest_sites_12_to_1_are_neither_capped_nor_left_out(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust=MEAN)
    g0 = dict(ctrl.state.global_state)
    Stub(ctrl, honest)
    out = ctrl.round(0)
    assert not ctrl.missing and not any("n_k_capped" in m for m in out.site_metrics.values())
    assert ctrl.state.n_first == N
    key = key_of(g0)
    expected = g0[key] * sum(N[s] * (1 + 0.01 * STEP[s]) for s in N) / sum(N.values())
    assert torch.allclose(ctrl.state.global_state[key], expected, atol=1e-6)


def test_a_1e30_site_with_n_k_1e6_is_left_out_and_cannot_pick_the_best_round(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust=MEAN)
    g0 = dict(ctrl.state.global_state)
    Stub(ctrl, lambda site, data: evil(data) if site == "site-3" else honest(site, data))
    out = ctrl.round(0)
    assert list(ctrl.missing) == ["site-3"] and "update norm" in ctrl.missing["site-3"]
    key = key_of(g0)
    # the honest sites' mean; with site-3 out, site-2's n_k 120 is capped at 6 x site-1's (robust.n_k_ratio)
    expected = g0[key] * (10 * 1.01 + 60 * 1.02) / 70
    assert torch.allclose(ctrl.state.global_state[key], expected, atol=1e-6)
    assert all(torch.isfinite(v).all() for v in ctrl.state.global_state.values() if v.is_floating_point())
    assert ctrl.state.best["score"] == pytest.approx(0.5) and "site-3" not in out.metrics["val_dice"]


def test_a_plausible_update_with_n_k_1e6_is_capped_to_6x_the_others_median(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust=MEAN)
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):
        res = honest(site, data, dice=1.0 if site == "site-3" else 0.2)
        if site == "site-3":
            res.meta["NUM_STEPS_CURRENT_ROUND"] = 1_000_000
        return res

    stub = Stub(ctrl, reply)
    out = ctrl.round(0)
    cap = 6 * (10 + 120) // 2  # robust.n_k_ratio x the median of the other sites' n_k
    assert not ctrl.missing and ctrl.state.n_first["site-3"] == cap
    assert out.site_metrics["site-3"]["n_k_claimed"] == 1_000_000 and out.site_metrics["site-3"]["n_k_capped"] == cap
    key = key_of(g0)
    expected = g0[key] * (10 * 1.01 + 120 * 1.02 + cap * 1.03) / (10 + 120 + cap)
    assert torch.allclose(ctrl.state.global_state[key], expected, atol=1e-6)
    assert ctrl.state.best["score"] == pytest.approx((0.2 * 10 + 0.2 * 120 + 1.0 * cap) / (130 + cap))  # bounded weight
    # as run_rounds keeps (and checkpoints) it
    ctrl.state.history.append({"round": 1, "site_metrics": out.site_metrics})
    assert result_notes(ctrl)["n_k_capped"]["site-3"] == "n_k 1000000 capped to 390 (round 1)"
    stub.reply = reply
    ctrl.round(1)  # the same n_k again: above its first accepted (capped) value, so it is left out
    assert "exceeds its first accepted value 390" in ctrl.missing["site-3"]


def test_median_aggregation_and_selection_ignore_one_site(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust={"aggregation": "median"})
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):  # site-3: an update 50x the others' (inside the norm bound), Dice 1.0, huge n_k
        if site != "site-3":
            return honest(site, data, dice=0.3 if site == "site-1" else 0.4)
        state = unprefixed("global", data.params)
        return FLModel(params=prefixed("global", scaled(state, 1 + 0.01 * 50)), metrics={"val_dice": 1.0},
                       meta={"NUM_STEPS_CURRENT_ROUND": 1_000_000})

    Stub(ctrl, reply)
    ctrl.round(0)
    assert not ctrl.missing
    key = key_of(g0)
    assert torch.allclose(ctrl.state.global_state[key], g0[key] * 1.02, atol=1e-6)  # the coordinate median: site-2's
    assert ctrl.state.best["score"] == pytest.approx(0.4)  # the median of 0.3, 0.4, 1.0


def test_the_first_median_rounds_aggregate_by_the_median_the_later_ones_by_the_mean(tmp_path, monkeypatch):
    """robust.median_rounds 1: round 1 (r = 0) is the coordinate-wise median whatever the weights, round 2 the
    n_k-weighted mean again, exactly FedAvg's."""
    from pflseg.algorithms.fedavg import weighted_average

    ctrl = make("fedavg", tmp_path, monkeypatch, robust={"median_rounds": 1})
    Stub(ctrl, honest)
    g0 = dict(ctrl.state.global_state)
    ctrl.round(0)
    key = key_of(g0)
    assert torch.allclose(ctrl.state.global_state[key], g0[key] * 1.02, atol=1e-6)  # site-2's, the middle one
    g1 = dict(ctrl.state.global_state)
    ctrl.round(1)
    answers = [scaled(g1, 1 + 0.01 * STEP[s]) for s in N]
    mean = weighted_average(answers, list(N.values()))
    assert all(torch.equal(ctrl.state.global_state[k], mean[k]) for k in ctrl.shared_keys())


def test_trimmed_mean_drops_the_extremes_of_five_sites(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust={"aggregation": "trimmed_mean", "trim": 0.2})
    ctrl.sites = [f"site-{i}" for i in range(1, 6)]
    g0 = dict(ctrl.state.global_state)
    factor = {"site-1": 1.01, "site-2": 1.02, "site-3": 1.03, "site-4": 1.04, "site-5": 1.5}
    Stub(ctrl, lambda site,
         data: FLModel(params=prefixed("global", scaled(unprefixed("global", data.params), factor[site])),
                                          metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    key = key_of(g0)
    v = g0[key]  # per coordinate the lowest and the highest of the five are dropped (by value, sign-aware)
    stacked = torch.stack([v * f for f in factor.values()]).sort(dim=0).values[1:4]
    assert torch.allclose(ctrl.state.global_state[key], stacked.mean(dim=0), atol=1e-6)


def test_grace_update_1000x_is_left_out_and_the_weights_are_the_others(tmp_path, monkeypatch):
    ctrl = make("grace", tmp_path, monkeypatch)
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):
        state = unprefixed("global", data.params)
        step = 1000.0 if site == "site-3" else STEP[site]
        return FLModel(params=prefixed("global", scaled(state, 1 + 0.01 * step)), metrics={"val_dice": 0.5},
                       meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    out = ctrl.round(0)
    assert list(ctrl.missing) == ["site-3"] and "norm" in ctrl.missing["site-3"]
    assert sorted(out.metrics["grace_weights"]) == ["site-1", "site-2"]
    key = key_of(g0)
    assert ctrl.state.global_state[key].abs().max() <= g0[key].abs().max() * 1.03


def fedsm_reply(ctrl, negative_site=None):
    def reply(site, data):
        params = models_of(data)
        params.update(prefixed("select", unprefixed("select", data.params)))
        for k, v in ctrl.moment_ref.items():
            name = k.split(".")[-1]
            params[k] = torch.full_like(v, 2.0 if name == "step" else 0.1)
            if name == "exp_avg_sq" and site == negative_site:
                params[k] = torch.full_like(v, -1.0)
        return FLModel(params=params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 4})
    return reply


def test_fedsm_negative_exp_avg_sq_is_left_out_and_the_moments_stay_usable(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    Stub(ctrl, fedsm_reply(ctrl, negative_site="site-2"))
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-2"] and "negative" in ctrl.missing["site-2"]
    assert all((v >= 0).all() for k, v in ctrl.state.moments.items() if k.endswith("exp_avg_sq"))


def test_fedsm_step_beyond_what_the_round_can_take_is_left_out(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    good = fedsm_reply(ctrl)

    def reply(site, data):
        res = good(site, data)
        if site == "site-1":
            res.params.update({k: torch.full_like(v, -1e6) for k, v in res.params.items() if k.endswith(".step")})
        return res

    Stub(ctrl, reply)
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-1"] and "step" in ctrl.missing["site-1"]
    assert all(float(v) == 2.0 for k, v in ctrl.state.moments.items() if k.endswith(".step"))


def test_fedsm_median_aggregates_global_selector_and_moments(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH, robust={"aggregation": "median"})
    base = fedsm_reply(ctrl)
    value = {"site-1": 0.1, "site-2": 0.2, "site-3": 2.0}  # within Adam's bound 7.27 x sqrt(0.1) = 2.3

    def reply(site, data):
        res = base(site, data)
        res.params.update({k: torch.full_like(v, value[site]) for k, v in res.params.items() if k.endswith(".exp_avg")})
        return res

    Stub(ctrl, reply)
    ctrl.round(0)
    assert all(torch.allclose(v, torch.full_like(v, 0.2))
               for k, v in ctrl.state.moments.items() if k.endswith(".exp_avg"))


def test_lcfed_median_of_the_shared_part(tmp_path, monkeypatch):
    from pflseg.nets import build_net
    from pflseg.nets.lcfed import shared_keys

    ctrl = make("fedrep", tmp_path, monkeypatch, robust={"aggregation": "median"})
    g0 = dict(ctrl.state.global_state)
    factor = {"site-1": 1.01, "site-2": 1.02, "site-3": 1.5}
    keys = shared_keys(build_net(ctrl.cfg["net"]))
    Stub(ctrl, lambda site, data: FLModel(
        params=prefixed("global", scaled({k: unprefixed("global", data.params)[k] for k in keys}, factor[site])),
        metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    key = next(k for k in keys if g0[k].is_floating_point() and g0[k].abs().sum() > 0)
    assert not ctrl.missing
    assert torch.allclose(ctrl.state.global_state[key], g0[key] * 1.02, atol=1e-6)


def test_a_non_finite_aggregate_keeps_the_previous_global_model(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    g0 = dict(ctrl.state.global_state)
    key = key_of(g0)
    Stub(ctrl, honest)
    errors = []
    ctrl.error = errors.append
    ctrl.setup = lambda: 0
    ctrl.finish = lambda: None
    ctrl.abort_signal = SimpleNamespace(triggered=False)

    mean = FedAvgController.aggregate

    def broken(self, results, state, r):  # an aggregate that overflows (forced)
        new, metrics = mean(self, results, state, r)
        return {**new, key: torch.full_like(g0[key], math.inf)}, metrics

    monkeypatch.setattr(type(ctrl), "aggregate", broken)
    ctrl.run_rounds()
    assert all(torch.equal(ctrl.state.global_state[k], g0[k]) for k in g0)
    assert all("not used" in h["aggregate_rejected"] and f"'global_state.{key}'" in h["aggregate_rejected"]
               for h in ctrl.state.history)
    assert any("kept its previous model" in e for e in errors)
    assert set(result_notes(ctrl)["aggregates_rejected"]) == {"1", "2"}  # rounds count from 1
    saved = ctrl.store.load(1)
    assert torch.equal(unprefixed("global", saved)[key], g0[key])  # the checkpoint holds the kept model


def test_a_site_refuses_a_non_finite_received_model_naming_the_key(tmp_path):
    from pflseg.flare.client import answer
    from pflseg.flare.outbox import Outgoing
    from pflseg.flare.privacy import Pseudonyms

    trained = []
    site = SimpleNamespace(tasks=lambda: {"train": lambda msg: trained.append(msg) or Outgoing(params={}, metrics={})},
                           store=SimpleNamespace(root=tmp_path / "state" / "job"), cfg=load_job_config("fedavg"),
                           sites=["site-1", "site-2", "site-3"], pseudonyms=Pseudonyms(tmp_path / "state"), job_id=None)
    msg = FLModel(params={"global.conv.weight": torch.tensor([1.0, math.nan])}, meta={})
    out, kept = answer("site-1", "train", msg, site)
    assert not trained and kept is site
    assert "refusing the model" in out.meta["pflseg_error"] and "'global.conv.weight'" in out.meta["pflseg_error"]
    out, _ = answer("site-1", "train", FLModel(params={"global.w": torch.tensor([1e30])}, meta={}), site)
    assert "magnitude" in out.meta["pflseg_error"] and not trained
    out, _ = answer("site-1", "train", FLModel(params={"global.w": torch.tensor([1.0])}, meta={}), site)
    assert "pflseg_error" not in out.meta and len(trained) == 1


@pytest.mark.parametrize("robust, match", [({"aggregation": "mode"}, "robust.aggregation"),
                                           ({"trim": 0.5}, "robust.trim"),
                                           ({"n_k_ratio": 0.5}, "robust.n_k_ratio"),
                                           ({"norm_ratio": -1.0}, "robust.norm_ratio"),
                                           ({"clip": 0.5}, "robust.clip"),
                                           ({"median_rounds": -1}, "robust.median_rounds"),
                                           ({"median_rounds": 1.5}, "robust.median_rounds")])
def test_robust_config_is_checked(robust, match):
    with pytest.raises(ConfigError, match=match):
        load_job_config("fedavg", overrides={"robust": robust})


def test_an_update_10x_the_others_is_clipped_to_robust_clip_and_named(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, robust=MEAN)
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):  # site-3: 10 x its honest step, far inside the norm bound (100)
        state = unprefixed("global", data.params)
        step = 10.0 if site == "site-3" else STEP[site]
        return FLModel(params=prefixed("global", scaled(state, 1 + 0.01 * step)), metrics={"val_dice": 0.5},
                       meta={"NUM_STEPS_CURRENT_ROUND": N[site]})

    Stub(ctrl, reply)
    out = ctrl.round(0)
    assert not ctrl.missing
    ratio = 10 / 1.5  # its update over the median of the others' (steps 1 and 2)
    assert out.site_metrics["site-3"]["update_clipped"] == pytest.approx(ratio, abs=1e-3)
    assert out.site_metrics["site-1"]["update_ratio"] == pytest.approx(1 / 6, abs=1e-3)
    assert "update_clipped" not in out.site_metrics["site-1"]
    key = key_of(g0)  # site-3's update now 3 x 1.5 = 4.5 steps: the same direction, that norm
    expected = g0[key] * (10 * 1.01 + 120 * 1.02 + 60 * 1.045) / 190
    assert torch.allclose(ctrl.state.global_state[key], expected, atol=1e-6)
    ctrl.state.history.append({"round": 1, "site_metrics": out.site_metrics})
    assert result_notes(ctrl)["updates_clipped"] == {"site-3": "1 round(s), the latest 1 from 6.6667 x the others' "
                                                                 "median to 3 x"}


def test_an_honest_round_is_fedavg_bit_for_bit(tmp_path, monkeypatch):
    from pflseg.algorithms.fedavg import weighted_average

    ctrl = make("fedavg", tmp_path, monkeypatch, robust=MEAN)
    g0 = dict(ctrl.state.global_state)
    Stub(ctrl, honest)
    ctrl.round(0)
    states = [scaled(g0, 1 + 0.01 * STEP[s]) for s in N]
    plain = weighted_average(states, list(N.values()))
    assert all(torch.equal(ctrl.state.global_state[k], plain[k]) for k in plain)


def test_n_k_is_capped_against_the_others_first_accepted_n_k(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    ctrl.state.n_first = {"site-1": 10, "site-2": 120}  # the server's table from earlier rounds
    Stub(ctrl, lambda site, data: honest(site, data) if site != "site-3" else
         FLModel(params=honest(site, data).params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 5000}))
    out = ctrl.round(0)
    assert out.site_metrics["site-3"]["n_k_capped"] == 6 * 65 and ctrl.state.n_first["site-3"] == 390


def test_fedsm_lda_statistics_for_another_sites_class_are_refused_naming_the_site(tmp_path, monkeypatch):
    from tests.unit.flare.controllers.conftest import lda_answer

    ctrl = make("fedsm", tmp_path, monkeypatch)

    def reply(site, data):
        res = lda_answer(ctrl, site, data)
        if site == "site-3":  # 96 more images claimed for site-1's class (issue 39 F2)
            res.params["stats.count"][0] += 96.0
            res.params["stats.sum"][0] += 96.0
            res.meta["NUM_STEPS_CURRENT_ROUND"] = 100
        return res

    Stub(ctrl, reply)
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-3"]
    assert "selector statistics of site site-3" in ctrl.missing["site-3"] and "class(es) [0]" in ctrl.missing["site-3"]


def test_fedsm_lda_statistics_of_a_capped_site_count_as_its_capped_n_k(tmp_path, monkeypatch):
    from tests.unit.flare.controllers.conftest import lda_answer

    ctrl = make("fedsm", tmp_path, monkeypatch)

    def reply(site, data):
        res = lda_answer(ctrl, site, data)
        if site == "site-3":  # 400 images of its own class: 100 x the others' 4
            for key in ("stats.count", "stats.sum", "stats.gram"):
                res.params[key] = res.params[key] * 100
            res.meta["NUM_STEPS_CURRENT_ROUND"] = 400
        return res

    Stub(ctrl, reply)
    ctrl.round(0)
    assert not ctrl.missing and ctrl.state.lda_stats["site-3"]["count"][2] == 24.0  # capped at 6 x 4


def test_fedsm_moments_beyond_adams_bound_are_left_out(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    base = fedsm_reply(ctrl)

    def reply(site, data):  # exp_avg = +v, exp_avg_sq = 0: finite and non-negative (issue 39 F7)
        res = base(site, data)
        if site == "site-1":
            res.params.update({k: torch.full_like(v, 5.0) for k, v in res.params.items() if k.endswith(".exp_avg")})
            res.params.update({k: torch.zeros_like(v) for k, v in res.params.items() if k.endswith(".exp_avg_sq")})
        return res

    Stub(ctrl, reply)
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-1"] and "sqrt(exp_avg_sq)" in ctrl.missing["site-1"]
