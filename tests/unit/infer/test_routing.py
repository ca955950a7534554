import copy

import pytest
import torch
from torch import nn

from pflseg.algorithms.routing import build_routed_model, loss_weights, router_parameters, use_batch_stats
from pflseg.config import ConfigError, load_job_config
from pflseg.infer.routing import (
    METHODS,
    StaticComparators,
    adapt,
    budget,
    choose_lr,
    final_loss,
    route_site,
    settings,
    tent,
)
from pflseg.nets import build_net
from pflseg.train.loop import make_loader, seed_everything

NET = {"channels": [4, 8], "strides": [2], "num_res_units": 0}
CFG = {"router": "paper", "loss_weights": "paper", "beta": 0.01, "noise_std": 0.5, "rot_flip": False, "shape_radius": 1,
       "epochs": 1, "steps": 0, "lr": 1e-3, "lr_grid": [], "lr_trial_steps": 0, "batch_size": 2, "norm_affine": False,
       "rest": None}


def sample(case, labelled):
    torch.manual_seed(len(case))
    return {"image": torch.randn(1, 16, 16), "label": (torch.rand(1, 16, 16) > 0.5).float(), "case": case, "slice": 0,
            "site": "site-9", "has_label": labelled}


def nets(n=3):
    """n tiny UNets with distinct weights and running statistics far from any test batch's."""
    out = []
    for i in range(n):
        torch.manual_seed(i)
        net = build_net(NET)
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.2, 3)
        out.append(net)
    return out


def test_route_site_scores_every_method_and_writes_png_for_2d_images(tmp_path):
    experts = nets()
    data = [sample("a", True), sample("bb", True), sample("ccc", False)]  # one 2D image per case, one unlabeled
    res = route_site(experts[:2], experts[2], data, "cpu", CFG, out_dir=tmp_path / "pred")
    assert sorted(res["methods"]) == sorted(METHODS) and res["n_images"] == 3
    assert res["norm"] == {"global": "running", "average": "running", "ensemble": "running", "global_bn": "batch",
                           "average_bn": "batch", "ensemble_bn": "batch", "tent": "batch", "tent_epochs": "batch",
                           "tent_average": "batch", "routing_global": "batch", "routing_layer": "batch",
                           "routing": "batch", "routing_final": "batch"}
    for m in res["methods"].values():
        assert 0 <= m["dice"] <= 1 and sorted(m["per_case"]) == ["a", "bb"]  # labels only score
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == ["a.png", "bb.png", "ccc.png"]


def test_comparators_with_batch_statistics_are_the_routed_models_at_step_zero():
    # prepare
    experts, x = nets(), torch.randn(4, 1, 16, 16)
    w_g = experts[-1]
    # execute
    static = StaticComparators(experts)(x)
    only_w_g = StaticComparators([w_g])(x)
    # assert: FedAvg + batch statistics = routing over experts all equal to w_g; average_bn = routing's start
    assert torch.allclose(only_w_g["global_bn"], torch.sigmoid(build_routed_model([w_g, w_g, w_g]).eval()(x)),
                          atol=1e-5)
    assert torch.allclose(static["global_bn"], only_w_g["global_bn"])
    assert torch.allclose(static["average_bn"], torch.sigmoid(build_routed_model(experts).eval()(x)), atol=1e-5)
    # the two treatments really differ, and the running one is the model as trained
    assert not torch.allclose(static["global"], static["global_bn"], atol=1e-3)
    assert torch.allclose(static["global"], torch.sigmoid(w_g.eval()(x)))


