"""FedAvg / FedProx / Centralized sites: what they send and what they keep on disk."""

import math

import torch

from pflseg.flare.methods import METHODS
from pflseg.flare.wire import GLOBAL, PERSON, SELECT, only, prefixed
from pflseg.nets.selector import build_selector, selector_cfg
from tests.unit.flare.sites.conftest import keys_of


def test_fedavg_sends_the_whole_trained_model_and_keeps_its_optimizer(federation):
    fed = federation("fedavg")
    out = fed.site().train(fed.message(0))
    assert keys_of(out.params, "global") == set(fed.initial) and set(out.params) == {f"global.{k}" for k in fed.initial}
    assert out.n_samples == out.metrics["n_samples"] > 0  # n_k (the exit sends it as NUM_STEPS_CURRENT_ROUND)
    assert any(not torch.equal(out.params[f"global.{k}"], v) for k, v in fed.initial.items())  # it trained
    saved = fed.store().load(0)
    assert "optim.model" in saved and keys_of(saved, "model") == set(fed.initial)
    assert (fed.store().root / "best.pt").is_file()  # the received model is the round's candidate


def test_fedprox_term_pulls_the_update_towards_the_received_model(federation):
    free, prox = federation("fedprox", fedprox={"mu": 0.0}), federation("fedprox", fedprox={"mu": 100.0})
    drift = {}
    for name, fed in (("free", free), ("prox", prox)):
        out = fed.site().train(fed.message(0)).params
        drift[name] = sum(float((out[f"global.{k}"] - v).pow(2).sum()) for k,
                          v in fed.initial.items() if v.is_floating_point())
    assert 0 < drift["prox"] < drift["free"]


def test_centralized_first_site_trains_on_every_sites_data(federation):
    fed = federation("centralized")
    first, second = fed.site("site-1"), fed.site("site-2")
    pooled = len(first.data("training"))
    own = {s: len(fed.site(s, [s]).data("training")) for s in ("site-1", "site-2")}
    assert pooled == own["site-1"] + own["site-2"] and first.pool_sites and second.pool_sites is None


def test_round_metrics_count_the_local_optimizer_steps(federation):
    fed = federation("fedavg", train={"batch_size": 4, "epochs": 2})
    site = fed.site()
    n_train = len(site.data("training"))
    out = site.train(fed.message(0))
    assert out.metrics["n_samples"] == n_train and n_train % 4  # a last, smaller batch counts as a step
    assert out.metrics["steps"] == math.ceil(n_train / 4) * 2


def test_final_test_scores_the_global_model_after_adabn_where_it_has_batch_norm(federation):
    for norm, scored in (("batch", True), ("instance", False)):
        fed = federation("fedavg", net={"norm": norm})
        site = fed.site()
        site.validate(fed.message(1))  # the site's best model
        test = site.test(fed.message(1)).metrics["test"]
        assert ("global_adabn" in test) == scored and 0.0 <= test["global"]["dice"] <= 1.0
        if scored:
            assert (0.0 <= test["global_adabn"]["dice"] <= 1.0
                    and test["global_adabn"]["n_cases"] == test["global"]["n_cases"])


def _first_message(fed):
    """Round 0's message of ``fed``'s job: the global model, and for FedSM its personalized model and selector."""
    if fed.cfg["method"] != "fedsm":
        return fed.message(0)
    selector = build_selector(selector_cfg(fed.cfg, 2)).state_dict()
    params = {**prefixed(GLOBAL, fed.initial), **prefixed(PERSON, fed.initial), **prefixed(SELECT, selector)}
    return fed.message(0, params, selector_label=0)


def test_the_methods_whose_run_is_fedavgs_train_its_global_model_bit_for_bit(federation):
    """Method.global_as (the bench reads FedAvg's columns from their runs): two rounds at a site, the global model
    each sends equals FedAvg's site's, bit for bit, and so do its validation scores."""
    same = sorted(name for name, entry in METHODS.items() if entry.global_as == "fedavg")
    assert same == ["fedsm", "iopfl"]
    reference = federation("fedavg")
    site, msg, sent = reference.site(), reference.message(0), []
    for r in (0, 1):
        out = site.train(msg)
        sent.append(out)
        msg = reference.message(1, only(out.params, GLOBAL))
    for name in same:
        fed = federation(name)
        site, msg = fed.site(), _first_message(fed)
        for r, ref in enumerate(sent):
            out = site.train(msg)
            mine = only(out.params, GLOBAL)
            assert set(mine) == set(ref.params) and all(torch.equal(mine[k], ref.params[k]) for k in mine), (name, r)
            assert out.metrics["val_dice"] == ref.metrics["val_dice"], (name, r)
            msg = fed.message(1, {**msg.params, **out.params}, selector_label=0)  # FedSM: the selector it had
