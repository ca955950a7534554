import pytest
import torch
from torch import nn

from pflseg.algorithms.fedsm import (
    EXTRA_GLOBAL_CLASS,
    GLOBAL,
    TEMPERATURES,
    add_statistics,
    average_moments,
    best_temperature,
    calibrate_gamma,
    class_statistics,
    extra_class_of_site,
    flatten_optimizer_state,
    hard_weights,
    lda_gaussians,
    lda_head,
    min_mahalanobis,
    mix_probabilities,
    mixing_weights,
    mixing_weights_extra,
    nll_at_temperatures,
    pooled_adam_step,
    route,
    route_extra,
    selector_gradient,
    selector_labels_extra,
    selector_labels_fedsm,
    selector_view,
    unflatten_optimizer_state,
)

# ---------------------------------------------------------------- labels


def test_fedsm_labels_are_the_site_index_for_every_sample():
    labels = selector_labels_fedsm(2, 5, num_sites=3)
    assert labels.dtype == torch.long and torch.equal(labels, torch.tensor([2, 2, 2, 2, 2]))
    assert selector_labels_fedsm(0, 0).shape == (0,)


@pytest.mark.parametrize("site_index, n, num_sites, match", [(-1, 3, None, "site_index"), (3, 3, 3, "site_index"),
                                                             (0, -1, None, "n must"), (1.0, 3, None, "site_index")])
def test_fedsm_labels_reject_bad_arguments(site_index, n, num_sites, match):
    with pytest.raises(ValueError, match=match):
        selector_labels_fedsm(site_index, n, num_sites=num_sites)


def test_extra_labels_are_the_argmin_loss_with_global_as_class_zero():
    # columns: global, site 0, site 1
    losses = torch.tensor([[0.1, 0.5, 0.6],   # global best -> 0
                           [0.4, 0.2, 0.3],   # site 0 -> 1
                           [0.4, 0.3, 0.05],  # site 1 -> 2
                           [0.2, 0.2, 0.9]])  # tie global / site 0 -> global
    labels = selector_labels_extra(losses)
    assert labels.dtype == torch.long
    assert labels.tolist() == [EXTRA_GLOBAL_CLASS, extra_class_of_site(0), extra_class_of_site(1), EXTRA_GLOBAL_CLASS]


def test_extra_labels_reject_nan_and_bad_shape():
    with pytest.raises(ValueError, match="losses"):
        selector_labels_extra(torch.tensor([[0.1, float("nan")]]))
    with pytest.raises(ValueError, match="losses"):
        selector_labels_extra(torch.tensor([0.1, 0.2]))


# ---------------------------------------------------------------- inference routing

PROBS = torch.tensor([[0.95, 0.03, 0.02],  # confident: site 0
                      [0.10, 0.50, 0.40],  # unsure
                      [0.05, 0.05, 0.90],  # exactly at 0.9: not > gamma
                      [1 / 3, 1 / 3, 1 / 3]])  # uniform


def test_route_uses_global_below_or_at_gamma():
    assert route(PROBS, gamma=0.9).tolist() == [0, GLOBAL, GLOBAL, GLOBAL]
    assert route(PROBS, gamma=0.45).tolist() == [0, 1, 2, GLOBAL]


def test_gamma_zero_always_picks_a_personalized_model():
    probs = torch.softmax(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * 5, dim=1)
    choice = route(probs, gamma=0.0)
    assert torch.equal(choice, probs.argmax(dim=1)) and (choice != GLOBAL).all()
    assert route(PROBS, gamma=0.0).tolist() == [0, 1, 2, 0]  # uniform row: tie -> lowest site index


def test_gamma_one_always_picks_the_global_model():
    one_hot = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert route(one_hot, gamma=1.0).tolist() == [GLOBAL, GLOBAL]
    assert (route(PROBS, gamma=1.0) == GLOBAL).all()


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan")])
def test_route_rejects_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        route(PROBS, gamma)


def test_route_rejects_logits():
    with pytest.raises(ValueError, match="softmax"):
        route(torch.tensor([[2.0, -1.0]]), 0.5)


