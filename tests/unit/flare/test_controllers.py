"""Controllers with a stubbed transport: what each site is sent, and what the server makes of the answers."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedbn import shared_keys
from pflseg.config import load_job_config
from pflseg.flare.controllers.base import RoundError, check_update
from pflseg.flare.methods import METHODS
from pflseg.flare.state import RoundStore, prefixed, unprefixed
from pflseg.nets import build_net

TINY = {"net": {"channels": [4, 8], "strides": [2]}, "rounds": 2}


class Stub:
    """Replaces FLARE's send: records payloads, answers with ``reply(site, payload)``."""

    def __init__(self, controller, reply):
        self.sent, self.scalars = [], []
        controller.send_model = self.send_model
        controller.log_scalars = lambda tag, values, step: self.scalars.append((tag, values, step))
        controller.get_num_standing_tasks = lambda: 0
        self.reply = reply

    def send_model(self, task_name, data, targets, timeout, callback):
        (site,) = targets
        self.sent.append((task_name, site, data))
        answer = self.reply(site, data)
        if answer is not None:
            answer.meta["client_name"] = site
            callback(answer)


def make(method, tmp_path, monkeypatch, **over):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    cfg = load_job_config(method, overrides={**TINY, **over})
    ctrl = METHODS[method].controller(config=cfg)
    ctrl.cfg = cfg
    ctrl.sites = ["site-1", "site-2", "site-3"]
    ctrl.store = RoundStore(tmp_path / "server")
    ctrl.missing = {}
    ctrl.size_net()
    ctrl.restore()
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    return ctrl


def scaled(state, factor):
    return {k: (v * factor if v.is_floating_point() else v) for k, v in state.items()}


