import copy
import math

import pytest
import torch
from torch import nn

from pflseg.algorithms.iopfl import average_states
from pflseg.algorithms.routing import (
    BestPredictions,
    CoefficientRouter,
    RoutedConv,
    build_routed_model,
    consistency,
    entropy,
    loss_weights,
    relative_distances,
    router_parameters,
    shape_loss,
    size_prior,
    unsupervised_loss,
    use_batch_stats,
)
from pflseg.nets import build_net

NET = {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "norm": "batch"}


def experts(n=3, norm="batch"):
    nets = []
    for i in range(n):
        torch.manual_seed(i)
        net = build_net({**NET, "norm": norm})
        with torch.no_grad():  # distinct norm affine params and running stats too
            for m in net.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
                    m.running_mean.uniform_(-1, 1)
        nets.append(net)
    return nets


def averaged(nets):
    net = build_net(NET)
    net.load_state_dict(average_states([n.state_dict() for n in nets]))
    return use_batch_stats(net)


def test_every_conv_is_routed_over_all_experts():
    nets = experts()
    routed = build_routed_model(nets)
    convs = [m for m in nets[0].modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    layers = [m for m in routed.modules() if isinstance(m, RoutedConv)]
    assert len(layers) == len(convs) > 0 and all(m.n_experts == 3 for m in layers)
    assert any(m.transposed for m in layers)


@pytest.mark.parametrize("router", ["paper", "normalised", "model", "layer_global"])
def test_initial_routed_model_equals_averaged_model(router):
    nets = experts()
    x = torch.randn(4, 1, 16, 16)
    routed = build_routed_model(nets, router=router).eval()
    avg = averaged(nets).eval()
    assert torch.allclose(routed(x), avg(x), atol=1e-5)
    assert not torch.allclose(routed(x), use_batch_stats(nets[0]).eval()(x), atol=1e-3)


def _expert_kernels_in_average(nets, e):
    """Expected model when every routed layer picks expert e: its convolutions, all else the average."""
    state = average_states([n.state_dict() for n in nets])
    for name, m in nets[e].named_modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            state.update({f"{name}.{k}": v for k, v in m.state_dict().items()})
    expert = build_net(NET)
    expert.load_state_dict(state)
    return use_batch_stats(expert).eval()


def test_one_hot_router_gives_that_experts_output():
    nets = experts()
    routed = build_routed_model(nets).eval()
    with torch.no_grad():
        for m in routed.modules():
            if isinstance(m, RoutedConv):
                m.router.fc.bias.copy_(torch.tensor([-float("inf"), float("inf"), -float("inf")]))
    x = torch.randn(3, 1, 16, 16)
    assert torch.allclose(routed(x), _expert_kernels_in_average(nets, 1)(x), atol=1e-5)


def test_model_router_is_one_coefficient_vector_shared_by_every_layer():
    # prepare
    nets = experts()
    routed = build_routed_model(nets, router="model")
    layers = [m for m in routed.modules() if isinstance(m, RoutedConv)]
    # assert: one router module and one (E,) Parameter for the whole model
    assert len(layers) > 1 and all(m.router is layers[0].router for m in layers)
    assert isinstance(layers[0].router, CoefficientRouter)
    params = router_parameters(routed)
    assert len(params) == 1 and params[0].shape == (3,) and params[0] is layers[0].router.logits
    assert len(router_parameters(build_routed_model(nets, router="layer_global"))) == len(layers)  # per layer
    # execute: gradients of every layer accumulate in that one vector
    routed(torch.randn(2, 1, 16, 16)).pow(2).mean().backward()
    assert params[0].grad is not None and params[0].grad.abs().sum() > 0
    # setting it once routes every layer: one-hot on expert 2 gives expert 2's kernels everywhere
    with torch.no_grad():
        params[0].copy_(torch.tensor([-float("inf"), -float("inf"), float("inf")]))
    x = torch.randn(3, 1, 16, 16)
    assert torch.allclose(routed.eval()(x), _expert_kernels_in_average(nets, 2)(x), atol=1e-5)
    assert all(torch.equal(m.coefficients(x), torch.tensor([[0.0, 0.0, 1.0]]).expand(3, 3)) for m in layers)


def test_model_router_trains_with_adam_and_stays_shared_after_a_copy():
    import copy

    routed = build_routed_model(experts(), router="model")
    params = router_parameters(routed)
    opt = torch.optim.Adam(params, lr=0.1)
    unsupervised_loss(routed, torch.randn(2, 1, 16, 16), loss_weights("paper"))[0].mean().backward()
    opt.step()
    assert not torch.equal(params[0], torch.zeros(3))
    twin = copy.deepcopy(routed)
    routers = {id(m.router) for m in twin.modules() if isinstance(m, RoutedConv)}
    assert len(routers) == 1 and len(router_parameters(twin)) == 1


@pytest.mark.parametrize("norm_affine", [False, True])
def test_gradients_reach_only_routers_and_optionally_norm_affine(norm_affine):
    routed = build_routed_model(experts(), norm_affine=norm_affine)
    routed(torch.randn(2, 1, 16, 16)).pow(2).mean().backward()
    with_grad = {n for n, p in routed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    trainable = {n for n, p in routed.named_parameters() if p.requires_grad}
    assert with_grad and with_grad <= trainable
    assert any("router" in n for n in with_grad)
    assert all("router" in n or ".adn.N." in n for n in trainable)
    assert any(".adn.N." in n for n in trainable) == norm_affine
    assert all(b.grad is None for b in routed.buffers())  # experts frozen


@pytest.mark.parametrize("conv",
                         [nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ConvTranspose2d(3, 4, 3, 2, 1, output_padding=1),
                                  nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.Conv1d(3, 2, 3)])
def test_grouped_path_equals_per_sample_loop(conv):
    torch.manual_seed(0)
    layers = [conv] + [type(conv)(**{k: getattr(conv, k)
                                     for k in ("in_channels", "out_channels", "kernel_size", "stride",
                                                                   "padding", "groups")}) for _ in range(2)]
    routed = RoutedConv(layers, router="refcode").eval()
    x = torch.randn(5, conv.in_channels, *([8] * (conv.weight.ndim - 2)))
    assert torch.allclose(routed(x), routed.forward_loop(x), atol=1e-5)
    r = routed.coefficients(x)
    assert not torch.allclose(r[0], r[1])  # per-sample coefficients really differ


def test_shape_loss_zero_on_constant_positive_on_checkerboard():
    const = torch.full((2, 1, 8, 8), 0.7)
    assert torch.allclose(shape_loss(const, 1), torch.zeros(2))
    board = ((torch.arange(8)[:, None] + torch.arange(8)[None]) % 2).float()[None, None]
    assert torch.allclose(shape_loss(board, 1), torch.tensor([1.0]))  # every 3x3 window holds a 0 and a 1
    assert torch.allclose(shape_loss(board, 1, "sum"), torch.tensor([64.0]))


def test_shape_term_is_a_pixel_mean_by_default_and_the_papers_sum_scales_with_h_times_w():
    def board(n):
        return ((torch.arange(n)[:, None] + torch.arange(n)[None]) % 2).float()[None, None]

    small, large = shape_loss(board(8), 1, "sum"), shape_loss(board(16), 1, "sum")
    assert torch.allclose(large / small, torch.tensor([(16 * 16) / (8 * 8)]))  # the sum grows with H x W
    assert torch.allclose(shape_loss(board(8), 1), shape_loss(board(16), 1))  # the mean does not
    logits = 20 * board(16) - 10
    for reduction, want in (("mean", 1.0), ("sum", 256.0)):  # the loss the routers minimise follows the setting
        loss, _ = unsupervised_loss(lambda x: logits, torch.zeros(1, 1, 16, 16), {"shape": 1.0}, radius=1,
                                    shape_reduction=reduction)
        assert torch.allclose(loss, torch.tensor([want]), rtol=1e-3)


@pytest.mark.parametrize("n_experts", [2, 3, 6])
def test_paper_router_starts_at_one_over_k_plus_one_with_independent_sigmoids(n_experts):
    # prepare
    nets = experts(n_experts)
    routed = build_routed_model(nets, router="paper")
    layers = [m for m in routed.modules() if isinstance(m, RoutedConv)]
    x = torch.randn(3, 1, 16, 16)
    # assert: every coefficient of every layer and sample is 1/E at the start, whatever the input
    for layer in layers:
        inp = torch.randn(3, layer.weight.shape[2] * layer.groups if not layer.transposed else layer.weight.shape[1], 4,
                          4)
        assert torch.allclose(layer.coefficients(inp), torch.full((3, n_experts), 1 / n_experts), rtol=0, atol=1e-7)
    # execute: raise expert 0's logit in one layer
    router = layers[0].router
    with torch.no_grad():
        router.fc.bias[0] += 2.0
    r = layers[0].coefficients(x)
    # assert: the others keep 1/E (independent sigmoids, no normalisation), so the sum is no longer 1
    assert torch.allclose(r[:, 1:], torch.full((3, n_experts - 1), 1 / n_experts), atol=1e-7)
    assert torch.allclose(r[:, 0], torch.sigmoid(torch.tensor(2.0 - math.log(n_experts - 1))).expand(3))
    assert (r.sum(1) > 1.01).all()
    # the ablation routers of the paper start at 1/E with independent sigmoids too; normalised ones sum to 1
    for normalised in (False, True):
        coef = CoefficientRouter(n_experts, normalised)
        assert torch.allclose(coef(None), torch.full((1, n_experts), 1 / n_experts), atol=1e-7)
        with torch.no_grad():
            coef.logits[0] += 2.0
        assert (abs(float(coef(None).detach().sum()) - 1) < 1e-6) == normalised


def test_normalised_router_sums_to_one_after_a_change():
    routed = build_routed_model(experts(), router="normalised")
    layer = next(m for m in routed.modules() if isinstance(m, RoutedConv))
    with torch.no_grad():
        layer.router.fc.bias[0] += 2.0
    r = layer.coefficients(torch.randn(2, 1, 8, 8))
    assert torch.allclose(r.sum(1), torch.ones(2)) and (r[:, 0] > 1 / 3 + 0.1).all()


def test_refcode_loss_weights_are_the_reference_codes_batch_summed_entropy_in_bits():
    # prepare: the reference code's entropy on a 2-class softmax ([0, z] logits = sigmoid(z)), summed over dim 0
    torch.manual_seed(0)
    z = torch.randn(5, 1, 6, 6)
    p2 = torch.softmax(torch.cat([torch.zeros_like(z), z], 1), 1)
    ref = (-(p2 * torch.log(p2 + 1e-6)).sum(0) / math.log(2)).mean()
    # execute: ours, per sample, averaged over the batch as the step does
    w = loss_weights("refcode", batch_size=5)
    ours = (w["ent"] * entropy(torch.sigmoid(z))).mean()
    # assert
    assert torch.allclose(ours, 10 * ref, rtol=1e-4)
    assert w["cons"] == 0.1 and w["shape"] == 0.0
    with pytest.raises(ValueError, match="batch size"):
        loss_weights("refcode")


def test_rest_global_takes_the_non_routed_parameters_of_w_g_and_distances_are_relative_to_it():
    nets = experts()
    routed = build_routed_model(nets, router="refcode", norm_affine=True, rest="global")
    bn = [m for m in routed.modules() if isinstance(m, nn.BatchNorm2d)]
    bn_g = [m for m in nets[-1].modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.equal(a.weight, b.weight) and a.weight.requires_grad for a, b in zip(bn, bn_g))
    far = copy.deepcopy(nets[-1])
    with torch.no_grad():
        for m in far.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                for p in m.parameters(recurse=False):
                    p.mul_(1.5)
            if isinstance(m, nn.BatchNorm2d):
                m.weight.mul_(100.0)  # not routed: not counted
    assert relative_distances([far, nets[0], nets[-1]])[0] == pytest.approx(0.5)
    assert relative_distances([far, nets[0], nets[-1]])[-1] == 0.0


def test_entropy_is_maximal_at_one_half():
    p = torch.tensor([0.01, 0.2, 0.5, 0.8, 0.99]).view(5, 1, 1, 1)
    h = entropy(p)
    assert h.argmax() == 2 and torch.allclose(h[2], torch.log(torch.tensor(2.0)))
    assert torch.allclose(h[1], h[3])


def test_lowest_loss_selection_keeps_the_right_prediction():
    best = BestPredictions()
    best.update(["a", "b"], torch.tensor([0.5, 0.2]), torch.tensor([[1], [2]]))
    best.update(["b", "a"], torch.tensor([0.3, 0.1]), torch.tensor([[20], [10]]))
    best.update(["a", "b"], torch.tensor([0.4, float("nan")]), torch.tensor([[100], [200]]))
    assert best.pred["a"].item() == 10 and best.pred["b"].item() == 2
    assert best.loss == {"a": pytest.approx(0.1), "b": pytest.approx(0.2)}


def test_unsupervised_loss_is_per_sample_and_trains_the_routers():
    torch.manual_seed(0)
    routed = build_routed_model(experts())
    loss, probs = unsupervised_loss(routed, torch.randn(3, 1, 16, 16), loss_weights("paper"), rot_flip=True)
    assert loss.shape == (3,) and probs.shape == (3, 1, 16, 16) and (loss > 0).all()
    loss.mean().backward()
    assert all(p.grad is not None for p in router_parameters(routed))


def test_bad_router_is_named_and_the_old_global_name_points_to_the_new_ones():
    with pytest.raises(ValueError, match="router"):
        build_routed_model(experts(2), router="mlp")
    with pytest.raises(ValueError, match="'model' is the paper's IOP-FL \\(Global\\)"):
        build_routed_model(experts(2), router="global")


def disc(size=64, radius=12.0, edge=1.0, shift=0.0):
    """A soft disc's sigmoid probabilities (1, 1, size, size): the organ of a 64 px slice."""
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")
    dist = ((yy - size / 2 - shift) ** 2 + (xx - size / 2) ** 2).sqrt()
    return torch.sigmoid((radius - dist) / edge)[None, None]


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_every_term_is_zero_on_a_constant_map(value):
    const = torch.full((2, 1, 32, 32), value)
    assert torch.equal(shape_loss(const), torch.zeros(2)) and torch.equal(shape_loss(const, reduction="sum"),
                                                                          torch.zeros(2))
    assert entropy(const).max() < 2e-5  # clamped at 1e-6: ~1.4e-5 nats
    assert torch.equal(consistency(const, const), torch.zeros(2))
    prior = torch.tensor([min(max(value, 1e-6), 1 - 1e-6)])
    assert size_prior(const, prior).abs().max() < 1e-6


def test_the_weighted_terms_of_a_64px_disc_are_commensurate_and_the_sum_form_is_not():
    """Paper weights (1, beta, beta), per-pixel means: on a 64 px disc of radius 12 with a 1 px soft edge, a
    prediction under noise that moves the edge by 1 px, and a fraction 20 % below the prior, every weighted term
    lies within a factor 30 of every other; the paper's summed shape term is H x W times the mean and outweighs
    the others more than 100-fold (the perimeter penalty)."""
    p, p_noisy = disc(), disc(shift=1.0)
    w = loss_weights("paper", 0.01, size=1.0)
    q = float(p.mean())
    terms = {"cons": w["cons"] * float(consistency(p, p_noisy)), "shape": w["shape"] * float(shape_loss(p)),
             "ent": w["ent"] * float(entropy(p)), "size": w["size"] * float(size_prior(p, torch.tensor([q / 0.8])))}
    assert all(v > 0 for v in terms.values()), terms
    assert max(terms.values()) / min(terms.values()) < 30, terms
    summed = w["shape"] * float(shape_loss(p, reduction="sum"))
    assert summed == pytest.approx(terms["shape"] * 64 * 64, rel=1e-5)
    assert summed > 100 * max(terms["cons"], terms["ent"], terms["size"]), (summed, terms)


@pytest.mark.parametrize("fraction", [0.05, 0.3])
def test_the_size_priors_gradient_points_towards_the_prior(fraction):
    """Gradient descent on L_size raises every logit when the predicted fraction is below the prior, lowers it
    when above, and L_size is 0 with a vanishing gradient at the prior."""
    torch.manual_seed(0)
    logits = torch.randn(4, 2, 16, 16)
    q = torch.sigmoid(logits).transpose(0, 1).flatten(1).mean(1)  # (C,)
    for prior, sign in ((q + fraction, -1.0), ((q - fraction).clamp(min=0.01), 1.0)):
        x = logits.clone().requires_grad_(True)
        size_prior(torch.sigmoid(x), prior).mean().backward()
        assert (torch.sign(x.grad) == sign).all()
    x = logits.clone().requires_grad_(True)
    loss = size_prior(torch.sigmoid(x), q)
    loss.mean().backward()
    assert float(loss.abs().max()) < 1e-6 and float(x.grad.abs().max()) < 1e-6


def test_size_prior_is_one_value_per_batch_and_names_a_bad_prior():
    p = torch.rand(3, 2, 8, 8)
    out = size_prior(p, torch.tensor([0.1, 0.2]))
    assert out.shape == (3,) and torch.equal(out, out[:1].expand(3))
    with pytest.raises(ValueError, match="prior"):
        size_prior(p, torch.tensor([0.1]))
    with pytest.raises(ValueError, match="no prior"):
        unsupervised_loss(lambda x: x, torch.zeros(1, 1, 4, 4), {"size": 1.0})
    with pytest.raises(ValueError, match="size"):
        loss_weights("paper", size=-1.0)


def test_unsupervised_loss_adds_the_size_prior_and_uses_the_mean_shape_by_default():
    logits = torch.logit(disc(32, 6.0).clamp(1e-4, 1 - 1e-4))
    prior = torch.tensor([0.5])
    base, _ = unsupervised_loss(lambda x: logits, torch.zeros(1, 1, 32, 32), {"shape": 1.0}, radius=1)
    assert torch.allclose(base, shape_loss(torch.sigmoid(logits), 1, "mean"))
    both, _ = unsupervised_loss(lambda x: logits, torch.zeros(1, 1, 32, 32), {"shape": 1.0, "size": 2.0}, radius=1,
                                prior=prior)
    assert torch.allclose(both - base, 2.0 * size_prior(torch.sigmoid(logits), prior))
