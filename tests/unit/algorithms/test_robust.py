"""Robust aggregation and bounds (pflseg.algorithms.robust) on hand-made numbers."""

import math

import pytest
import torch

from pflseg.algorithms import robust
from pflseg.algorithms.fedavg import weighted_average
from pflseg.algorithms.fedsm import average_moments, check_statistics, class_statistics
from pflseg.algorithms.grace import grace_step
from pflseg.algorithms.lcfed import average_shared
from pflseg.algorithms.robust import (
    adam_ratio,
    aggregate,
    bound_moments,
    bounded_weights,
    check_moments,
    clip_statistics,
    clip_updates,
    combine_rows,
    first_nonfinite,
    norm_outliers,
    trim_count,
    update_norms,
)


def s(*values, dtype=torch.float32):
    return {"w": torch.tensor(values, dtype=dtype)}


def test_mean_is_weighted_average_bit_for_bit():
    states = [s(1.0, 2.0), s(3.0, 5.0), s(7.0, 11.0)]
    a, b = aggregate(states, [1, 2, 3]), weighted_average(states, [1, 2, 3])
    assert torch.equal(a["w"], b["w"])


def test_median_is_coordinatewise_and_ignores_the_weights():
    states = [s(1.0, 9.0), s(2.0, 1e30), s(1e30, 3.0)]
    out = aggregate(states, [1, 1e6, 1], rule="median")
    assert out["w"].tolist() == [2.0, 9.0]
    even = aggregate(states + [s(4.0, 5.0)], [1, 1, 1, 1], rule="median")  # mean of the two middle values
    assert even["w"].tolist() == [3.0, 7.0]


def test_trim_count():
    assert [trim_count(k, 0.2) for k in (1, 2, 3, 5, 6, 10, 11)] == [0, 0, 1, 1, 2, 2, 3]
    assert trim_count(5, 0.0) == 0 and trim_count(9, 0.4) == 4 and trim_count(4, 0.4) == 1


def test_trimmed_mean_drops_each_end_and_ignores_the_weights():
    # five sites, trim 0.2: one value dropped at each end of every coordinate, the plain mean of the rest
    states = [s(1.0), s(2.0), s(3.0), s(4.0), s(1e30)]
    out = aggregate(states, [1, 1, 1, 3e6, 1], rule="trimmed_mean", trim=0.2)
    assert out["w"].item() == pytest.approx(3.0)  # 1 and 1e30 dropped; site 4's claimed weight counts for nothing
    low = aggregate([s(-1e30), s(2.0), s(3.0), s(4.0), s(5.0)], [1] * 5, rule="trimmed_mean", trim=0.2)
    assert low["w"].item() == pytest.approx(3.0)


def test_trimmed_mean_with_trim_0_is_the_plain_mean():
    block = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.float64)
    assert torch.allclose(combine_rows(block, [1, 3], "trimmed_mean", 0.0),
                          torch.tensor([2.0, 4.0], dtype=torch.float64))