def test_online_tent_is_one_pass_predicting_each_batch_before_its_update():
    # prepare
    torch.manual_seed(0)
    w_g, data = build_net(NET), [sample("c" * n, True) for n in range(1, 7)]
    cfg = {**CFG, "lr": 0.5}  # large steps: predicting after the update would change the masks
    # execute
    model = copy.deepcopy(w_g)
    best = tent(model, data, "cpu", cfg, seed=3)["best"]
    # a plain Tent loop: batch statistics, Adam on the norm layers' affine parameters, mean binary entropy
    ref = use_batch_stats(copy.deepcopy(w_g)).requires_grad_(False)
    affine = [p for m in ref.modules() if isinstance(m, nn.BatchNorm2d) for p in (m.weight, m.bias)]
    for p in affine:
        p.requires_grad_(True)
    opt = torch.optim.Adam(affine, lr=cfg["lr"])
    before, after = {}, {}
    for batch in make_loader(data, cfg["batch_size"], shuffle=True, seed=3):
        keys = [(s, c, int(i)) for s, c, i in zip(batch["site"], batch["case"], batch["slice"])]
        p = torch.sigmoid(ref(batch["image"])).clamp(1e-6, 1 - 1e-6)
        before.update(zip(keys, p > 0.5))
        opt.zero_grad()
        (-(p * p.log() + (1 - p) * (1 - p).log())).mean().backward()
        opt.step()
        with torch.no_grad():
            after.update(zip(keys, torch.sigmoid(ref(batch["image"])) > 0.5))
    # assert: same predictions, same final parameters (only the affine ones moved)
    assert all(m.running_mean is None for m in model.modules() if isinstance(m, nn.BatchNorm2d))  # batch statistics
    assert sorted(best.pred) == sorted(before) and len(before) == len(data)
    assert all(torch.equal(best.pred[k], before[k]) for k in before)
    assert any(not torch.equal(best.pred[k], after[k]) for k in after)  # the test tells before from after
    for (name, got), want, orig in zip(model.named_parameters(), ref.parameters(), w_g.parameters()):
        assert torch.allclose(got, want, atol=1e-6), name
        assert torch.equal(got, orig) != isinstance(model.get_submodule(name.rpartition(".")[0]), nn.BatchNorm2d), name


def test_at_zero_learning_rate_every_batch_statistics_method_predicts_as_global_bn():
    # prepare: every expert is w_g and nothing moves, so only the treatment and the batches can differ
    w_g = nets(1)[0]
    data = [sample("c" * n, True) for n in range(1, 6)]  # 5 images in batches of 2, shuffled
    # execute
    res = route_site([w_g, w_g], w_g, data, "cpu", {**CFG, "lr": 0.0, "epochs": 1})
    # assert
    per_case = {m: r["per_case"] for m, r in res["methods"].items()}
    for m in METHODS:
        if res["norm"][m] == "batch":
            assert per_case[m] == per_case["global_bn"], m
        else:
            assert per_case[m] == per_case["global"], m
    assert per_case["global"] != per_case["global_bn"]


def test_a_list_of_comparators_scores_routing_and_those_only_and_an_unknown_name_is_refused():
    experts, data = nets(), [sample("a", True), sample("bb", True)]
    res = route_site(experts[:2], experts[2], data, "cpu", {**CFG, "steps": 1}, comparators=["global_bn", "tent"])
    assert sorted(res["methods"]) == ["global_bn", "routing", "routing_final", "tent"]
    assert sorted(res["coefficients"]) == ["routing"]
    with pytest.raises(ValueError, match=r"iopfl.comparators: unknown \['tnet'\]"):
        route_site(experts[:2], experts[2], data, "cpu", CFG, comparators=["tnet"])


def test_route_site_reports_the_learned_mix_per_layer_in_expert_order(tmp_path):
    experts = nets()
    res = route_site(experts[:2], experts[2], [sample("a", True), sample("bb", True)], "cpu",
                     {**CFG, "router": "normalised"})
    assert sorted(res["coefficients"]) == ["routing", "routing_global", "routing_layer"]
    for name, c in res["coefficients"].items():
        assert len(c["mean"]) == 3 and all(len(layer) == 3 for layer in c["layers"])  # P_1, P_2, w_g
        assert abs(sum(c["mean"]) - 1) < 1e-5, name  # normalised mixes
    one = res["coefficients"]["routing_global"]["layers"]
    assert all(layer == one[0] for layer in one)  # the paper's Global: one vector shared by every layer


