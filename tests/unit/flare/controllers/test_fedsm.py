"""FedSM's controllers with a stubbed transport: what each site is sent, the SoftPull and selector steps, the best
selector, and the final checkpoint holding exactly the models the training job's final test scored (what the
post-training bundles read); FedSM inference: the best selector, gamma chosen on validation, never on test, and
the familiarity fallback."""

import json
import math

import pytest
import torch
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedsm import TEMPERATURES
from pflseg.algorithms.softpull import softpull
from pflseg.config import ConfigError, load_job_config
from pflseg.flare.controllers.fedsm import choose_gamma, selection_report
from pflseg.flare.methods import METHODS
from pflseg.flare.wire import PERSON, prefixed, unprefixed
from tests.unit.flare.controllers.conftest import BATCH, TINY, Stub, lda_answer, make, models_of, scaled


def test_fedsm_sends_each_site_only_its_own_personalized_model_and_label(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    ctrl.state.person = {s: scaled(ctrl.state.global_state, i + 1.0) for i, s in enumerate(ctrl.sites)}
    n = {"site-1": 1, "site-2": 1, "site-3": 2}

    def reply(site, data):
        params = dict(data.params)  # every moment key: an answer without all of them is left out
        params.update({k: torch.full_like(v, float(n[site])) for k, v in ctrl.moment_ref.items()})
        return FLModel(params=params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]})

    before = {s: dict(p) for s, p in ctrl.state.person.items()}
    stub = Stub(ctrl, reply)
    ctrl.round(0)
    key = next(k for k, v in ctrl.state.global_state.items() if v.is_floating_point() and v.abs().sum() > 0)
    for k, (_, site, data) in enumerate(stub.sent):
        assert data.meta["selector_label"] == k
        assert torch.equal(unprefixed("person", data.params)[key], before[site][key])  # its own, nobody else's
    assert ctrl.state.moments["0.exp_avg_sq"].flatten()[0].item() == pytest.approx(0.25 * 1 + 0.25 * 1 + 0.5 * 2)
    # exp_avg: the same mean 1.5, bounded at the sites' median ratio |m| / sqrt(v) = 1 x sqrt(1.5) (bound_moments)
    assert ctrl.state.moments["0.exp_avg"].flatten()[0].item() == pytest.approx(1.5 ** 0.5)
    expected = softpull([before[s] for s in ctrl.sites], ctrl.cfg["fedsm"]["lam"])
    for k, s in enumerate(ctrl.sites):
        assert torch.allclose(ctrl.state.person[s][key], expected[k][key])


