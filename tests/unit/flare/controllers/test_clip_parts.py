"""The parts of an answer that are not a model update the task sent, clipped where the method combines them
(issue 39, "whatever the method"): FedSM's epoch-mode selector gradients and LDA statistics (FedSM-extra's too),
LC-Fed's coarse heads, IOP-FL's published P_k. An honest round within the bound is unchanged bit for bit; a clipped
site is named in its round metrics (``update_clipped``, every site's ``update_ratio``) or in results.json."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedsm import add_statistics, check_statistics, lda_head, pooled_adam_step
from pflseg.algorithms.robust import clip_statistics
from pflseg.flare.controllers.base import Answers
from pflseg.flare.wire import GRAD, HEAD, SITE, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import SITES, lda_answer, make, scaled

EPOCH = {"selector_fit": "softmax", "selector_steps": "epoch"}


def answers(params: dict, n_k: dict) -> Answers:
    """``send_each``'s answers: one FLModel per site with its n_k, and its (empty) round metrics."""
    return Answers({s: FLModel(params=p, meta={"NUM_STEPS_CURRENT_ROUND": n_k[s]}) for s, p in params.items()},
                   {s: {} for s in params})


def gradients(ctrl, scale: dict) -> dict:
    """Each site's summed selector gradient: the same direction, ``scale[site]`` times a fixed one."""
    gen = torch.Generator().manual_seed(0)
    base = {k: torch.randn(v.shape, generator=gen) for k, v in unprefixed(GRAD, ctrl.selector_ref).items()}
    return {s: prefixed(GRAD, {k: v * scale[s] for k, v in base.items()}) for s in scale}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fedsm_epoch_gradients_honest_are_summed_as_sent_and_a_1000x_one_is_clipped(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=EPOCH)
    selector = {k[len(GRAD) + 1:]: torch.zeros_like(v) for k, v in ctrl.selector_ref.items()}
    lr = ctrl.cfg["fedsm"]["selector_lr"]
    n_k = {s: 10 for s in SITES}
    honest = gradients(ctrl, {"site-1": 1.0, "site-2": 2.5, "site-3": 1.0})
    results = answers(honest, n_k)
    new, moments, _ = ctrl.fit_selector(results, selector, {}, {})
    plain, plain_moments = pooled_adam_step(selector, [unprefixed(GRAD, p) for p in honest.values()], {}, lr)
    assert same(new, plain) and same(moments, plain_moments)  # bit for bit
    assert all("update_clipped" not in m for m in results.site_metrics.values())
    assert results.site_metrics["site-2"]["update_ratio"] == 2.5

    liar = {**honest, "site-3": gradients(ctrl, {"site-3": -1750.0})["site-3"]}  # 1000 x the others' median
    results = answers({**liar}, {**n_k, "site-3": 1000})  # its n_k weighs neither the sum nor the clip
    new, _, _ = ctrl.fit_selector(results, selector, {}, {})
    assert results.site_metrics["site-3"]["update_clipped"] == 1000.0
    assert "update_clipped" not in results.site_metrics["site-1"]
    # cut to 3 x the others' median norm: the pooled sum 1 + 2.5 - 5.25 = -1.75 x the common gradient, not -1746.5
    f = 3 * 1.75 / 1750
    grads = [unprefixed(GRAD, honest["site-1"]), unprefixed(GRAD, honest["site-2"]),
             {k: v * f for k, v in unprefixed(GRAD, liar["site-3"]).items()}]
    expected, _ = pooled_adam_step(selector, grads, {}, lr)
    assert all(torch.allclose(new[k], expected[k], atol=1e-7) for k in expected)


def test_fedsm_lda_statistics_honest_unchanged_and_a_displaced_site_pulled_in(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch)  # selector_fit lda (default)
    message = ctrl.message(0, {})
    stats = {s: lda_answer(ctrl, s, message).params for s in SITES}
    n_k = {s: 4 for s in SITES}
    results = answers(stats, n_k)
    new, _, kept = ctrl.fit_selector(results, {}, {}, {})
    plain = lda_head(add_statistics([unprefixed("stats", stats[s]) for s in SITES]), ctrl.cfg["fedsm"]["lda_shrinkage"])
    assert torch.equal(new["classifier.weight"], plain[0]) and torch.equal(new["classifier.bias"], plain[1])
    assert all("update_clipped" not in m for m in results.site_metrics.values())

    far = {**stats, "site-2": lda_answer(ctrl, "site-2", message, shift=1000.0).params}  # its class mean 1000 away
    results = answers(far, n_k)
    new, _, kept = ctrl.fit_selector(results, {}, {}, {})
    assert results.site_metrics["site-2"]["update_clipped"] > 3.0 and "update_clipped" not in results.site_metrics[
        "site-1"]
    assert check_statistics(kept["site-2"], 4) is None  # still the statistics of 4 (moved) features
    _, factors, ratios = clip_statistics([kept[s] for s in SITES], ctrl.cfg["robust"]["clip"])
    assert factors == pytest.approx([1.0] * 3) and max(ratios) <= 3.0 + 1e-9  # within the bound now
    # a site that gives no answer keeps its (judged) statistics; only the answering sites' are judged again
    again = answers({s: stats[s] for s in ("site-1", "site-3")}, n_k)
    _, _, kept2 = ctrl.fit_selector(again, {}, {}, kept)
    assert kept2["site-2"] is kept["site-2"]