def test_the_step_budget_follows_the_config():
    # prepare: 5 images in batches of 2 = 3 steps a pass
    experts, data = nets(), [sample("c" * n, True) for n in range(1, 6)]
    assert budget(5, {**CFG, "epochs": 2}) == 6 and budget(5, {**CFG, "epochs": 2, "steps": 7}) == 7
    for cfg, want, visits in (({**CFG, "epochs": 2}, 6, 10), ({**CFG, "epochs": 2, "steps": 7}, 7, 12)):
        routed = build_routed_model(experts)
        # execute
        run = adapt(routed, router_parameters(routed), data, "cpu", loss_weights("paper"), cfg, 0, 1e-3,
                    budget(len(data), cfg))
        # assert: that many steps, pass after pass (5 images a pass: 6 steps = 2 passes, 7 = 2 passes + 1 batch)
        assert run["steps"] == want and run["visits"] == visits
    res = route_site(experts[:2], experts[2], data, "cpu", {**CFG, "steps": 4}, comparators=[])
    assert res["diagnostics"]["adaptation"]["routing"]["steps"] == 4 and res["diagnostics"]["settings"]["steps"] == 4


def test_adam_takes_exactly_the_configured_steps():
    experts, data = nets(), [sample("c" * n, True) for n in range(1, 6)]
    routed = build_routed_model(experts)
    seen = []
    original = torch.optim.Adam.step

    def counting(self, *a, **k):
        seen.append(1)
        return original(self, *a, **k)

    torch.optim.Adam.step = counting
    try:
        adapt(routed, router_parameters(routed), data, "cpu", loss_weights("paper"), CFG, 0, 1e-3, 5)
    finally:
        torch.optim.Adam.step = original
    assert len(seen) == 5


def test_choose_lr_keeps_the_rate_of_lowest_final_loss_and_never_a_non_finite_one():
    trials = {1e-3: (0.5, 0.2), 1e-2: (0.2, 0.1), 1e-1: (float("nan"), 0.2)}
    lr, table = choose_lr([1e-3, 1e-2, 1e-1], trials.get)
    assert lr == 1e-2 and [(x["lr"], x["final_loss"], x["foreground"]) for x in table][:2] == [(1e-3, 0.5, 0.2),
                                                                                             (1e-2, 0.2, 0.1)]
    assert choose_lr([1e-3, 1e-2], {1e-3: (0.1, 0.2), 1e-2: (0.1, 0.2)}.get)[0] == 1e-3  # ties keep the first
    with pytest.raises(FloatingPointError, match="lr_grid"):
        choose_lr([1e-3], lambda lr: (float("inf"), 0.2))


def test_the_removed_collapse_guard_is_an_unknown_key():
    with pytest.raises(ConfigError, match=r"unknown key 'iopfl\.lr_guard'"):
        load_job_config("iopfl_route", overrides={"iopfl": {"lr_guard": 0.1}})


@pytest.mark.parametrize("trial_steps", [0, 2])  # trials of the whole budget (6 steps), or of 2 steps then a full run
def test_the_rate_routing_keeps_is_the_one_of_lowest_final_unsupervised_loss(trial_steps):
    # prepare
    experts, data = nets(), [sample("c" * n, True) for n in range(1, 6)]
    cfg = {**CFG, "router": "normalised", "lr_grid": [1e-3, 1e-1, 1.0], "epochs": 2, "lr_trial_steps": trial_steps}
    # execute
    res = route_site(experts[:2], experts[2], data, "cpu", cfg, comparators=[])
    run = res["diagnostics"]["adaptation"]["routing"]
    # assert: the chosen rate is the grid's argmin, and its loss is the final loss of a run at that rate
    grid = run["lr_grid"]
    assert [x["lr"] for x in grid] == [1e-3, 1e-1, 1.0] and len({x["final_loss"] for x in grid}) == 3
    assert run["lr"] == min(grid, key=lambda x: x["final_loss"])["lr"]
    weights = loss_weights("paper")
    for entry in grid:
        seed_everything(0)
        routed = build_routed_model(experts, router="normalised")
        adapt(routed, router_parameters(routed), data, "cpu", weights, cfg, 0, entry["lr"], trial_steps or 6)
        assert final_loss(routed, data, "cpu", weights, cfg, 0)[0] == pytest.approx(entry["final_loss"], rel=1e-6)
    assert run["steps"] == 6
    if not trial_steps:  # the winner's run is kept
        assert run["final_loss"] == pytest.approx(min(x["final_loss"] for x in grid), rel=1e-6)