def test_fedsm_site_that_drops_out_keeps_its_personalized_model(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    ctrl.state.person["site-3"] = scaled(ctrl.state.global_state, 5.0)
    kept = dict(ctrl.state.person["site-3"])
    moments = {k: torch.ones_like(v) for k, v in ctrl.moment_ref.items()}
    Stub(ctrl, lambda site, data: None if site == "site-3" else
         FLModel(params={**data.params, **moments}, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    assert "site-3" in ctrl.missing
    assert all(torch.equal(ctrl.state.person["site-3"][k], kept[k]) for k in kept)


def test_softpull_step_returns_the_new_personalized_models_and_leaves_the_controllers_alone(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch)
    person = {s: scaled(ctrl.state.global_state, i + 1.0) for i, s in enumerate(ctrl.sites)}
    held = {s: dict(p) for s, p in ctrl.state.person.items()}
    trained = {s: FLModel(params=prefixed(PERSON, scaled(person[s], 2.0))) for s in ("site-1", "site-3")}
    new = ctrl.softpull_step(trained, person)  # site-2 gave no answer: it keeps its model and stays out of the mix
    expected = softpull([scaled(person["site-1"], 2.0), scaled(person["site-3"], 2.0)], ctrl.cfg["fedsm"]["lam"])
    key = next(k for k, v in person["site-1"].items() if v.is_floating_point() and v.abs().sum() > 0)
    assert list(new) == ctrl.sites and new["site-2"] is person["site-2"]
    assert torch.allclose(new["site-1"][key], expected[0][key]) and torch.allclose(new["site-3"][key], expected[1][key])
    alone = ctrl.softpull_step({"site-1": trained["site-1"]}, person)  # one answer: nothing to pull towards
    assert torch.equal(alone["site-1"][key], scaled(person["site-1"], 2.0)[key]) and alone["site-3"] is person["site-3"]
    assert all(torch.equal(ctrl.state.person[s][k], held[s][k]) for s in held for k in held[s])


def test_fedsm_epoch_mode_takes_one_adam_step_on_the_sum_of_the_sites_gradients(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm={"selector_fit": "softmax", "selector_steps": "epoch"})
    before = dict(ctrl.state.selector)
    grad = {"site-1": 1.0, "site-2": 1.0, "site-3": -3.0}  # summed over each site's images: the pooled sum is -1
    n = {"site-1": 1, "site-2": 1, "site-3": 2}  # the aggregation weights: they must not enter a sum of gradients
    stub = Stub(ctrl, lambda site, data: FLModel(
        params={**models_of(data), **{k: torch.full_like(v, grad[site]) for k, v in ctrl.selector_ref.items()}},
        metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]}))
    ctrl.round(0)
    assert all(not any(k.startswith("moment.") for k in data.params) for _, _, data in stub.sent)  # moments stay here
    lr = ctrl.cfg["fedsm"]["selector_lr"]
    for k, v in before.items():  # first Adam step: -lr * g / (|g| + eps) = +lr for g = -1
        assert torch.allclose(ctrl.state.selector[k], v + lr, atol=1e-7), k
    moments = ctrl.state.moments
    assert float(moments["0.step"]) == 1.0 and torch.allclose(moments["0.exp_avg"], torch.tensor(-0.1))


def test_fedsm_lda_head_comes_from_the_summed_statistics_and_keeps_a_dropped_sites(tmp_path, monkeypatch):
    from pflseg.algorithms.fedsm import add_statistics, lda_head

    ctrl = make("fedsm", tmp_path, monkeypatch)  # the default: selector_fit lda
    body = {k: v for k, v in ctrl.state.selector.items() if not k.startswith("classifier.")}
    stub = Stub(ctrl, lambda site, data: lda_answer(ctrl, site, data))
    ctrl.round(0)
    stats = [unprefixed("stats", lda_answer(ctrl, s, stub.sent[0][2]).params) for s in ctrl.sites]
    weight, bias = lda_head(add_statistics(stats), ctrl.cfg["fedsm"]["lda_shrinkage"])
    assert (torch.allclose(ctrl.state.selector["classifier.weight"], weight)
            and torch.allclose(ctrl.state.selector["classifier.bias"], bias))
    assert all(torch.equal(ctrl.state.selector[k], v) for k, v in body.items())  # the conv stack stays as initialised
    Stub(ctrl, lambda site, data: None if site == "site-3" else lda_answer(ctrl, site, data))
    ctrl.round(1)
    # its statistics stay
    assert "site-3" in ctrl.missing and torch.allclose(ctrl.state.selector["classifier.weight"], weight)


def test_fedsm_extra_rounds_start_a_fresh_k_plus_one_class_selector_and_best(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm={"extra_rounds": 1}, rounds=1)
    ctrl.state.best_selector = {"round": 0, "score": 0.9}  # the K-class selector's best: not a candidate any more

    def reply(site, data):
        answer = lda_answer(ctrl, site, data)
        answer.params = {k: v for k, v in answer.params.items() if k.startswith("stats.")}
        answer.metrics = {"selector_loss": 1.0, "selector_val_acc": 0.5}
        return answer

    Stub(ctrl, reply)
    out = ctrl.round(1)
    # global + 3 sites
    assert ctrl.state.selector["classifier.weight"].shape == (4, ctrl.selector_ref["stats.gram"].shape[0])
    assert ctrl.state.best_selector["round"] == 1 and ctrl.state.best_selector["score"] == 0.5
    assert out.metrics == {"selector_loss": {s: 1.0 for s in ctrl.sites}, "selector_val_acc_mean": 0.5}


# ---- the final checkpoint and the inference job -------------------------------------------------------------------
def run_job(ctrl) -> None:
    """Every round of ``ctrl`` against its stubbed sites, checkpointed as the real run does, then its finish."""
    for r in range(ctrl.n_rounds()):
        ctrl.round(r)
        ctrl.store.save(r, ctrl.checkpoint(r))
    ctrl.finish()


def test_final_checkpoint_holds_the_tested_models(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch)
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()

    def reply(site, data):
        task = stub.sent[-1][0]
        if task == "train":  # every site returns what it got, scaled: the aggregate changes every round
            answer = lda_answer(ctrl, site, data)
            answer.params.update({k: v * 1.5 for k, v in answer.params.items() if k.startswith(("global.", "person."))
                                  and v.is_floating_point()})
            answer.metrics.update({"val_dice": 0.1, "val_dice_person": 0.1})
            return answer
        if task == "validate":  # the final aggregate scores best: it becomes the best global model only now
            return FLModel(params={}, metrics={"val_dice": 0.9, "val_dice_person": 0.9})
        return FLModel(params={}, metrics={"test": {"site": {"dice": 0.5}}})

    stub = Stub(ctrl, reply)
    run_job(ctrl)
    tested = unprefixed("global", next(d.params for t, _, d in stub.sent if t == "test"))
    final = ctrl.store.final()
    assert final["best"]["round"] == ctrl.n_rounds()  # the final validation's choice
    assert all(torch.equal(unprefixed("best", final)[k], tested[k]) for k in tested)
    stale = ctrl.store.load(ctrl.store.latest())["best"]["round"]
    assert stale < ctrl.n_rounds()  # the last round's checkpoint alone would hand out an older model
    person = unprefixed("bestperson.site-1", final)
    assert all(torch.equal(person[k], ctrl.state.person["site-1"][k]) for k in person)


def test_gamma_is_chosen_on_validation_never_on_test():
    def site(val, test):
        return {"validation": {g: {"dice": v} for g, v in val.items()},
                "super": {g: {"dice": v} for g, v in test.items()}}

    infer = {"site-1": site({"0.5": 0.8, "0.9": 0.6}, {"0.5": 0.1, "0.9": 0.9}),
             "site-2": site({"0.5": 0.7, "0.9": 0.6}, {"0.5": 0.2, "0.9": 0.9}),
             "site-3": {"super": {"0.5": {"dice": 0.3}, "0.9": {"dice": 0.4}}}}  # outside: no validation vote
    out = choose_gamma(infer)
    assert out["gamma_selected"] == 0.5  # test Dice would pick 0.9
    assert out["test_at_gamma"] == {"site-1": 0.1, "site-2": 0.2, "site-3": 0.3}
    assert choose_gamma({"site-1": {"super": {"extra": {"dice": 0.5}}}}) == {}


def nll_with_minimum_at(t_best: float) -> list[float]:
    return [100.0 + (math.log(t) - math.log(t_best)) ** 2 for t in TEMPERATURES]


def test_the_best_selector_by_validation_is_the_one_inference_loads(tmp_path, monkeypatch):
    # lda: the received selector changes as statistics change; a trained job's state folder inside the state root
    ctrl = make("fedsm", tmp_path, monkeypatch, folder=tmp_path / "server" / "fedsm")
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()
    # validation accuracy of the selector the sites received: random init (round 0), head from round 0's statistics
    # (round 1: the best), head from round 1's (the final selector, scored by the final validate task)
    acc = {0: 0.3, 1: 0.9, 2: 0.6}
    n = {"site-1": 4, "site-2": 4, "site-3": 4}

    def reply(site, data):
        task, r = stub.sent[-1][0], data.current_round
        if task == "train":
            answer = lda_answer(ctrl, site, data, shift=float(r))  # the statistics differ by round: so do the heads
            answer.metrics.update({"selector_val_acc": acc[r],
                                   "selector_val_nll": nll_with_minimum_at(2.0 if r == 1 else 0.5),
                                   "val_dice_person": 0.1})
            answer.meta["NUM_STEPS_CURRENT_ROUND"] = n[site]
            return answer
        if task == "validate":
            assert unprefixed("select", data.params)  # the final selector is a candidate too
            return FLModel(params={}, metrics={"val_dice": 0.1, "val_dice_person": 0.1, "selector_val_acc": acc[2],
                                               "selector_val_nll": nll_with_minimum_at(0.5)})
        return FLModel(params={}, metrics={"test": {"site": {"dice": 0.5}}})

    stub = Stub(ctrl, reply)
    run_job(ctrl)
    # round 1's, to every site
    received = [unprefixed("select", d.params) for t, _, d in stub.sent if t == "train"][3:6]
    final = ctrl.store.final()
    assert final["best_selector"]["round"] == 1 and final["best_selector"]["temperature"] == 2.0
    assert final["best_selector"]["input"] == ctrl.cfg["fedsm"]["selector_input"]
    best = unprefixed("bestselect", final)
    assert all(torch.equal(best[k], received[0][k]) for k in received[0])
    # not the last one
    assert not torch.equal(best["classifier.weight"], unprefixed("select", final)["classifier.weight"])
    results = json.loads((ctrl.store.root / "results.json").read_text())
    assert results["best_selector_round"] == 1

    cfg = load_job_config("fedsm_infer", overrides={**TINY, "fedsm": {"bundle": str(ctrl.store.root)}})
    infer = METHODS["fedsm_infer"].controller(config=cfg)
    infer.sample_clients = lambda: ["site-1", "site-2", "site-3", "site-4"]
    infer.get_run_dir = lambda: str(tmp_path / "run_infer")
    infer.info = infer.warning = infer.error = infer.panic = lambda msg: None
    sent = Stub(infer, lambda site, data: FLModel(params={}, metrics={"infer": {}})).sent
    infer.run()
    (_, _, msg), *_ = sent
    loaded = unprefixed("select", msg.params)
    assert all(torch.equal(loaded[k], best[k]) for k in best)
    assert msg.meta["selector_temperature"] == 2.0 and msg.meta["selector_input"] == ctrl.cfg["fedsm"]["selector_input"]


def test_selection_report_names_the_models_at_the_reference_and_the_chosen_gamma():
    def site(counts_09, counts_05):
        return {"super": {"0.9": {"dice": 0.7, "selected": counts_09}, "0.5": {"dice": 0.8, "selected": counts_05}}}

    infer = {"site-1": site([3, 5, 0], [0, 8, 0]), "site-3": site([10, 0, 2], [4, 0, 8])}
    out = selection_report(infer, ["site-1", "site-2"], reference=0.9, selected=0.5)["super_at_gamma"]
    assert out["reference"] == {"gamma": 0.9, "sites": {
        "site-1": {"dice": 0.7, "selected": {"global": 3, "site-1": 5, "site-2": 0}},
        "site-3": {"dice": 0.7, "selected": {"global": 10, "site-1": 0, "site-2": 2}}}}
    assert out["selected"]["gamma"] == 0.5
    assert out["selected"]["sites"]["site-3"]["selected"] == {"global": 4, "site-1": 0, "site-2": 8}
    assert selection_report({"site-1": {"super": {"extra": {}}}}, ["site-1"], 0.9, None) == {}


def trained_bundle(tmp_path, monkeypatch):
    """A FedSM (lda) run of three stubbed sites, finished: its final checkpoint holds ldastats.* and bestselect.*."""
    ctrl = make("fedsm", tmp_path, monkeypatch, folder=tmp_path / "server" / "fedsm")
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()

    def reply(site, data):
        task = stub.sent[-1][0]
        if task == "train":
            answer = lda_answer(ctrl, site, data)
            answer.metrics.update({"selector_val_acc": 0.9, "val_dice_person": 0.1})
            return answer
        if task == "validate":
            return FLModel(params={}, metrics={"val_dice": 0.1, "val_dice_person": 0.1})
        return FLModel(params={}, metrics={"test": {"site": {"dice": 0.5}}})

    stub = Stub(ctrl, reply)
    run_job(ctrl)
    return ctrl.store


VALIDATION_D2 = {"site-1": [1.0, 2.0, 3.0], "site-2": [4.0, 5.0], "site-3": [6.0, 7.0, 8.0, 9.0]}


def run_infer(store, tmp_path, **fedsm):
    """The fedsm_infer controller on the bundle, inside sites 1-3 and outside site-4, sites stubbed: what each site
    was sent (in order) and the results."""
    cfg = load_job_config("fedsm_infer", overrides={**TINY, "fedsm": {"bundle": str(store.root), **fedsm}})
    infer = METHODS["fedsm_infer"].controller(config=cfg)
    infer.sample_clients = lambda: ["site-1", "site-2", "site-3", "site-4"]
    infer.get_run_dir = lambda: str(tmp_path / "run_infer")
    infer.info = infer.warning = infer.error = infer.panic = lambda msg: said.append(msg)
    said = []

    def reply(site, data):
        result = {"super": {"0.9": {"dice": 0.7, "selected": [1, 2, 0, 0]}}, "inside": site != "site-4"}
        if site != "site-4":
            result["validation"] = {"0.9": {"dice": 0.8}}
            if unprefixed("familiar", data.params):
                result["validation_d2_min"] = VALIDATION_D2[site]
        elif "familiar_tau" in data.meta:
            result.update({"super_nofallback": {"0.9": {"dice": 0.6, "selected": [0, 3, 0, 0]}},
                           "fallback": {"tau": data.meta["familiar_tau"], "n_fallback": 1, "n_images": 3}})
        return FLModel(params={}, metrics={"infer": result})

    sent = Stub(infer, reply).sent
    infer.run()
    return sent, json.loads((infer.store.root / "results.json").read_text()), said


def test_infer_sets_tau_from_the_inside_validation_then_sends_it_to_the_outside_sites(tmp_path, monkeypatch):
    from pflseg.algorithms.fedsm import add_statistics, lda_gaussians

    store = trained_bundle(tmp_path, monkeypatch)
    sent, results, said = run_infer(store, tmp_path, familiar_quantile=0.5)
    assert [site for _, site, _ in sent] == ["site-1", "site-2", "site-3", "site-4"]  # inside first, then outside
    values = [v for d in VALIDATION_D2.values() for v in d]
    tau = float(torch.quantile(torch.tensor(values, dtype=torch.float64), 0.5))
    assert all("familiar_tau" not in msg.meta for _, site, msg in sent if site != "site-4")
    (outside,) = [msg for _, site, msg in sent if site == "site-4"]
    assert outside.meta["familiar_tau"] == tau == 5.0
    final = store.final()
    expected = lda_gaussians(add_statistics([unprefixed(f"ldastats.{s}", final)
                                             for s in ("site-1", "site-2", "site-3")]),
                             load_job_config("fedsm_infer")["fedsm"]["lda_shrinkage"])
    for _, _, msg in sent:  # the LDA's Gaussians of the bundle's statistics, to every site
        assert all(torch.equal(unprefixed("familiar", msg.params)[k], expected[k]) for k in ("mean", "precision"))
    fam = results["familiarity"]
    assert fam["enabled"] and fam["tau"] == 5.0 and fam["quantile"] == 0.5 and fam["n_validation"] == len(values)
    assert fam["sites"] == {"site-4": {"n_fallback": 1, "n_images": 3, "dice": 0.7, "dice_nofallback": 0.6}}
    assert results["test_at_gamma"]["site-4"] == 0.7  # the reported super model is the one with the fallback
    assert not any("validation_d2_min" in r for r in results["infer"].values())
    assert any("tau = 5" in line for line in said)


def test_infer_without_the_fallback_is_one_phase_and_says_why(tmp_path, monkeypatch):
    store = trained_bundle(tmp_path, monkeypatch)
    sent, results, said = run_infer(store, tmp_path, familiar_fallback=False)
    assert not any(unprefixed("familiar", msg.params) or "familiar_tau" in msg.meta for _, _, msg in sent)
    assert results["familiarity"]["enabled"] is False and "familiar_fallback" in results["familiarity"]["reason"]
    # a bundle without LDA statistics (a softmax selector): no fallback, said in the log
    final = store.final()
    torch.save({k: v for k, v in final.items() if not k.startswith("ldastats.")}, store.final_path)
    sent, results, said = run_infer(store, tmp_path / "again")
    assert not any(unprefixed("familiar", msg.params) or "familiar_tau" in msg.meta for _, _, msg in sent)
    assert "no LDA statistics" in results["familiarity"]["reason"]
    assert any("familiarity fallback: none" in line and "no LDA statistics" in line for line in said)


def test_familiar_quantile_out_of_range_is_named():
    from pflseg.flare.methods import method

    for bad in (0.0, 1.5):  # the method's own rule (its controller's check_config)
        with pytest.raises(ConfigError, match="fedsm.familiar_quantile"):
            method(load_job_config("fedsm_infer", overrides={"fedsm": {"familiar_quantile": bad}}))


def test_inference_without_a_bundle_ends_the_job_naming_the_key_and_the_fix(tmp_path, monkeypatch):
    """fedsm_infer on a folder that holds no FedSM checkpoint (the simulator run: -m extended in test_simulator.py)."""
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    bundle = tmp_path / "server" / "fedsm"  # a job's state folder on this server, without a checkpoint
    bundle.mkdir(parents=True)
    cfg = load_job_config("fedsm_infer", overrides={**TINY, "fedsm": {"bundle": str(bundle)}})
    infer = METHODS["fedsm_infer"].controller(config=cfg)
    infer.sample_clients = lambda: ["site-1", "site-2"]
    infer.get_run_dir = lambda: str(tmp_path / "run")
    said: list[str] = []
    infer.info = infer.warning = infer.error = lambda msg: None
    infer.panic = said.append
    sent = Stub(infer, lambda site, data: FLModel(params={}, metrics={"infer": {}})).sent
    infer.run()
    assert not sent and len(said) == 1
    assert "fedsm.bundle=" in said[0] and "holds no FedSM checkpoint" in said[0] and "state/server/fedsm" in said[0]
