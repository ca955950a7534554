import copy
from functools import partial

import pytest
import torch
from torch import nn

from pflseg.algorithms.alignment import DomainDiscriminator, adversarial_alignment, coral, mmd
from pflseg.algorithms.grace_meta import feature_layer, frozen_features, inner_update, meta_step, unet_features
from pflseg.nets import build_unet
from pflseg.train import Hooks, build_loss, train_epochs


def tiny_unet(seed=0, norm="batch"):
    torch.manual_seed(seed)
    return build_unet({"channels": [4, 8], "strides": [2], "norm": norm})


def make_batch(b=4, seed=0, size=16):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(b, 1, size, size, generator=gen)
    return {"image": image, "label": (image > 0.3).float()}


class TinyNet(nn.Module):
    """Conv -> ReLU -> 1x1 head: a small model whose step is easy to redo by hand."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Conv2d(3, 1, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- features --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_res_units", [0, 1])
def test_feature_layer_is_the_top_transposed_conv_and_features_are_full_resolution(num_res_units):
    net = build_unet({"channels": [4, 8], "strides": [2], "num_res_units": num_res_units})
    layer = feature_layer(net)
    assert isinstance(layer, nn.ConvTranspose2d) and layer.out_channels == 1
    images = torch.randn(2, 1, 16, 16)
    feats, logits = unet_features(net, images)
    assert feats.shape == (2, layer.in_channels, 16, 16) and layer.in_channels > 1
    assert logits.shape == (2, 1, 16, 16)
    native, _ = unet_features(net, images, full_resolution=False)
    assert native.shape == (2, layer.in_channels, 8, 8)
    assert torch.equal(feats[..., ::2, ::2], native)  # nearest: every native pixel repeated
    assert not any(m._forward_pre_hooks for m in net.modules())  # the hook is removed again


def test_feature_layer_falls_back_to_last_conv_and_rejects_conv_free_models():
    net = TinyNet()
    assert feature_layer(net) is net.head
    with pytest.raises(ValueError, match="model"):
        feature_layer(nn.Sequential(nn.ReLU()))


# --- the meta step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make_model", [TinyNet, tiny_unet])
def test_beta_zero_no_split_inner_lr_zero_equals_a_plain_sgd_step(make_model):
    model = make_model()
    reference = copy.deepcopy(model)
    batch, loss_fn = make_batch(), build_loss("dice_ce")

    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    plain_loss = loss_fn(reference(batch["image"]), batch["label"])
    plain_loss.backward()
    opt.step()

    meta_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    value = meta_step(model, batch, meta_opt, loss_fn, inner_lr=0.0, beta=0.0, align_fn=None, global_model=None,
                      feature_fn=None, split=False)
    assert value == pytest.approx(plain_loss.item())
    for key, ref in reference.state_dict().items():  # parameters and BN running statistics alike
        assert torch.equal(model.state_dict()[key], ref), key


def test_beta_zero_no_split_is_sgd_with_the_gradient_taken_at_theta_prime():
    model, batch, loss_fn = TinyNet(), make_batch(), build_loss("dice_ce")
    inner_lr, lr = 0.5, 0.1

    probe = copy.deepcopy(model)  # by hand: theta' = theta - a grad(theta); theta - lr grad(theta')
    grads = torch.autograd.grad(loss_fn(probe(batch["image"]), batch["label"]), list(probe.parameters()))
    with torch.no_grad():
        for p, g in zip(probe.parameters(), grads):
            p.sub_(inner_lr * g)
    grads_prime = torch.autograd.grad(loss_fn(probe(batch["image"]), batch["label"]), list(probe.parameters()))
    expected = [t - lr * g for t, g in zip(params(model), grads_prime)]

    meta_step(model, batch, torch.optim.SGD(model.parameters(), lr=lr), loss_fn,
              inner_lr=inner_lr, beta=0.0, align_fn=None, global_model=None, split=False, inner="sgd")
    for got, want, g in zip(params(model), expected, grads):
        assert torch.allclose(got, want, atol=1e-6)
    plain = [t - lr * g for t, g in zip(params(TinyNet()), grads)]
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(params(model), plain))  # not the plain step


def test_running_statistics_are_updated_once_by_the_meta_test_forward():
    model, batch, loss_fn = tiny_unet(), make_batch(), build_loss("dice_ce")
    probe = copy.deepcopy(model)  # by hand: theta' from the inner step, then ONE train-mode forward
    grads = torch.autograd.grad(loss_fn(probe(batch["image"]), batch["label"]), list(probe.parameters()))
    probe.load_state_dict(model.state_dict())  # undo the probe's running-statistics update
    with torch.no_grad():
        for p, g in zip(probe.parameters(), grads):
            p.sub_(0.5 * g)
        probe(batch["image"])
    meta_step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
              inner_lr=0.5, beta=0.0, align_fn=None, global_model=None, split=False, inner="sgd")
    for (key, buf), ref in zip(model.named_buffers(), probe.buffers()):
        assert torch.allclose(buf, ref, atol=1e-6), key
    assert all(int(b) == 1 for k, b in model.named_buffers() if k.endswith("num_batches_tracked"))


def test_split_uses_first_half_for_meta_train_and_second_half_for_meta_test():
    model, batch, loss_fn = TinyNet(), make_batch(b=4), build_loss("dice_ce")
    b1 = {k: v[:2] for k, v in batch.items()}
    b2 = {k: v[2:] for k, v in batch.items()}
    probe = copy.deepcopy(model)
    grads = torch.autograd.grad(loss_fn(probe(b1["image"]), b1["label"]), list(probe.parameters()))
    with torch.no_grad():
        for p, g in zip(probe.parameters(), grads):
            p.sub_(0.5 * g)
    meta_loss = loss_fn(probe(b2["image"]), b2["label"])
    grads_prime = torch.autograd.grad(meta_loss, list(probe.parameters()))
    expected = [t - 0.1 * g for t, g in zip(params(model), grads_prime)]

    value = meta_step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                      inner_lr=0.5, beta=0.0, align_fn=None, global_model=None, inner="sgd")
    assert value == pytest.approx(meta_loss.item())
    for got, want in zip(params(model), expected):
        assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("align_fn", [coral, mmd])
def test_alignment_changes_the_update_and_leaves_the_global_model_alone(align_fn):
    global_model = tiny_unet(seed=1)
    global_model.train()
    global_before = state(global_model)
    batch, loss_fn = make_batch(), build_loss("dice_ce")
    results = {}
    for beta in (0.0, 1.0):
        model = tiny_unet(seed=0)
        meta_step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, inner_lr=0.01, beta=beta,
                  align_fn=align_fn, global_model=global_model, feature_fn=unet_features)
        results[beta] = params(model)
    assert any(not torch.allclose(a, b) for a, b in zip(results[0.0], results[1.0]))
    assert global_model.training
    for key, value in global_model.state_dict().items():
        assert torch.equal(value, global_before[key]), key
    assert all(p.grad is None for p in global_model.parameters())


def test_adversarial_alignment_plugs_in_and_trains_the_discriminator():
    model, global_model = tiny_unet(0), tiny_unet(1)
    d = feature_layer(model).in_channels
    disc = DomainDiscriminator(d, hidden=4)
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": disc.parameters()}], lr=0.1)
    disc_before = params(disc)
    meta_step(model, make_batch(), opt, build_loss("dice"), inner_lr=0.01, beta=1.0,
              align_fn=partial(adversarial_alignment, disc), global_model=global_model, feature_fn=unet_features)
    assert any(not torch.equal(a, b) for a, b in zip(disc_before, params(disc)))


def test_fits_the_training_loop_hook():
    class Pairs(torch.utils.data.Dataset):
        def __init__(self):
            self.batch = make_batch(b=5, seed=3)

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"image": self.batch["image"][i], "label": self.batch["label"][i]}

    model, global_model = tiny_unet(0), tiny_unet(1)
    before = params(model)
    step = partial(meta_step, inner_lr=0.01, beta=1.0, align_fn=coral, global_model=global_model,
                   feature_fn=unet_features)
    loader = torch.utils.data.DataLoader(Pairs(), batch_size=4)  # last batch has one sample: no split
    out = train_epochs(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), build_loss("dice_ce"), 1,
                       torch.device("cpu"), Hooks(step=step))
    assert out["steps"] == 2 and out["loss"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"inner_lr": -1.0}, "inner_lr"),
        ({"beta": float("nan")}, "beta"),
        ({"beta": 1.0, "align_fn": None}, "align_fn"),
        ({"beta": 1.0, "global_model": None}, "global_model"),
        ({"inner": "rmsprop"}, "inner"),
    ],
)
def test_bad_arguments_are_named_and_model_is_untouched(kwargs, match):
    model = TinyNet()
    before = params(model)
    args = {"inner_lr": 0.1, "beta": 0.0, "align_fn": coral, "global_model": TinyNet(1), **kwargs}
    with pytest.raises(ValueError, match=match):
        meta_step(model, make_batch(), torch.optim.SGD(model.parameters(), lr=0.1), build_loss("dice"), **args)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_failure_restores_parameters_and_buffers():
    model = tiny_unet()
    before = state(model)

    def bad_loss(logits, label):
        bad_loss.calls += 1
        return logits.mean() * (float("nan") if bad_loss.calls == 2 else 1.0)

    bad_loss.calls = 0
    with pytest.raises(FloatingPointError, match="meta-test"):
        meta_step(model, make_batch(), torch.optim.SGD(model.parameters(), lr=0.1), bad_loss,
                  inner_lr=0.1, beta=0.0, align_fn=None, global_model=None)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# --- the inner step ---------------------------------------------------------------------------------


def test_sgd_inner_update_is_minus_lr_times_the_gradient():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    g = torch.tensor([0.5, -4.0, 0.0])
    (delta,) = inner_update([p], [g], torch.optim.SGD([p], lr=1.0), 0.1, "sgd")
    assert torch.allclose(delta, torch.tensor([-0.05, 0.4, 0.0]))
    assert inner_update([p], [None], torch.optim.SGD([p], lr=1.0), 0.1, "sgd") == [None]


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.Adam(ps, lr=1.0, eps=1e-8),
                                      lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9)])
def test_adam_inner_update_on_an_empty_state_is_adams_first_step(make_opt):
    # prepare: no second moments yet (fresh Adam; SGD never has any): step = -lr g / (|g| + eps)
    p = torch.nn.Parameter(torch.zeros(3))
    g = torch.tensor([0.5, -4.0, 0.0])
    # execute
    (delta,) = inner_update([p], [g], make_opt([p]), 1e-3, "adam")
    # assert: a sign-like step of size lr wherever the gradient is not ~0, unlike SGD's lr |g|
    assert torch.allclose(delta, -1e-3 * g / (g.abs() + 1e-8), rtol=1e-6, atol=0)
    assert torch.allclose(delta, torch.tensor([-1e-3, 1e-3, 0.0]), rtol=1e-6)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_inner_update_is_the_step_the_outer_adam_would_take_next(amsgrad):
    # prepare: two outer Adam steps leave first and second moments and step = 2
    p = torch.nn.Parameter(torch.tensor([0.3, -1.0, 2.0]))
    opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad)
    for g0 in (torch.tensor([2.0, 1.0, -0.5]), torch.tensor([1.5, -0.2, 0.1])):
        p.grad = g0.clone()
        opt.step()
    g = torch.tensor([1.0, 3.0, -0.4])
    # execute
    (delta,) = inner_update([p], [g], opt, 1e-3, "adam")
    # assert: equal to what Adam does on its next step with gradient g (done on a copy); state untouched
    twin_p = torch.nn.Parameter(p.detach().clone())
    twin = torch.optim.Adam([twin_p], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, amsgrad=amsgrad)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_p.grad = g.clone()
    twin.step()
    assert torch.allclose(delta, twin_p.detach() - p.detach(), rtol=1e-4, atol=1e-6)  # float32 at |p| ~ 2
    assert int(opt.state[p]["step"]) == 2  # the optimizer state is read, not written


def test_adam_inner_step_stays_an_outer_steps_length_when_a_gradient_spikes():
    # prepare: many tiny gradients (v ~ 0), then one 1000x larger: without the first moment the step
    # would be lr / sqrt(1 - b2) = 31.6 lr per coordinate; Adam's own next step is < 3.2 lr
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(200):
        p.grad = torch.full((4,), 1e-3)
        opt.step()
    # execute
    (delta,) = inner_update([p], [torch.full((4,), 1.0)], opt, 1e-3, "adam")
    # assert
    assert delta.abs().max() < 3.2e-3


def _inner_norm(make_opt, inner, model=None):
    model = model or tiny_unet()
    record = {}
    meta_step(model, make_batch(), make_opt(model.parameters()), build_loss("dice_ce"), inner_lr=1e-3, beta=0.0,
              align_fn=None, global_model=None, split=False, inner=inner, record=record)
    assert record["inner_steps"] == 1
    return record["inner_norm_sum"]


def test_adam_inner_step_length_is_of_the_order_of_lr_sqrt_n_and_dwarfs_the_sgd_one():
    n = sum(p.numel() for p in tiny_unet().parameters())
    adam = _inner_norm(lambda ps: torch.optim.Adam(ps, lr=1e-3), "adam")
    sgd = _inner_norm(lambda ps: torch.optim.Adam(ps, lr=1e-3), "sgd")
    assert 0.5 * 1e-3 * n**0.5 < adam <= 1e-3 * n**0.5  # every coordinate moves by at most lr
    assert adam > 10 * sgd

    # the SGD length is exactly lr ||grad L(theta; B)||
    probe = tiny_unet()
    batch = make_batch()
    grads = torch.autograd.grad(build_loss("dice_ce")(probe(batch["image"]), batch["label"]), list(probe.parameters()))
    assert sgd == pytest.approx(1e-3 * float(torch.sqrt(sum(g.pow(2).sum() for g in grads))), rel=1e-4)


def test_record_accumulates_over_calls_and_counts_zero_steps():
    model, record = tiny_unet(), {"inner_norm_sum": 0.0, "inner_steps": 0}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for inner_lr in (1e-3, 1e-3, 0.0):
        meta_step(model, make_batch(), opt, build_loss("dice"), inner_lr=inner_lr, beta=0.0, align_fn=None,
                  global_model=None, record=record)
    assert record["inner_steps"] == 3 and record["inner_norm_sum"] > 0 and record["outer_norm_sum"] > 0
    once = {}
    meta_step(tiny_unet(), make_batch(), opt, build_loss("dice"), inner_lr=0.0, beta=0.0, align_fn=None,
              global_model=None, record=once)
    # (opt holds the first model's parameters: this model does not move in the outer step either)
    assert {k: once[k] for k in ("inner_norm_sum", "outer_norm_sum", "inner_steps")} == {
        "inner_norm_sum": 0.0, "outer_norm_sum": 0.0, "inner_steps": 1}
    assert once["task_loss_sum"] > 0 and "align_loss_sum" not in once  # beta = 0: L_align is not computed


@pytest.mark.parametrize("beta", [0.5, 2.0])
def test_record_splits_the_meta_loss_into_task_and_alignment_terms(beta):
    model, record = tiny_unet(), {}
    glob = tiny_unet(seed=1).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    meta = [meta_step(model, make_batch(seed=s), opt, build_loss("dice"), inner_lr=1e-3, beta=beta, align_fn=coral,
                      global_model=glob, record=record) for s in (0, 1)]
    assert record["inner_steps"] == 2 and record["task_loss_sum"] > 0 and record["align_loss_sum"] > 0
    # L_meta = L_task + beta * L_align, summed over the calls
    assert record["task_loss_sum"] + beta * record["align_loss_sum"] == pytest.approx(sum(meta), rel=1e-6)


# --- the frozen global model's normalisation mode --------------------------------------------------


@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_alignment_is_zero_when_the_local_model_is_the_global_model(norm):
    # prepare: theta = phi_g; the global model is frozen in eval mode as the site sets it up
    model = tiny_unet(seed=0, norm=norm)
    global_model = copy.deepcopy(model).eval().requires_grad_(False)
    global_before = state(global_model)
    seen = []

    def spy(f_local, f_global):
        value = coral(f_local, f_global)
        seen.append(float(value.detach()))
        return value

    # execute: theta' = theta (inner_lr = 0), so L_align compares phi_g with itself
    meta_step(model, make_batch(), torch.optim.SGD(model.parameters(), lr=0.1), build_loss("dice"), inner_lr=0.0,
              beta=1.0, align_fn=spy, global_model=global_model, feature_fn=unet_features)
    # assert: same normalisation (batch statistics of B2 on both sides) -> identical features
    assert len(seen) == 1 and seen[0] < 1e-10
    assert not global_model.training and all(not m.training for m in global_model.modules())
    for key, value in global_model.state_dict().items():  # running statistics did not drift
        assert torch.equal(value, global_before[key]), key


def test_frozen_features_follow_the_local_models_mode():
    model = tiny_unet()
    with torch.no_grad():
        model(torch.randn(8, 1, 16, 16) * 3 + 1)  # running statistics != the batch's
    global_model = copy.deepcopy(model).train()
    images = make_batch()["image"]
    for mode in (True, False):
        model.train(mode)
        with torch.no_grad():
            expected, _ = unet_features(copy.deepcopy(model), images)
        assert torch.allclose(frozen_features(global_model, model, unet_features, images), expected, atol=1e-6)
    assert global_model.training
    train_feats = frozen_features(global_model, model.train(), unet_features, images)
    eval_feats = frozen_features(global_model, model.eval(), unet_features, images)
    assert not torch.allclose(train_feats, eval_feats, atol=1e-3)  # the mode really matters here


@pytest.mark.parametrize("inner_lr", [0.0, 0.1])
def test_both_gradients_is_the_sum_of_the_two_plain_gradients_in_closed_form(inner_lr):
    """Linear model y = w x, loss mean (w x - y)^2, SGD (lr 1), plain inner step: with meta_grad both the update is
    -(g1(w) + g2(w')), w' = w - inner_lr g1(w), g_i the closed-form gradient 2 X_i^T (X_i w - y_i) / n_i on half i;
    with meta_grad meta it is -g2(w') alone."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    w0 = torch.randn(1, 3, dtype=torch.float64)

    def grad(w, xs, ys):  # d/dw mean((xs w^T - ys)^2), w (1, 3)
        return (2 * (xs @ w.T - ys).T @ xs / xs.shape[0])

    g1 = grad(w0, x[:3], y[:3])
    w_prime = w0 - inner_lr * g1
    expected = {"both": w0 - (g1 + grad(w_prime, x[3:], y[3:])), "meta": w0 - grad(w_prime, x[3:], y[3:])}
    for mode, want in expected.items():
        model = nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(w0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        meta_step(model, {"image": x, "label": y}, opt, nn.functional.mse_loss, inner_lr=inner_lr, beta=0.0,
                  align_fn=None, global_model=None, inner="sgd", meta_grad=mode)
        assert torch.allclose(model.weight.detach(), want, atol=1e-12), mode
    with pytest.raises(ValueError, match="meta_grad"):
        meta_step(model, {"image": x, "label": y}, opt, nn.functional.mse_loss, inner_lr=0.0, beta=0.0,
                  align_fn=None, global_model=None, meta_grad="sum")