def test_diagnostics_report_experts_movement_and_the_start():
    # prepare
    experts, data = nets(), [sample("a", True), sample("bb", True), sample("ccc", True)]
    # execute
    moved = route_site(experts[:2], experts[2], data, "cpu", {**CFG, "lr": 0.5})
    still = route_site(experts[:2], experts[2], data, "cpu", {**CFG, "lr": 0.0})
    # assert: each expert alone, under both treatments; w_g alone is FedAvg; distances relative to w_g
    d = moved["diagnostics"]
    assert d["experts"]["names"] == ["P_1", "P_2", "w_g"]
    assert d["experts"]["dice"][-1] == moved["methods"]["global"]["dice"]
    assert d["experts"]["dice_bn"][-1] == moved["methods"]["global_bn"]["dice"]
    assert d["experts"]["relative_distance"][-1] == 0 and min(d["experts"]["relative_distance"][:2]) > 0
    # routing at step 0, same treatment, is average_bn; reported next to routing
    assert d["start"]["routing_step0"] == d["start"]["average_bn"] == moved["methods"]["average_bn"]["dice"]
    assert d["start"]["routing"] == moved["methods"]["routing"]["dice"]
    assert 0.0 <= d["adaptation"]["routing"]["agreement"] < 1.0  # the adapted predictions' Dice with the start's
    # coefficient movement per routed layer: none at lr 0, some at lr 0.5
    for name in ("routing", "routing_global", "routing_layer"):
        n_layers = len(moved["coefficients"][name]["layers"])
        assert len(moved["coefficients"][name]["movement"]) == n_layers
        assert still["coefficients"][name]["movement"] == [0.0] * n_layers
        assert moved["coefficients"][name]["movement_mean"] > 0.001
    assert still["diagnostics"]["adaptation"]["routing"]["final_loss"] == pytest.approx(
        still["diagnostics"]["adaptation"]["routing"]["start_loss"])


def test_refcode_profile_fills_what_the_config_leaves_open():
    refcode = settings({**CFG, "router": "refcode", "loss_weights": None, "norm_affine": None, "rot_flip": None})
    assert {k: refcode[k] for k in ("loss_weights", "norm_affine", "rot_flip", "rest")} == {
        "loss_weights": "refcode", "norm_affine": True, "rot_flip": True, "rest": "global"}
    own = settings({**CFG, "router": "refcode", "loss_weights": None, "norm_affine": False, "rot_flip": None})
    assert own["norm_affine"] is False and own["lr_grid"] == [CFG["lr"]]  # an explicit value wins
    paper = settings({**CFG, "loss_weights": None, "norm_affine": None, "rot_flip": None, "lr_grid": [0.1, 0.01]})
    assert ((paper["loss_weights"], paper["norm_affine"], paper["rot_flip"], paper["rest"])
            == ("paper", False, False, "average"))
    assert paper["lr_grid"] == [0.1, 0.01] and not paper["normalised"]
    # the rate: every variant keeps iopfl.lr (chosen on validation outside sites); a grid only when set
    open_grid = {**CFG, "lr_grid": None}
    for router in ("paper", "refcode", "normalised"):
        assert settings({**open_grid, "router": router})["lr_grid"] == [CFG["lr"]], router
    assert settings({**open_grid, "router": "normalised"})["normalised"]
