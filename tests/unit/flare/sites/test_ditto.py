"""Ditto site: sends the trained global model, keeps its own v_k at home, trains v_k towards the global model as it
was received this round, and reports the global model under "global" and the best v_k under "site"."""

import pytest
import torch

import pflseg.flare.sites.ditto as ditto_site
from pflseg.algorithms.fedprox import proximal_term
from pflseg.flare.wire import GLOBAL, PERSON, prefixed, unprefixed
from tests.unit.flare.sites.conftest import keys_of


@pytest.fixture
def anchors(monkeypatch):
    """Every call of v_k's proximal term, in order, as (v_k's weights at the call, the anchor it was given): the first
    call of a round is at v_k's first batch, before any optimizer step."""
    seen = []

    def spy(model, anchor, mu):
        seen.append(({k: p.detach().cpu().clone() for k, p in model.named_parameters()},
                     {k: v.detach().cpu().clone() for k, v in anchor.items()}))
        return proximal_term(model, anchor, mu)

    monkeypatch.setattr(ditto_site, "proximal_term", spy)
    return seen


def same(a, b) -> bool:
    """Nested dicts / lists of tensors and numbers equal, tensors bit for bit."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_sends_the_trained_global_model_and_keeps_v_k_at_home(federation):
    fed = federation("ditto")
    site = fed.site()
    assert site.personalized and site.keeps and not site.personal_models_sent(fed.cfg)
    out = site.train(fed.message(0))
    assert set(out.params) == {f"{GLOBAL}.{k}" for k in fed.initial}  # the global model only: v_k never leaves
    assert any(not torch.equal(out.params[f"{GLOBAL}.{k}"], v) for k, v in fed.initial.items())  # it trained
    saved = fed.store().load(0)
    assert keys_of(saved, PERSON) == set(fed.initial) and {"optim.model", "optim.person"} <= set(saved)
    person = unprefixed(PERSON, saved)
    assert any(not torch.equal(person[k], v) for k, v in fed.initial.items())  # v_k trained too
    assert any(not torch.equal(person[k], out.params[f"{GLOBAL}.{k}"]) for k in fed.initial)  # not the global one
    m = out.metrics
    assert 0.0 <= m["val_dice"] <= 1.0 and 0.0 <= m["val_dice_person"] <= 1.0 and m["person_loss"] >= 0.0


def test_v_k_is_pulled_towards_the_global_model_as_received_and_continues_from_its_state(federation, anchors):
    fed = federation("ditto")
    site = fed.site()
    site.train(fed.message(0))
    (v0, anchor0), *_ = anchors
    assert set(anchor0) == set(v0)  # the trainable parameters
    assert all(torch.equal(anchor0[k], fed.initial[k]) for k in anchor0)  # w_t as received, not the trained copy
    assert all(torch.equal(v0[k], fed.initial[k]) for k in v0)  # round 0: v_k starts as w_t
    kept = unprefixed(PERSON, fed.store().load(0))
    new_global = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in fed.initial.items()}
    anchors.clear()
    site.train(fed.message(1, prefixed(GLOBAL, new_global)))
    (v1, anchor1), *_ = anchors
    assert all(torch.equal(anchor1[k], new_global[k]) for k in anchor1)  # this round's received global model
    assert all(torch.equal(v1[k], kept[k]) for k in v1)  # v_k continues from round 0's v_k, not from w_t


def test_a_strong_pull_keeps_v_k_near_the_global_model(federation):
    drift = {}
    for lam in (0.0, 1000.0):
        fed = federation("ditto", ditto={"lam": lam})
        fed.site().train(fed.message(0))
        person = unprefixed(PERSON, fed.store().load(0))
        drift[lam] = sum(float((person[k] - v).pow(2).sum()) for k, v in fed.initial.items() if v.is_floating_point())
    assert 0 < drift[1000.0] < drift[0.0]


def test_the_global_model_trains_as_fedavgs_does(federation):
    """The global update is FedAvg's, bit for bit: v_k's training (own seed) does not touch it."""
    sent = {}
    for job in ("fedavg", "ditto"):
        fed = federation(job)
        sent[job] = fed.site().train(fed.message(0)).params
    assert set(sent["fedavg"]) == set(sent["ditto"])
    assert all(torch.equal(sent["fedavg"][k], sent["ditto"][k]) for k in sent["fedavg"])


def test_validate_scores_the_global_model_and_test_reports_global_and_the_best_v_k(federation):
    fed = federation("ditto")
    site = fed.site()
    first = site.train(fed.message(0)).metrics["val_dice_person"]
    best = site.best_path
    stamp = best.stat().st_mtime_ns
    assert site.best_score() == first  # best.pt: v_k after round 1
    val = site.validate(fed.message(1)).metrics["val_dice"]
    assert 0.0 <= val <= 1.0 and best.stat().st_mtime_ns == stamp  # the global model is no candidate for v_k
    test = site.test(fed.message(1)).metrics["test"]
    assert set(test) >= {"global", "site"} and test["site"]["selected_round"] == 1
    assert 0.0 <= test["global"]["dice"] <= 1.0 and 0.0 <= test["site"]["dice"] <= 1.0


def test_a_site_restarted_between_rounds_trains_the_same_v_k(federation):
    """Everything v_k needs is on disk: round 1 in a new site object (a restarted process) keeps what the same object
    keeps, bit for bit."""
    fed = federation("ditto")
    site = fed.site()
    site.train(fed.message(0))
    site.train(fed.message(1))
    straight = fed.store().load(1)
    fed.site().train(fed.message(0))  # a fresh job: round 0 again
    fed.site().train(fed.message(1))  # round 1 in another object
    assert same(straight, fed.store().load(1))


def test_missing_state_is_named_in_a_resumed_job(federation):
    fed = federation("ditto", resume=True)
    with pytest.raises(RuntimeError, match=r"no state before round 2 in .* \(it keeps its personalized model v_k"):
        fed.site().train(fed.message(2))