def lcfed(tmp_path, monkeypatch):
    return make("lcfed", tmp_path, monkeypatch, net={"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]})


def test_lcfed_heads_honest_kept_as_sent_and_a_pushed_one_clipped_against_its_previous_head(tmp_path, monkeypatch):
    ctrl = lcfed(tmp_path, monkeypatch)
    held = {s: {"weight": torch.full((1, 4, 1, 1), float(i)), "bias": torch.full((1,), float(i))}
            for i, s in enumerate(SITES)}
    step = {"site-1": 0.1, "site-2": 0.2, "site-3": 0.15}
    sent = {s: prefixed(HEAD, {k: v + step[s] for k, v in held[s].items()}) for s in SITES}
    results = answers(sent, {s: 1 for s in SITES})
    payloads = {s: ctrl.message(1, {}) for s in SITES}
    heads, _ = ctrl.exchange_heads(results, payloads, held)
    assert all(same(heads[s], unprefixed(HEAD, sent[s])) for s in SITES)
    assert all("update_clipped" not in m for m in results.site_metrics.values())

    pushed = {**sent, "site-3": prefixed(HEAD, {k: v + 150.0 for k, v in held["site-3"].items()})}  # 1000 x
    results = answers(pushed, {s: 1 for s in SITES})
    heads, _ = ctrl.exchange_heads(results, payloads, held)
    update = torch.cat([(heads["site-3"][k] - held["site-3"][k]).flatten() for k in held["site-3"]])
    # 5 numbers each moved by the site's step: 3 x the others' median (0.1 + 0.2) / 2 x sqrt(5)
    assert float(update.norm()) == pytest.approx(3 * 0.15 * 5 ** 0.5, rel=1e-5)
    assert results.site_metrics["site-3"]["update_clipped"] == pytest.approx(1000.0, rel=1e-4)
    assert same(heads["site-1"], unprefixed(HEAD, sent["site-1"]))


def test_lcfed_a_site_without_a_held_head_is_judged_from_the_initial_head(tmp_path, monkeypatch):
    ctrl = lcfed(tmp_path, monkeypatch)
    start = unprefixed(HEAD, ctrl.initial_state())
    payloads = {s: ctrl.message(0, prefixed("global", ctrl.initial_state())) for s in SITES}  # round 0: whole model
    sent = {s: prefixed(HEAD, {k: v + 0.1 * (i + 1) for k, v in start.items()}) for i, s in enumerate(SITES)}
    sent["site-2"] = prefixed(HEAD, {k: v + 1e4 for k, v in start.items()})
    results = answers(sent, {s: 1 for s in SITES})
    heads, _ = ctrl.exchange_heads(results, payloads, {})
    moved = torch.cat([(heads["site-2"][k] - start[k]).flatten() for k in start])
    assert float(moved.norm()) == pytest.approx(3 * (0.1 + 0.3) / 2 * 5 ** 0.5, rel=1e-4)  # 3 x the others' median
    assert same(heads["site-1"], unprefixed(HEAD, sent["site-1"]))


def test_iopfl_published_p_k_clipped_against_the_bundles_global_model(tmp_path, monkeypatch):
    ctrl = make("iopfl", tmp_path, monkeypatch)
    best = ctrl.initial_state()
    subs = {s: FLModel(params=prefixed(SITE, scaled(best, f))) for s, f in zip(SITES, (1.1, 1.2, 1.3))}
    person, notes = ctrl.bounded_person(subs, best)
    assert all(same(person[s], unprefixed(SITE, subs[s].params)) for s in SITES)
    assert "person_clipped" not in notes
    assert notes["person_update_ratio"]["site-3"] == pytest.approx(2.0, abs=1e-3)  # 0.3 / median(0.1, 0.2)
    subs["site-2"] = FLModel(params=prefixed(SITE, scaled(best, 100.0)))  # 99 x w_g away from it
    person, notes = ctrl.bounded_person(subs, best)
    key = next(k for k, v in best.items() if v.is_floating_point() and v.abs().sum() > 0)
    assert torch.allclose(person["site-2"][key], best[key] * (1 + 3 * 0.2), atol=1e-5)  # 3 x median(0.1, 0.3)
    assert set(notes["person_clipped"]) == {"site-2"} and "robust.clip" in notes["person_clipped"]["site-2"]
    ints = [k for k, v in best.items() if not v.is_floating_point()]
    assert all(torch.equal(person["site-2"][k], best[k]) for k in ints)  # counters passed on as they came