def test_clip_updates_bounds_one_update_and_passes_the_others_on_as_they_came():
    base = {"w": torch.zeros(2), "n": torch.tensor(5)}
    states = [{"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(6)},
              {"w": torch.tensor([0.0, 6.0]), "n": torch.tensor(6)},
              {"w": torch.tensor([300.0, 400.0]), "n": torch.tensor(10**9)}]
    out, factors, ratios = clip_updates(base, states, 3.0)
    assert out[0] is states[0] and out[1] is states[1] and factors[:2] == [1.0, 1.0]
    # site 3: norm 500, the others' median (5 + 6) / 2 = 5.5, bound 16.5: same direction, that norm
    assert torch.allclose(out[2]["w"], torch.tensor([300.0, 400.0]) * 16.5 / 500) and factors[2] == pytest.approx(0.033)
    assert out[2]["n"] is states[2]["n"] and ratios[2] == pytest.approx(500 / 5.5)  # integer keys are not clipped
    assert states[2]["w"].tolist() == [300.0, 400.0]  # inputs unchanged
    assert clip_updates(base, states, 0.0)[0] == states  # 0 = no clipping
    two, f2, _ = clip_updates([base, base], states[1:], 3.0)  # K = 2: each bounded by the other
    assert f2[0] == 1.0 and float(two[1]["w"].norm()) == pytest.approx(18.0)


def _lda_sites(k: int, seed: int = 0, n: int = 40, d: int = 6):
    gen = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(k, d, generator=gen, dtype=torch.float64)
    feats = [means[i] + torch.randn(n, d, generator=gen, dtype=torch.float64) for i in range(k)]
    labels = [torch.randint(0, k + 1, (n,), generator=gen) for _ in range(k)]  # FedSM-extra: any class
    return feats, labels


def test_clip_statistics_keeps_honest_sites_and_pulls_a_far_one_to_the_bound():
    feats, labels = _lda_sites(3)
    stats = [class_statistics(f, y, 4) for f, y in zip(feats, labels)]
    out, factors, ratios = clip_statistics(stats, 3.0)
    assert all(a is b for a, b in zip(out, stats)) and factors == [1.0] * 3 and max(ratios) < 3.0
    far = feats[0] + 50.0  # every class mean of site 1 displaced, its spread as it was
    liar = class_statistics(far, labels[0], 4)
    out, factors, ratios = clip_statistics([liar, *stats[1:]], 3.0)
    assert factors[0] < 0.2 and ratios[0] > 10 and out[1] is stats[1] and out[2] is stats[2]
    # the clipped statistics are those of the moved features x -> M + f (m - M) + (x - m), M the median of the means
    means = torch.stack([far.mean(0), feats[1].mean(0), feats[2].mean(0)])
    center = means.median(0).values  # K = 3: the middle value
    moved = class_statistics(center + factors[0] * (means[0] - center) + (far - means[0]), labels[0], 4)
    for key in ("count", "sum", "gram"):
        assert torch.allclose(out[0][key], moved[key], atol=1e-8), key
    assert check_statistics(out[0], 40) is None  # still statistics of 40 features
    _, again, ratios = clip_statistics([out[0], *stats[1:]], 3.0)  # at the bound now: not moved again
    assert again == pytest.approx([1.0] * 3) and ratios[0] == pytest.approx(3.0)


def test_clip_statistics_bounds_the_spread_along_one_direction():
    feats, labels = _lda_sites(5)
    e = torch.zeros(6, dtype=torch.float64)
    e[0] = 1.0
    wide = feats[0] + 40.0 * torch.randn(40, 1, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * e
    stats = [class_statistics(f, y, 6) for f, y in zip([wide, *feats[1:]], labels)]
    out, factors, ratios = clip_statistics(stats, 3.0)
    assert factors[0] < 1.0 and factors[1:] == [1.0] * 4
    assert clip_statistics(stats, 0.0)[1] == [1.0] * 5  # 0 = no clipping
    assert clip_statistics(stats[:1], 3.0)[0][0] is stats[0]  # one site: nothing to judge it by


def test_adam_moments_satisfy_adams_own_bound_and_forged_ones_do_not():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(50))
    opt = torch.optim.Adam([w])
    for t in range(200):  # growing gradients bring |m| / sqrt(v) closest to the bound
        w.grad = torch.randn(50) * math.exp(0.05 * t)
        opt.step()
    honest = {"0.exp_avg": opt.state[w]["exp_avg"], "0.exp_avg_sq": opt.state[w]["exp_avg_sq"],
              "0.step": torch.tensor(200.0)}
    assert check_moments(honest, None, 200) is None
    assert adam_ratio() == pytest.approx(7.2703, abs=1e-4)
    forged = {**honest, "0.exp_avg": torch.ones(50), "0.exp_avg_sq": torch.zeros(50)}  # issue 39 F7
    assert "exceeds 7.27 x sqrt(exp_avg_sq)" in check_moments(forged, None, 200)


def test_bound_moments_keeps_the_ratio_within_the_sites_own():
    sites = [{"0.exp_avg": torch.tensor([1.0, -1.0]), "0.exp_avg_sq": torch.tensor([4.0, 4.0])},  # ratio 0.5
             {"0.exp_avg": torch.tensor([0.5, -0.5]), "0.exp_avg_sq": torch.tensor([1.0, 1.0])},  # ratio 0.5
             {"0.exp_avg": torch.tensor([7.0, 7.0]), "0.exp_avg_sq": torch.tensor([1.0, 1.0])}]  # ratio 7
    mean = average_moments(sites, [1, 1, 10])
    out = bound_moments(mean, sites)
    v = mean["0.exp_avg_sq"].sqrt()
    assert torch.allclose(out["0.exp_avg"].abs(), 0.5 * v) and out["0.exp_avg_sq"] is mean["0.exp_avg_sq"]
    honest = average_moments(sites[:2], [1, 1])
    assert torch.equal(bound_moments(honest, sites[:2])["0.exp_avg"], honest["0.exp_avg"])  # within: unchanged


def test_integer_keys_are_rounded_back():
    states = [{"n": torch.tensor(1)}, {"n": torch.tensor(2)}, {"n": torch.tensor(10)}]
    out = aggregate(states, [1, 1, 1], rule="median")
    assert out["n"].dtype == torch.int64 and out["n"].item() == 2


def test_bad_rule_and_trim_are_refused():
    with pytest.raises(ValueError, match="rule"):
        aggregate([s(1.0)], [1], rule="mode")
    with pytest.raises(ValueError, match="trim"):
        aggregate([s(1.0)], [1], rule="trimmed_mean", trim=0.5)


def test_weights_are_capped_at_ratio_times_the_others_median():
    assert bounded_weights([100, 120, 1_000_000], 100) == [100, 120, 100 * 110]
    assert bounded_weights([10, 120, 60], 100) == [10, 120, 60]  # 12:1 honest sites: unchanged
    assert bounded_weights([100, 1_000_000], 100) == [100, 10_000]  # K = 2: each bounded by the other
    assert bounded_weights([5, 1_000_000], 0) == [5, 1_000_000]  # 0 = no bound
    assert bounded_weights([7], 100) == [7]


def test_update_norms_are_against_what_was_sent():
    sent = {"a": {"w": torch.tensor([1.0, 1.0])}, "b": {"w": torch.tensor([1.0, 1.0])}}
    answers = {"a": {"w": torch.tensor([4.0, 5.0]), "x": torch.tensor([0.0])},  # x was not sent: its value
               "b": {"w": torch.tensor([1.0, 1.0]), "x": torch.tensor([2.0])}}
    whole, per_key = update_norms(answers, sent)
    assert whole == {"a": 5.0, "b": 2.0} and per_key["w"] == {"a": 5.0, "b": 0.0} and per_key["x"]["b"] == 2.0



def test_squared_norm_block_by_block_is_the_whole_tensors_float64_sum():
    """squared_norm sums BLOCK elements at a time; over 3.5 blocks it is the one-temporary float64 sum up to
    rounding order, a 1e30 update stays finite, and a tensor of one block is that sum exactly."""
    torch.manual_seed(0)
    base = torch.randn(int(3.5 * robust.BLOCK))
    value = base + 1e-3 * torch.randn_like(base)
    whole = float(((value.double() - base.double()) ** 2).sum())
    assert math.isclose(robust.squared_norm(value, base), whole, rel_tol=1e-12)
    assert robust.squared_norm(value[:1000], base[:1000]) == float(((value[:1000].double() - base[:1000]) ** 2).sum())
    assert math.isclose(robust.squared_norm(torch.full((3,), 1e30)), 3e60, rel_tol=1e-6)  # float32's 1e30
    assert robust.squared_norm(torch.tensor(2.0), torch.tensor(0.5)) == 2.25  # a 0-d tensor


def test_clip_updates_from_known_norms_is_the_clip_from_the_updates():
    """The guard passes update_norms' per-key norms to the clip instead of taking them again: the same clip."""
    torch.manual_seed(1)
    base = {"w": torch.zeros(4), "v": torch.zeros(2, 3)}
    states = [{k: v + s * torch.randn_like(v) for k, v in base.items()} for s in (1.0, 1.2, 30.0)]
    sites = ["a", "b", "c"]
    _, per_key = update_norms(dict(zip(sites, states)), dict.fromkeys(sites, base))
    known = [{k: n[s] for k, n in per_key.items()} for s in sites]
    plain, plain_f, plain_r = clip_updates(base, states, 3.0)
    fast, fast_f, fast_r = clip_updates(base, states, 3.0, None, known)
    assert plain_f[2] < 1.0 and fast_f == pytest.approx(plain_f, rel=1e-12)
    assert fast_r == pytest.approx(plain_r, rel=1e-12)
    assert all(torch.allclose(fast[2][k], plain[2][k], rtol=1e-6) for k in base) and fast[0] is states[0]

def test_a_1e30_update_is_an_outlier_and_honest_ones_are_not():
    sent = {k: {"w": torch.zeros(3)} for k in "abc"}
    honest = {"a": {"w": torch.tensor([1.0, 0.0, 0.0])}, "b": {"w": torch.tensor([0.0, 12.0, 0.0])}}
    assert norm_outliers({**honest, "c": {"w": torch.tensor([0.0, 0.0, 3.0])}}, sent, 100) == {}
    out = norm_outliers({**honest, "c": {"w": torch.full((3,), 1e30), "v": torch.ones(2)}}, sent, 100)
    assert list(out) == ["c"] and "update norm" in out["c"] and "largest part: 'w'" in out["c"]  # names the tensor
    two = norm_outliers({"a": honest["a"], "c": {"w": torch.full((3,), 1e30)}}, sent, 100)  # K = 2
    assert list(two) == ["c"]
    assert norm_outliers({**honest, "c": {"w": torch.full((3,), 1e30)}}, sent, 0) == {}


def test_one_tensor_scaled_1000x_is_an_outlier_though_the_whole_update_is_not():
    sent = {k: {"big": torch.zeros(100), "bias": torch.zeros(1)} for k in "abc"}
    answers = {k: {"big": torch.full((100,), 1.0), "bias": torch.tensor([0.01])} for k in "abc"}
    answers["c"] = {"big": torch.full((100,), 1.0), "bias": torch.tensor([20.0])}  # whole norm 22.4 vs 10
    out = norm_outliers(answers, sent, 100)
    assert list(out) == ["c"] and "'bias'" in out["c"]


def test_a_tensor_the_others_barely_move_is_judged_against_a_floor_of_their_whole_update():
    sent = {k: {"big": torch.zeros(100), "bias": torch.zeros(1)} for k in "abc"}
    answers = {k: {"big": torch.full((100,), 0.05), "bias": torch.tensor([5e-5])} for k in "abc"}  # whole norm 0.5
    answers["a"]["bias"] = torch.tensor([0.0114])  # 200x the others' bias update, as an honest site measured
    assert norm_outliers(answers, sent, 100) == {}  # the floor: 100 x 0.01 x 0.5 = 0.5


def test_a_tensor_the_others_leave_unchanged_is_judged_by_the_whole_update_only():
    sent = {k: {"w": torch.zeros(2), "frozen": torch.zeros(1)} for k in "abc"}
    answers = {k: {"w": torch.ones(2), "frozen": torch.zeros(1)} for k in "abc"}
    answers["c"]["frozen"] = torch.tensor([0.5])
    assert norm_outliers(answers, sent, 100) == {}


def test_moments_negative_exp_avg_sq_and_steps_out_of_range_are_refused():
    good = {"0.exp_avg": torch.tensor([-1.0]), "0.exp_avg_sq": torch.tensor([0.5]), "0.step": torch.tensor(12.0)}
    assert check_moments(good, {"0.step": torch.tensor(10.0)}, max_steps=5) is None
    assert check_moments(good, {}, max_steps=12) is None  # nothing sent: step counts from 0
    bad_sq = {**good, "0.exp_avg_sq": torch.tensor([0.5, -1e-3])}
    assert "negative" in check_moments(bad_sq, {}, 20)
    assert "outside" in check_moments({**good, "0.step": torch.tensor(0.0)}, {}, 20)  # Adam divides by 1 - beta^0
    assert "outside" in check_moments({**good, "0.step": torch.tensor(-5.0)}, {}, 20)
    assert "outside" in check_moments({**good, "0.step": torch.tensor(1e9)}, {"0.step": torch.tensor(10.0)}, 5)
    assert "outside" in check_moments(good, {"0.step": torch.tensor(11.5)}, 5)  # fewer steps than it was sent


def test_first_nonfinite_names_the_key():
    assert first_nonfinite({"a": torch.ones(2), "n": torch.tensor(3)}) is None
    assert "'global.w'" in first_nonfinite({"global.w": torch.tensor([1.0, float("nan")])})
    assert "'p.q'" in first_nonfinite({"p": {"q": torch.tensor([float("inf")])}})
    assert "magnitude" in first_nonfinite({"w": torch.tensor([1e30])})
    assert first_nonfinite({"w": torch.tensor([1e30])}, max_abs=math.inf) is None


def test_every_averaging_function_takes_the_rule():
    states = [s(1.0), s(2.0), s(1e30)]
    assert average_shared(states, ["w"], rule="median")[0]["w"].item() == 2.0
    moments = [{"0.exp_avg_sq": torch.tensor([x])} for x in (1.0, 2.0, 1e30)]
    assert average_moments(moments, [1, 1, 1e6], rule="median")["0.exp_avg_sq"].item() == 2.0


def test_grace_median_step_ignores_one_huge_update():
    g = {"w": torch.zeros(2)}
    clients = [{"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.2, 0.9])}, {"w": torch.tensor([1e30, -1e30])}]
    mean, _ = grace_step(g, clients, [1, 1, 1])
    assert mean["w"].abs().max() > 1e20  # the paper's weighted sum follows the huge update
    med, _ = grace_step(g, clients, [1, 1, 1], rule="median")
    assert med["w"].tolist() == pytest.approx([1.2, 0.9])  # global - median(global - w_k)
    same, _ = grace_step(g, clients[:2] + [{"w": torch.tensor([1.1, 1.0])}], [1, 1, 1], rule="mean")
    ref, _ = grace_step(g, clients[:2] + [{"w": torch.tensor([1.1, 1.0])}], [1, 1, 1])
    assert torch.equal(same["w"], ref["w"])


def test_only_sent_tensors_outside_the_skipped_prefixes_are_judged_one_by_one():
    sent = {k: {"w": torch.zeros(100), "moment.0.exp_avg_sq": torch.zeros(1)} for k in "abc"}
    answers = {k: {"w": torch.ones(100), "moment.0.exp_avg_sq": torch.tensor([1e-4]), "stats": torch.tensor([1e-4])}
               for k in "abc"}
    answers["c"] = {"w": torch.ones(100), "moment.0.exp_avg_sq": torch.tensor([20.0]), "stats": torch.tensor([20.0])}
    # the moment, beyond 100 x (0.01 x the others' whole update)
    assert list(norm_outliers(answers, sent, 100)) == ["c"]
    assert norm_outliers(answers, sent, 100, skip=("moment.",)) == {}  # "stats" was not sent: whole update only


def test_a_clipped_update_keeps_the_base_s_normalisation_statistics_so_no_variance_turns_negative():
    from pflseg.algorithms.robust import clip_updates

    base = {"conv.weight": torch.zeros(4), "bn.running_var": torch.ones(4), "bn.running_mean": torch.zeros(4)}
    honest = [{"conv.weight": torch.full((4,), 0.1), "bn.running_var": torch.full((4,), 0.9),
               "bn.running_mean": torch.full((4,), 0.1)} for _ in range(2)]
    liar = {"conv.weight": torch.full((4,), 9.9), "bn.running_var": 1.0 + 99 * torch.full((4,), -0.1),
            "bn.running_mean": torch.full((4,), 9.9)}
    states, factors, _ = clip_updates(base, [*honest, liar], 3.0)
    assert factors[2] < 1.0 and factors[:2] == [1.0, 1.0] and states[0] is honest[0]
    assert torch.equal(states[2]["bn.running_var"], base["bn.running_var"])
    assert torch.equal(states[2]["bn.running_mean"], base["bn.running_mean"])
    assert 0.0 < float(states[2]["conv.weight"][0]) < 9.9  # the weights scaled back towards the base


def test_a_normalisation_statistic_is_not_bounded_on_its_own_but_a_weight_is():
    """The demo's LC-Fed, round 2: the largest site's running variance moved 167x the others' median (its images
    differ) and the per-tensor bound refused an honest site. Statistics count in the whole update only; a weight
    tensor moved as far is still refused on its own."""
    base = {"conv.weight": torch.zeros(1000), "head.weight": torch.zeros(4), "bn.running_var": torch.ones(4),
            "bn.running_mean": torch.zeros(4)}
    sent = {s: base for s in "abc"}
    honest = {s: {"conv.weight": torch.full((1000,), 0.1), "head.weight": torch.full((4,), 0.01),
                  "bn.running_var": torch.full((4,), 1.1), "bn.running_mean": torch.full((4,), 0.01)} for s in "ab"}
    statistics = {**honest["a"], "bn.running_var": torch.full((4,), 1.0 + 16.7)}  # 167x the others' update
    assert norm_outliers({**honest, "c": statistics}, sent, 100) == {}
    weight = {**honest["a"], "head.weight": torch.full((4,), 3.0)}  # the whole update 2x, this tensor 180x
    assert "'head.weight'" in norm_outliers({**honest, "c": weight}, sent, 100)["c"]