def test_route_extra_maps_class_zero_to_global_and_class_k_plus_one_to_site_k():
    scores = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 5.0]])  # logits are fine here
    assert route_extra(scores).tolist() == [GLOBAL, 0, 1]
    assert torch.equal(route_extra(torch.softmax(scores, 1)), route_extra(scores))


# ---------------------------------------------------------------- mixing (fedsm.mixing)


@pytest.mark.parametrize("gamma", [0.0, 0.3, 0.5, 0.9, 0.99, 1.0])
def test_soft_weights_of_a_one_hot_posterior_are_the_hard_choice(gamma):
    one_hot = torch.eye(3)[[0, 2, 1, 1]]
    assert torch.equal(mixing_weights(one_hot, gamma), hard_weights(route(one_hot, gamma), 3))
    extra = torch.eye(4)[[0, 3, 1]]  # FedSM-extra: class 0 = the global model
    assert torch.equal(mixing_weights_extra(extra), hard_weights(route_extra(extra), 3))


def test_soft_weights_give_the_global_model_the_shares_at_or_below_gamma():
    # columns: global, site 0, site 1, site 2
    expected = torch.tensor([[0.05, 0.95, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.1, 0.0, 0.0, 0.9], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(mixing_weights(PROBS, 0.45), expected)
    torch.testing.assert_close(mixing_weights(PROBS, 0.0)[:, 1:], PROBS)  # the posterior itself
    assert mixing_weights(PROBS, 0.0)[:, 0].tolist() == [0.0] * 4
    assert mixing_weights(PROBS, 1.0).tolist() == [[1.0, 0.0, 0.0, 0.0]] * 4  # the global model alone


@pytest.mark.parametrize("gamma", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_soft_weights_are_non_negative_and_sum_to_one(gamma):
    probs = torch.softmax(torch.randn(50, 4, generator=torch.Generator().manual_seed(1)) * 3, dim=1)
    w = mixing_weights(probs, gamma)
    assert w.shape == (50, 5) and (w >= 0).all()
    assert torch.allclose(w.sum(1).double(), torch.ones(50, dtype=torch.float64), atol=1e-6)
    extra = mixing_weights_extra(probs)
    assert torch.allclose(extra.sum(1).double(), torch.ones(50, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(extra, probs)  # FedSM-extra: the (K+1)-way posterior, class 0 = the global model


def test_mixing_averages_probabilities_not_logits():
    logits = torch.tensor([4.0, -1.0]).view(1, 2, 1, 1, 1)  # two models, one pixel
    probabilities = torch.sigmoid(logits)
    mixed = mix_probabilities(probabilities, torch.tensor([[0.5, 0.5]]))
    assert float(mixed) == pytest.approx(0.5 * (torch.sigmoid(torch.tensor(4.0)) + torch.sigmoid(torch.tensor(-1.0))))
    assert float(mixed) != pytest.approx(float(torch.sigmoid(torch.tensor(1.5))))  # the logits' mean: 0.82, not 0.63
    maps = torch.rand(3, 4, 2, 5, 5, generator=torch.Generator().manual_seed(2))
    alone = mix_probabilities(maps, hard_weights(torch.tensor([-1, 0, 2]), 3))
    assert torch.equal(alone, maps[torch.arange(3), torch.tensor([0, 1, 3])])  # weight 1: the model's own map, exactly


def test_mixing_rejects_bad_weights_and_gamma():
    maps = torch.rand(2, 3, 1, 4, 4)
    with pytest.raises(ValueError, match="weights"):
        mix_probabilities(maps, torch.tensor([[0.5, 0.2, 0.2], [1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="weights"):
        mix_probabilities(maps, torch.ones(2, 2) / 2)
    with pytest.raises(ValueError, match="gamma"):
        mixing_weights(PROBS, 1.5)
    with pytest.raises(ValueError, match="softmax"):
        mixing_weights(torch.tensor([[2.0, -1.0]]), 0.5)
    with pytest.raises(ValueError, match="choices"):
        hard_weights(torch.tensor([3]), 3)


# ---------------------------------------------------------------- optimizer moments


def test_moments_are_the_n_k_weighted_mean():
    m1 = {"0.exp_avg": torch.tensor([1.0, 2.0]), "0.exp_avg_sq": torch.tensor([4.0]), "0.step": torch.tensor(2.0)}
    m2 = {"0.exp_avg": torch.tensor([5.0, 6.0]), "0.exp_avg_sq": torch.tensor([0.0]), "0.step": torch.tensor(2.0)}
    before = {k: v.clone() for k, v in m1.items()}
    out = average_moments([m1, m2], weights=[30, 10])  # p = (0.75, 0.25)
    assert torch.allclose(out["0.exp_avg"], torch.tensor([2.0, 3.0]))
    assert torch.allclose(out["0.exp_avg_sq"], torch.tensor([3.0]))
    assert torch.allclose(out["0.step"], torch.tensor(2.0))
    assert all(torch.equal(m1[k], before[k]) for k in before)


def _stepped_adam(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    nn.functional.cross_entropy(net(torch.randn(5, 3)), torch.tensor([0, 1, 0, 1, 1])).backward()
    opt.step()
    return net, opt


def test_optimizer_state_flatten_unflatten_round_trip():
    net, opt = _stepped_adam()
    sd = opt.state_dict()
    flat = flatten_optimizer_state(sd)
    assert set(flat) == {f"{i}.{name}" for i in range(4) for name in ("step", "exp_avg", "exp_avg_sq")}
    assert all(torch.is_tensor(v) for v in flat.values())
    assert flat["0.exp_avg"] is not sd["state"][0]["exp_avg"]  # copies, not aliases

    # load into a fresh optimizer over a fresh copy of the network, then step both identically
    net2 = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    net2.load_state_dict(net.state_dict())
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    opt2.load_state_dict(unflatten_optimizer_state(flat, opt2.state_dict()["param_groups"]))
    for i, st in sd["state"].items():
        for name, value in st.items():
            assert torch.equal(opt2.state_dict()["state"][i][name], value)
    x, y = torch.randn(5, 3), torch.tensor([1, 1, 0, 0, 1])
    for n, o in ((net, opt), (net2, opt2)):
        o.zero_grad()
        nn.functional.cross_entropy(n(x), y).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))


def test_averaged_moments_load_into_adam():
    (_, opt_a), (_, opt_b) = _stepped_adam(0), _stepped_adam(1)
    flat_a, flat_b = flatten_optimizer_state(opt_a.state_dict()), flatten_optimizer_state(opt_b.state_dict())
    avg = average_moments([flat_a, flat_b], [1, 3])
    opt_a.load_state_dict(unflatten_optimizer_state(avg, opt_a.state_dict()["param_groups"]))
    loaded = opt_a.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        expected = 0.25 * flat_a[f"2.{key}"] + 0.75 * flat_b[f"2.{key}"]
        assert torch.allclose(loaded[2][key], expected)
        assert not torch.allclose(loaded[2][key], flat_a[f"2.{key}"])


def test_unflatten_names_a_bad_key():
    groups = [{"params": [0, 1], "lr": 1e-3}]
    with pytest.raises(ValueError, match="'x.exp_avg'"):
        unflatten_optimizer_state({"x.exp_avg": torch.zeros(1)}, groups)
    with pytest.raises(ValueError, match="'5.exp_avg'"):
        unflatten_optimizer_state({"5.exp_avg": torch.zeros(1)}, groups)


# ---------------------------------------------------------------- full-batch softmax: Adam step on the pooled gradient

LR, B1, B2, EPS = 0.01, 0.9, 0.999, 1e-8


def _tiny_selector():
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _closed_form_adam(params, grad, m, v, t):
    """Adam (Kingma & Ba; torch's default form), step t >= 1, written out."""
    out, m2, v2 = {}, {}, {}
    for k in params:
        m2[k] = B1 * m[k] + (1 - B1) * grad[k]
        v2[k] = B2 * v[k] + (1 - B2) * grad[k] ** 2
        m_hat, v_hat = m2[k] / (1 - B1 ** t), v2[k] / (1 - B2 ** t)
        out[k] = params[k] - LR * m_hat / (v_hat.sqrt() + EPS)
    return out, m2, v2


def test_epoch_mode_step_on_two_one_label_sites_is_one_adam_step_on_the_pooled_gradient():
    net = _tiny_selector()
    x_a, x_b = torch.randn(5, 1, 2, 2), torch.randn(3, 1, 2, 2) + 1.0  # site a: label 0 only; site b: label 1 only
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    # the server's moments after an earlier step (not zero: the general step, with t = 2)
    m = {k: 0.1 * torch.randn_like(v) for k, v in params.items()}
    v = {k: 0.01 * torch.rand_like(v) for k, v in params.items()}
    moments = {f"{i}.{name}": t for i, k in enumerate(params) for name, t in
               (("exp_avg", m[k]), ("exp_avg_sq", v[k]), ("step", torch.tensor(1.0)))}

    grads = []
    for x, label in ((x_a, 0), (x_b, 1)):  # each site: its own images, its own label, in two batches
        batches = [(x[:2], selector_labels_fedsm(label, 2)), (x[2:], selector_labels_fedsm(label, len(x) - 2))]
        g, loss = selector_gradient(net, batches)
        assert loss > 0 and all(p.grad is None for p in net.parameters())  # the net is left clean
        grads.append(g)
    new, new_moments = pooled_adam_step(params, grads, moments, LR)

    pooled = nn.functional.cross_entropy(net(torch.cat([x_a, x_b])), torch.tensor([0] * 5 + [1] * 3), reduction="sum")
    pooled_grad = dict(zip(params, torch.autograd.grad(pooled, list(net.parameters()))))
    expected, m2, v2 = _closed_form_adam(params, pooled_grad, m, v, t=2)
    for k in params:
        assert torch.allclose(new[k], expected[k], atol=1e-6), k
    assert torch.allclose(new_moments["0.exp_avg"], m2[next(iter(params))], atol=1e-7)
    assert float(new_moments["0.step"]) == 2.0
    assert all(torch.equal(params[k], net.state_dict()[k]) for k in params)  # inputs untouched


def test_reference_recipe_site_steps_then_average_is_not_the_pooled_step():
    """Why: the reference code steps at each site (Adam, moments averaged) and averages the weights. At the first
    step Adam moves every coordinate by about lr * sign(g_k): the average is an n_k-weighted vote of the sites'
    gradient signs, not a step on the pooled gradient."""
    params = {"w": torch.zeros(2)}
    g_a, g_b = torch.tensor([1.0, 1.0]), torch.tensor([-3.0, -0.5])  # site a: 2 images, site b: 1 image
    zero = {"w": torch.zeros(2)}
    site_steps = [_closed_form_adam(params, {"w": g}, zero, zero, t=1)[0]["w"] for g in (g_a, g_b)]
    averaged = (2 * site_steps[0] + 1 * site_steps[1]) / 3
    pooled, _ = pooled_adam_step(params, [{"w": g_a}, {"w": g_b}], {}, LR)
    assert torch.allclose(averaged, torch.tensor([-LR / 3, -LR / 3]), atol=1e-6)  # the vote: site a wins both
    assert torch.allclose(pooled["w"], torch.tensor([LR, -LR]), atol=1e-6)  # pooled gradient (-2, 0.5): -lr * its sign
    assert not torch.allclose(averaged, pooled["w"])


def test_pooled_step_names_a_missing_parameter():
    with pytest.raises(ValueError, match="'b'"):
        pooled_adam_step({"w": torch.zeros(1), "b": torch.zeros(1)}, [{"w": torch.ones(1)}], {}, LR)


# ---------------------------------------------------------------- closed-form (LDA) head


def test_statistics_of_sites_add_up_to_the_pooled_statistics():
    x, y = torch.randn(10, 3), torch.tensor([0, 1, 1, 0, 2, 2, 2, 0, 1, 1])
    parts = [class_statistics(x[:4], y[:4], 3), class_statistics(x[4:], y[4:], 3)]
    whole, summed = class_statistics(x, y, 3), add_statistics(parts)
    assert all(torch.allclose(whole[k], summed[k]) for k in whole)
    assert summed["count"].tolist() == [3.0, 4.0, 3.0]


def test_lda_head_from_one_label_sites_separates_the_sites():
    torch.manual_seed(0)
    means = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    sites = [means[k] + 0.3 * torch.randn(40, 3) for k in range(3)]  # site k: label k only
    stats = add_statistics([class_statistics(f, torch.full((len(f),), k), 3) for k, f in enumerate(sites)])
    weight, bias = lda_head(stats, shrinkage=0.01)
    test = [means[k] + 0.3 * torch.randn(20, 3) for k in range(3)]
    for k, f in enumerate(test):
        assert ((f @ weight.T + bias).argmax(1) == k).float().mean() > 0.95
    # closed form with shrinkage 1 (covariance = scaled identity s I): W_c = mu_c / s, b_c = -|mu_c|^2 / (2 s)
    w1, b1 = lda_head(stats, shrinkage=1.0)
    mu = stats["sum"] / stats["count"][:, None]
    s = (torch.trace(stats["gram"]) - (stats["count"] * (mu ** 2).sum(1)).sum()) / stats["count"].sum() / 3
    assert torch.allclose(w1, (mu / s).float(), atol=1e-5)
    assert torch.allclose(b1, (-(mu ** 2).sum(1) / (2 * s)).float(), atol=1e-5)


def test_lda_head_never_picks_a_class_without_samples():
    stats = class_statistics(torch.randn(6, 2), torch.tensor([0, 0, 0, 2, 2, 2]), 3)
    weight, bias = lda_head(stats, shrinkage=0.1)
    assert torch.all(weight[1] == 0) and bias[1] < -1e8
    assert ((torch.randn(50, 2) @ weight.T + bias).argmax(1) != 1).all()


def test_lda_gaussians_are_the_means_and_the_inverse_shrunk_covariance_computed_directly():
    torch.manual_seed(1)
    x = torch.randn(30, 4, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    y = torch.tensor([0] * 10 + [2] * 20)  # class 1 absent
    stats = add_statistics([class_statistics(x[:12], y[:12], 3), class_statistics(x[12:], y[12:], 3)])
    g = lda_gaussians(stats, shrinkage=0.2)
    mu = torch.stack([x[y == 0].mean(0), x[y == 2].mean(0)])
    centred = torch.cat([x[y == 0] - mu[0], x[y == 2] - mu[1]])
    cov = centred.T @ centred / len(x)  # pooled within-class covariance, 1 / N as lda_head
    shrunk = 0.8 * cov + 0.2 * torch.trace(cov) / 4 * torch.eye(4, dtype=torch.float64)
    assert torch.allclose(g["mean"], mu) and torch.allclose(g["precision"], torch.linalg.inv(shrunk))
    assert g["mean"].is_contiguous() and g["precision"].is_contiguous()  # FLARE refuses to send a strided view
    # the same geometry as the head: W_c = P mu_c
    weight, _ = lda_head(stats, shrinkage=0.2)
    assert torch.allclose(weight[[0, 2]].double(), mu @ g["precision"], atol=1e-4)


def test_min_mahalanobis_is_the_squared_distance_to_the_nearest_class_mean():
    torch.manual_seed(2)
    a = torch.randn(4, 4, dtype=torch.float64)
    precision = a @ a.T + torch.eye(4, dtype=torch.float64)
    mean, phi = torch.randn(3, 4, dtype=torch.float64), torch.randn(7, 4)
    d2 = min_mahalanobis(phi, mean, precision)
    direct = torch.tensor([min(float((f.double() - m) @ precision @ (f.double() - m)) for m in mean) for f in phi],
                          dtype=torch.float64)
    assert d2.dtype == torch.float64 and torch.allclose(d2, direct)
    assert torch.allclose(min_mahalanobis(mean, mean, precision), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="must agree"):
        min_mahalanobis(phi, mean[:, :3], precision)


def test_lda_gaussians_reject_bad_shrinkage_and_empty_statistics():
    stats = class_statistics(torch.randn(6, 2), torch.tensor([0, 0, 0, 1, 1, 1]), 2)
    with pytest.raises(ValueError, match="shrinkage"):
        lda_gaussians(stats, shrinkage=0.0)
    with pytest.raises(ValueError, match="no class"):
        lda_gaussians({k: v * 0 for k, v in stats.items()}, shrinkage=0.1)


# ---------------------------------------------------------------- selector input


def test_intensity_input_tells_apart_two_images_that_differ_only_by_scale():
    raw = torch.rand(1, 1, 4, 4) * 100
    images = torch.cat([raw, 3 * raw])  # the same scene, a scanner with 3x the gain
    mean, std = images.mean((2, 3)), images.std((2, 3), unbiased=False)
    z = (images - mean[..., None, None]) / std[..., None, None]
    intensity = torch.stack([mean, std], dim=-1)  # (B, C, 2), as the data set keeps it
    assert torch.allclose(z[0], z[1], atol=1e-5)  # z-scored: identical, no selector can tell them apart
    seen = selector_view(z, intensity, "intensity")
    assert torch.allclose(seen, torch.asinh(images), atol=1e-4)
    assert (seen[1] - seen[0]).mean() > 1.0  # asinh(3x) - asinh(x) ~ log 3 where x >> 1
    assert torch.equal(selector_view(z, intensity, "zscore"), z)
    with pytest.raises(ValueError, match="intensity"):
        selector_view(z, None, "intensity")


# ---------------------------------------------------------------- temperature


def test_fitted_temperature_lowers_validation_nll_of_an_overconfident_selector():
    torch.manual_seed(0)
    labels = torch.randint(0, 3, (200,))
    logits = 0.5 * torch.randn(200, 3)
    logits[torch.arange(200), labels] += 1.0
    logits *= 8.0  # right about 3/4 of the time, with near-certain probabilities: overconfident
    nll = nll_at_temperatures(logits, labels)
    t = best_temperature(nll.tolist())
    at = lambda temp: float(nn.functional.cross_entropy(logits / temp, labels, reduction="sum"))  # noqa: E731
    assert t > 1.0 and at(t) < at(1.0)
    assert float(nll[TEMPERATURES.index(1.0)]) == pytest.approx(at(1.0))
    assert best_temperature([1.0] * len(TEMPERATURES)) == 1.0  # no information: no rescaling


def _toy_fold(held_out: int, familiar: bool, n: int = 50):
    """A toy 1-D selector over K = 3 inside sites (site means 0, 4, 8): softmax of -(x - mu_k)^2 / 2 over the
    fold's sites (the held-out site's mean removed). Personalized model k scores 0.9 on its own site's images and
    0.5 elsewhere; the global model 0.8 everywhere. ``familiar``: h's images sit on an inside site's mean; else far
    between two means (an unseen scanner), where the selector is unsure."""
    torch.manual_seed(held_out)
    means = torch.tensor([m for k, m in enumerate([0.0, 4.0, 8.0, 12.0]) if k != held_out])
    x = (means[0] if familiar else (means[0] + means[1]) / 2) + 0.3 * torch.randn(n)
    probs = torch.softmax(-(x[:, None] - means[None]) ** 2 / 2, dim=1)
    nearest = (x[:, None] - means[None]).abs().argmin(1)
    own = torch.nn.functional.one_hot(nearest, len(means)).bool() if familiar else torch.zeros(n, len(means)).bool()
    personal = torch.where(own, torch.tensor(0.9), torch.tensor(0.5))
    return probs, personal, torch.full((n,), 0.8)


def test_gamma_calibrated_leave_one_inside_site_out_is_positive_when_held_out_sites_look_unfamiliar():
    gammas = [0.0, 0.5, 0.7, 0.9, 0.99]
    gamma, table = calibrate_gamma([_toy_fold(h, familiar=False) for h in range(4)], gammas)
    assert gamma > 0 and table[0]["dice"] < max(row["dice"] for row in table)
    gamma, _ = calibrate_gamma([_toy_fold(h, familiar=True) for h in range(4)], gammas)
    assert gamma == 0.0  # where the held-out sites look like an inside site, routing to it is right
    with pytest.raises(ValueError, match="disagree"):
        probs, personal, glob = _toy_fold(0, False)
        calibrate_gamma([(probs, personal[:, :2], glob)], gammas)