def test_fedavg_round_is_the_nk_weighted_mean(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    g0 = dict(ctrl.global_state)
    n = {"site-1": 1, "site-2": 1, "site-3": 2}
    factor = {"site-1": 1.0, "site-2": 2.0, "site-3": 3.0}

    def reply(site, data):
        state = unprefixed("global", data.params)
        return FLModel(params=prefixed("global", scaled(state, factor[site])), metrics={"val_dice": 0.5},
                       meta={"NUM_STEPS_CURRENT_ROUND": n[site]})

    stub = Stub(ctrl, reply)
    ctrl.round(0)
    assert [s for _, s, _ in stub.sent] == ctrl.sites
    assert all(torch.equal(unprefixed("global", d.params)[k], g0[k]) for _, _, d in stub.sent for k in g0)
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    expected = g0[key] * (0.25 * 1 + 0.25 * 2 + 0.5 * 3)
    assert torch.allclose(ctrl.global_state[key], expected, atol=1e-6)


def test_nan_and_misshaped_updates_are_left_out_and_named(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    key = next(k for k, v in ctrl.global_state.items() if v.is_floating_point())

    def reply(site, data):
        state = dict(unprefixed("global", data.params))
        if site == "site-2":
            state[key] = torch.full_like(state[key], float("nan"))
        if site == "site-3":
            state[key] = torch.zeros(1)
        return FLModel(params=prefixed("global", state), metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    with pytest.raises(RoundError, match="site-2.*NaN|site-3.*shape"):
        ctrl.round(0)  # min_clients = 2 but only site-1 is usable
    assert set(ctrl.missing) == {"site-2", "site-3"}
    assert "NaN" in ctrl.missing["site-2"] and "shape" in ctrl.missing["site-3"]


def test_missing_site_round_completes_with_min_clients(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)

    def reply(site, data):
        if site == "site-3":
            return None  # died
        return FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(0)
    assert "site-3" in ctrl.missing


def test_fedbn_sends_and_averages_only_shared_keys(tmp_path, monkeypatch):
    ctrl = make("fedbn", tmp_path, monkeypatch)
    shared = set(shared_keys(build_net(ctrl.cfg["net"])))
    assert shared != set(ctrl.global_state)
    g0 = dict(ctrl.global_state)

    def reply(site, data):
        assert set(unprefixed("global", data.params)) == shared
        return FLModel(params=prefixed("global", scaled(unprefixed("global", data.params), 2.0)),
                       metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(0)
    for k in g0:
        if k in shared and g0[k].is_floating_point():
            assert torch.allclose(ctrl.global_state[k], 2 * g0[k])
        elif k not in shared:
            assert torch.equal(ctrl.global_state[k], g0[k])


def test_fedbn_refuses_a_net_without_batch_norm():
    from pflseg.config import ConfigError
    from pflseg.flare.methods import method

    with pytest.raises(ConfigError, match=r"fedbn.*net\.norm='instance'.*net\.norm: batch"):
        method(load_job_config("fedbn", overrides={"net": {"norm": "instance"}}))


def test_local_sends_initial_model_once_and_aggregates_nothing(tmp_path, monkeypatch):
    ctrl = make("local", tmp_path, monkeypatch)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params={}, metrics={"val_dice": 0.1}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    g0 = dict(ctrl.global_state)
    ctrl.round(0)
    ctrl.round(1)
    assert all(d.params for t, s, d in stub.sent[:3]) and not any(d.params for t, s, d in stub.sent[3:])
    assert all(torch.equal(ctrl.global_state[k], g0[k]) for k in g0)


def test_centralized_trains_at_one_site(tmp_path, monkeypatch):
    ctrl = make("centralized", tmp_path, monkeypatch)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params=data.params, metrics={"val_dice": 0.3}, meta={"NUM_STEPS_CURRENT_ROUND": 9}))
    ctrl.round(0)
    assert [s for _, s, _ in stub.sent] == ["site-1"]


def test_best_global_follows_weighted_validation(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    dice = {"site-1": 0.2, "site-2": 0.8, "site-3": 0.8}
    Stub(ctrl, lambda site, data: FLModel(params=data.params, metrics={"val_dice": dice[site]},
                                          meta={"NUM_STEPS_CURRENT_ROUND": 1 if site == "site-1" else 3}))
    ctrl.round(0)
    assert ctrl.best["round"] == 0 and set(ctrl.best_state) == set(ctrl.global_state)
    assert ctrl.best["score"] == pytest.approx((0.2 * 1 + 0.8 * 3 + 0.8 * 3) / 7)


def test_check_update_reasons():
    ref = {"global.w": torch.zeros(2)}
    assert check_update({"global.w": torch.ones(2)}, ref) is None
    assert "unexpected" in check_update({"global.v": torch.ones(2)}, ref)
    assert "shape" in check_update({"global.w": torch.ones(3)}, ref)
    assert "Inf" in check_update({"global.w": torch.tensor([1.0, float("inf")])}, ref)


# the paper's per-batch steps: weights and moments averaged
BATCH = {"selector_fit": "softmax", "selector_steps": "batch"}


def test_fedsm_sends_each_site_only_its_own_personalized_model_and_label(tmp_path, monkeypatch):
    from pflseg.algorithms.softpull import softpull

    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    ctrl.person = {s: scaled(ctrl.global_state, i + 1.0) for i, s in enumerate(ctrl.sites)}
    n = {"site-1": 1, "site-2": 1, "site-3": 2}

    def reply(site, data):
        params = dict(data.params)  # every moment key: an answer without all of them is left out
        params.update({k: torch.full_like(v, float(n[site])) for k, v in ctrl.moment_ref.items()})
        return FLModel(params=params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]})

    before = {s: dict(p) for s, p in ctrl.person.items()}
    stub = Stub(ctrl, reply)
    ctrl.round(0)
    key = next(k for k, v in ctrl.global_state.items() if v.is_floating_point() and v.abs().sum() > 0)
    for k, (_, site, data) in enumerate(stub.sent):
        assert data.meta["selector_label"] == k
        assert torch.equal(unprefixed("person", data.params)[key], before[site][key])  # its own, nobody else's
    assert ctrl.moments["0.exp_avg"].flatten()[0].item() == pytest.approx(0.25 * 1 + 0.25 * 1 + 0.5 * 2)
    expected = softpull([before[s] for s in ctrl.sites], ctrl.cfg["fedsm"]["lam"])
    for k, s in enumerate(ctrl.sites):
        assert torch.allclose(ctrl.person[s][key], expected[k][key])


def test_fedsm_site_that_drops_out_keeps_its_personalized_model(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm=BATCH)
    ctrl.person["site-3"] = scaled(ctrl.global_state, 5.0)
    kept = dict(ctrl.person["site-3"])
    moments = {k: torch.ones_like(v) for k, v in ctrl.moment_ref.items()}
    Stub(ctrl, lambda site, data: None if site == "site-3" else
         FLModel(params={**data.params, **moments}, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    assert "site-3" in ctrl.missing
    assert all(torch.equal(ctrl.person["site-3"][k], kept[k]) for k in kept)


def models_of(data) -> dict:
    """What a FedSM site sends back of the models it received (the global and its personalized model)."""
    return {k: v for k, v in data.params.items() if k.startswith(("global.", "person."))}


def test_fedsm_epoch_mode_takes_one_adam_step_on_the_sum_of_the_sites_gradients(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm={"selector_fit": "softmax", "selector_steps": "epoch"})
    before = dict(ctrl.selector)
    grad = {"site-1": 1.0, "site-2": 1.0, "site-3": -3.0}  # summed over each site's images: the pooled sum is -1
    n = {"site-1": 1, "site-2": 1, "site-3": 2}  # the aggregation weights: they must not enter a sum of gradients
    stub = Stub(ctrl, lambda site, data: FLModel(
        params={**models_of(data), **{k: torch.full_like(v, grad[site]) for k, v in ctrl.selector_ref.items()}},
        metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]}))
    ctrl.round(0)
    assert all(not any(k.startswith("moment.") for k in data.params) for _, _, data in stub.sent)  # moments stay here
    lr = ctrl.cfg["fedsm"]["selector_lr"]
    for k, v in before.items():  # first Adam step: -lr * g / (|g| + eps) = +lr for g = -1
        assert torch.allclose(ctrl.selector[k], v + lr, atol=1e-7), k
    assert float(ctrl.moments["0.step"]) == 1.0 and torch.allclose(ctrl.moments["0.exp_avg"], torch.tensor(-0.1))


def lda_answer(ctrl, site, data, shift=0.0):
    """A site's lda answer: features of its 4 images all equal to e_k (+ shift), its class k."""
    ref, k = ctrl.selector_ref, ctrl.sites.index(site)
    d = ref["stats.gram"].shape[0]
    phi = torch.zeros(4, d, dtype=torch.float64)
    phi[:, k] = 1.0 + shift
    phi[:2, -1] += 0.5  # some spread within the site
    stats = {"gram": phi.T @ phi, "sum": torch.zeros_like(ref["stats.sum"]),
             "count": torch.zeros_like(ref["stats.count"])}
    stats["sum"][k], stats["count"][k] = phi.sum(0), 4.0
    return FLModel(params={**models_of(data), **prefixed("stats", stats)}, metrics={"val_dice": 0.5},
                   meta={"NUM_STEPS_CURRENT_ROUND": 4})


def test_fedsm_lda_head_comes_from_the_summed_statistics_and_keeps_a_dropped_sites(tmp_path, monkeypatch):
    from pflseg.algorithms.fedsm import add_statistics, lda_head

    ctrl = make("fedsm", tmp_path, monkeypatch)  # the default: selector_fit lda
    body = {k: v for k, v in ctrl.selector.items() if not k.startswith("classifier.")}
    stub = Stub(ctrl, lambda site, data: lda_answer(ctrl, site, data))
    ctrl.round(0)
    stats = [unprefixed("stats", lda_answer(ctrl, s, stub.sent[0][2]).params) for s in ctrl.sites]
    weight, bias = lda_head(add_statistics(stats), ctrl.cfg["fedsm"]["lda_shrinkage"])
    assert (torch.allclose(ctrl.selector["classifier.weight"], weight)
            and torch.allclose(ctrl.selector["classifier.bias"], bias))
    assert all(torch.equal(ctrl.selector[k], v) for k, v in body.items())  # the conv stack stays as initialised
    Stub(ctrl, lambda site, data: None if site == "site-3" else lda_answer(ctrl, site, data))
    ctrl.round(1)
    # its statistics stay
    assert "site-3" in ctrl.missing and torch.allclose(ctrl.selector["classifier.weight"], weight)


def test_grace_identical_updates_give_uniform_weights_and_fedavg(tmp_path, monkeypatch):
    ctrl = make("grace", tmp_path, monkeypatch)
    g0 = dict(ctrl.global_state)
    stub = Stub(ctrl, lambda site,
                data: FLModel(params=prefixed("global", scaled(unprefixed("global", data.params), 2.0)),
                                                 metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    weights = ctrl.round_metrics["grace_weights"]
    assert stub.scalars == [("grace_weight", weights, 0)]  # TensorBoard, tb_events/<server name>
    assert sorted(weights) == ctrl.sites and all(w == pytest.approx(1 / 3) for w in weights.values())
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0 and "adn" not in k)
    assert torch.allclose(ctrl.global_state[key], 2 * g0[key], atol=1e-6)


def test_grace_needs_two_sites(tmp_path, monkeypatch):
    ctrl = make("grace", tmp_path, monkeypatch)
    ctrl.sites = ["site-1"]
    with pytest.raises(ValueError, match="at least 2"):
        ctrl.restore()


def test_a_site_that_gave_no_result_is_sent_the_next_round_and_counts_when_it_answers(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    g0 = dict(ctrl.global_state)
    factor = {"site-1": 1.0, "site-2": 1.0, "site-3": 4.0}

    def reply(site, data):
        if site == "site-3" and data.current_round == 0:
            return None  # timed out / crashed in round 0
        return FLModel(params=prefixed("global", scaled(unprefixed("global", data.params), factor[site])),
                       metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    stub = Stub(ctrl, reply)
    ctrl.round(0)
    assert "site-3" in ctrl.missing and set(ctrl.round_metrics["val_dice"]) == {"site-1", "site-2"}
    g1 = dict(ctrl.global_state)
    ctrl.round(1)
    assert [s for t, s, d in stub.sent if d.current_round == 1] == ["site-1", "site-2", "site-3"]  # re-admitted
    assert set(ctrl.round_metrics["val_dice"]) == {"site-1", "site-2", "site-3"}
    key = next(k for k, v in g0.items() if v.is_floating_point() and v.abs().sum() > 0)
    assert torch.allclose(ctrl.global_state[key], g1[key] * (1 + 1 + 4) / 3, atol=1e-6)  # site-3 in round 1's mean


def test_a_site_that_fails_again_is_left_out_of_that_round_again(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    Stub(ctrl, lambda site, data: None if site == "site-3" else
         FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    for r in range(2):
        ctrl.round(r)
        assert set(ctrl.round_metrics["val_dice"]) == {"site-1", "site-2"} and "site-3" in ctrl.missing


def test_the_default_task_timeout_is_finite():
    assert 0 < load_job_config("fedavg")["task_timeout"] <= 24 * 3600


class Ctx:
    def __init__(self, job_id):
        self.job_id = job_id

    def get_job_id(self):
        return self.job_id


def server(tmp_path, monkeypatch, job_id, **over):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    ctrl = METHODS["fedavg"].controller(config=load_job_config("fedavg", overrides={**TINY, **over}))
    ctrl.fl_ctx = Ctx(job_id)
    ctrl.sample_clients = lambda: ["site-1", "site-2"]
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    return ctrl, panics


def test_the_server_claims_its_state_folder_for_the_job_id(tmp_path, monkeypatch):
    from pflseg.flare.state import owner, release

    folder = tmp_path / "server" / "fedavg"
    first, _ = server(tmp_path, monkeypatch, "job-a")
    assert first.setup() == 0 and owner(folder) == "job-a"
    first.store.save(0, {"round": 0})
    second, panics = server(tmp_path, monkeypatch, "job-b")
    assert second.setup() is None  # job-a still runs: job-b ends at once
    assert f"state folder {folder} is in use by job job-a" in panics[0]
    release(folder)  # job-a ends
    third, panics = server(tmp_path, monkeypatch, "job-b")
    try:
        assert third.setup() == 0 and not panics and owner(folder) == "job-b"
        assert (tmp_path / "server" / "fedavg.job-a" / "round_0000.pt").is_file() and third.store.rounds() == []
    finally:
        release(folder)


def test_fedsm_extra_rounds_start_a_fresh_k_plus_one_class_selector_and_best(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm={"extra_rounds": 1}, rounds=1)
    ctrl.best_selector = {"round": 0, "score": 0.9}  # the K-class selector's best: not a candidate any more

    def reply(site, data):
        answer = lda_answer(ctrl, site, data)
        answer.params = {k: v for k, v in answer.params.items() if k.startswith("stats.")}
        answer.metrics = {"selector_loss": 1.0, "selector_val_acc": 0.5}
        return answer

    Stub(ctrl, reply)
    ctrl.round(1)
    assert ctrl.selector["classifier.weight"].shape == (4, ctrl.selector_ref["stats.gram"].shape[0])  # global + 3 sites
    assert ctrl.best_selector["round"] == 1 and ctrl.best_selector["score"] == 0.5


def test_resume_with_another_network_says_the_config_no_longer_matches_the_checkpoint(tmp_path, monkeypatch):
    first = make("fedavg", tmp_path, monkeypatch)
    first.store.save(0, first.checkpoint(0))
    assert make("fedavg", tmp_path, monkeypatch, resume=True).restore() == 1  # the same network resumes
    with pytest.raises(ValueError, match=r"config no longer matches the checkpoint .*(in the checkpoint|now)"):
        make("fedavg", tmp_path, monkeypatch, resume=True, net={"channels": [4, 8, 16], "strides": [2, 2]})


def test_an_optimizer_state_of_another_network_is_named_not_torchs_error():
    from pflseg.train.loop import build_optimizer

    state = build_optimizer(build_net({"channels": [4, 8], "strides": [2]}), torch.device("cpu"), 1e-3).state_dict()
    with pytest.raises(ValueError, match="config no longer matches the checkpoint"):
        build_optimizer(build_net({"channels": [4, 8, 16], "strides": [2, 2]}), torch.device("cpu"), 1e-3, state)
