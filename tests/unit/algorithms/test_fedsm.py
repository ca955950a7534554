import pytest
import torch
from torch import nn

from pflseg.algorithms.fedsm import (
    EXTRA_GLOBAL_CLASS,
    GLOBAL,
    average_moments,
    extra_class_of_site,
    flatten_optimizer_state,
    route,
    route_extra,
    selector_labels_extra,
    selector_labels_fedsm,
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
