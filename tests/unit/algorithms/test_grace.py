import copy
import math

import pytest
import torch
import torch.nn.functional as F

from pflseg.algorithms.fedavg import weighted_average
from pflseg.algorithms.fedbn import norm_keys
from pflseg.algorithms.grace import (
    consistency,
    grace_keys,
    grace_step,
    reweight_probs,
    similarity,
    update_vectors,
)
from pflseg.nets import build_unet

MODES = ["total", "split", "reweight"]


def make_states(updates, global_state=None):
    """Client states theta_k = theta_g - g_k from per-key updates {key: (K, *shape)}."""
    g = global_state or {key: torch.full(u.shape[1:], 0.5) for key, u in updates.items()}
    k = next(iter(updates.values())).shape[0]
    return g, [{key: g[key] - u[i] for key, u in updates.items()} for i in range(k)]


def naive_similarity(blocks, mode):
    """K^2 separate cosine computations (the reference the Gram matrix must reproduce)."""
    blocks = [b.reshape(b.shape[0], -1).double() for b in blocks]
    k, n_layers = blocks[0].shape[0], len(blocks)

    def cos(u, v):
        nu, nv = u.norm(), v.norm()
        return 0.0 if nu == 0 or nv == 0 else float(u @ v / (nu * nv))

    lin = torch.linspace(1, 0, n_layers, dtype=torch.float64)
    w = lin / lin.mean()
    out = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(k):
            if mode == "total":
                out[i, j] = cos(torch.cat([b[i] for b in blocks]), torch.cat([b[j] for b in blocks]))
            else:
                per = torch.tensor([cos(b[i], b[j]) for b in blocks], dtype=torch.float64)
                out[i, j] = per.mean() if mode == "split" else (w * per).mean()
    return out


def random_blocks(seed, k=4, shapes=((3, 2), (5,), (2, 2, 2))):
    gen = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(k, *s, generator=gen) for s in shapes]
    blocks[1][2] = 0.0  # a zero-norm update of one tensor at site 2
    return blocks


# --- update vectors and similarity -----------------------------------------------------------------


def test_update_vectors_are_global_minus_local_flattened_in_key_order():
    g = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    c1 = {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([[1.0]])}
    c2 = {"a": torch.tensor([1.0, 4.0]), "b": torch.tensor([[3.0]])}
    u = update_vectors(g, [c1, c2], ["a", "b"])
    assert u.dtype == torch.float32 and torch.equal(u, torch.tensor([[1.0, 0.0, 2.0], [0.0, -2.0, 0.0]]))
    assert update_vectors({k: v.double() for k, v in g.items()}, [c1, c2], ["a", "b"]).dtype == torch.float64


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gram_similarity_equals_naive_k_squared_loop(mode, seed):
    blocks = random_blocks(seed)
    sim = similarity(blocks, mode)
    assert sim.shape == (4, 4) and sim.dtype == torch.float64
    assert torch.allclose(sim, naive_similarity(blocks, mode), atol=1e-12)
    assert torch.allclose(sim, sim.T)


def test_stacked_matrix_equals_block_list_for_total_and_chunking_is_exact():
    blocks = random_blocks(3)
    stacked = torch.cat([b.reshape(4, -1) for b in blocks], dim=1)
    assert torch.allclose(similarity(stacked), similarity(blocks), atol=1e-14)
    assert torch.allclose(similarity(blocks, chunk_elements=1), similarity(blocks), atol=1e-14)


def test_total_similarity_is_float64_exact_on_a_million_parameters():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1_000_000, generator=gen)
    u = torch.stack([base, base + 1e-3 * torch.randn(1_000_000, generator=gen), -base])
    ref = u.double() @ u.double().T
    ref = ref / torch.outer(ref.diagonal().sqrt(), ref.diagonal().sqrt())
    sim = similarity(u, chunk_elements=100_003)
    assert torch.allclose(sim, ref, atol=1e-12, rtol=0)
    assert sim[0, 2] == pytest.approx(-1.0, abs=1e-12)


def test_zero_updates_give_zero_cosine_without_nan():
    u = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
    sim = similarity(u)
    assert torch.isfinite(sim).all()
    assert sim.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


@pytest.mark.parametrize(
    "updates, mode, match",
    [
        (torch.ones(2, 3), "bogus", "mode"),
        (torch.ones(2, 3), "split", "per-tensor"),
        ([torch.ones(2, 3), torch.ones(3, 3)], "total", "block 1"),
        ([torch.tensor([[float("nan")], [1.0]])], "total", r"client\(s\) \[0\]"),
    ],
)
def test_bad_similarity_arguments_are_named(updates, mode, match):
    with pytest.raises(ValueError, match=match):
        similarity(updates, mode)


# --- consistency and re-weighting ------------------------------------------------------------------


def test_self_include_is_row_sum_and_exclude_is_mean_of_others():
    a, b, c = 0.5, -0.25, 0.1
    sim = torch.tensor([[1.0, a, b], [a, 1.0, c], [b, c, 1.0]], dtype=torch.float64)
    include = consistency(sim, "include")
    exclude = consistency(sim, "exclude")
    assert torch.allclose(include, torch.tensor([1 + a + b, 1 + a + c, 1 + b + c], dtype=torch.float64))
    assert torch.allclose(exclude, torch.tensor([(a + b) / 2, (a + c) / 2, (b + c) / 2], dtype=torch.float64))
    with pytest.raises(ValueError, match="self_mode"):
        consistency(sim, "both")


@pytest.mark.parametrize(
    "c, p, expected",
    [
        ([0.5, 0.5], [1, 1], [0.5, 0.5]),  # equal consistency: p' = p
        ([0.5, 0.5], [1, 3], [0.25, 0.75]),
        ([2.0, 4.0], [1, 1], [1 / 3, 2 / 3]),  # scaling by max c does not change p'
        ([-1.0, 0.0, 1.0], [1, 1, 1], [0.001 / 3.003, 1.001 / 3.003, 2.001 / 3.003]),  # shift by -min + 1e-3
        ([0.0, 0.0], [1, 1], [0.5, 0.5]),  # no information: p
        ([0.0, 1.0], [1, 1], [0.001 / 1.002, 1.001 / 1.002]),  # c_k = 0 still gets p'_k > 0
    ],
)
def test_reweight_probs_closed_forms(c, p, expected):
    out = reweight_probs(torch.tensor(c), p)
    assert torch.allclose(out, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
    assert out.sum().item() == pytest.approx(1.0) and ((out > 0) & (out < 1)).all()


def test_reweight_probs_rejects_bad_input():
    with pytest.raises(ValueError, match="c/p"):
        reweight_probs([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="c:"):
        reweight_probs([float("nan"), 1.0], [1, 1])
    with pytest.raises(ValueError, match="weight"):
        reweight_probs([1.0, 1.0], [0, 0])


# --- the server step -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("self_mode", ["include", "exclude"])
def test_identical_updates_give_uniform_weights(mode, self_mode):
    u = torch.tensor([[1.0, -2.0, 0.5]]).repeat(3, 1)
    g, clients = make_states({"w": u, "b": u[:, :1]})
    _, info = grace_step(g, clients, [1, 1, 1], mode=mode, self_mode=self_mode)
    assert torch.allclose(info["p_prime"], torch.full((3,), 1 / 3, dtype=torch.float64))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("self_mode", ["include", "exclude"])
def test_opposing_update_gets_the_smallest_weight(mode, self_mode):
    w = torch.tensor([[1.0, 0.1, 0.0], [1.0, 0.0, 0.1], [0.9, 0.1, 0.1], [-1.0, 0.0, 0.0]])
    g, clients = make_states({"w": w, "b": w[:, :2]})
    _, info = grace_step(g, clients, [1, 1, 1, 1], mode=mode, self_mode=self_mode)
    p = info["p_prime"]
    assert int(p.argmin()) == 3 and p[3] < p[:3].min()
    assert p.sum().item() == pytest.approx(1.0) and ((p > 0) & (p < 1)).all()


def test_three_site_gram_closed_form_paper_and_reference_code_rules():
    # unit directions with cos(1,2) = 0.6, cos(1,3) = -0.8, cos(2,3) = 0, scaled by different norms (the
    # cosine ignores them): Gram matrix G = D C D, D = diag(2, 1, 3)
    dirs = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [-0.8, 0.6, 0.0]], dtype=torch.float64)
    updates = dirs * torch.tensor([[2.0], [1.0], [3.0]], dtype=torch.float64)
    cos = torch.tensor([[1.0, 0.6, -0.8], [0.6, 1.0, 0.0], [-0.8, 0.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(updates @ updates.T, torch.diag(torch.tensor([2.0, 1, 3])).double() @ cos
                          @ torch.diag(torch.tensor([2.0, 1, 3])).double())
    g, clients = make_states({"w": updates}, {"w": torch.zeros(3, dtype=torch.float64)})
    n = [1, 2, 1]
    p = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)

    # reference code (exclude): c = mean over the others = (-0.1, 0.3, -0.4); min < 0 -> c - min + 1e-3
    c = torch.tensor([0.301, 0.701, 0.001], dtype=torch.float64)  # max <= 1: no division
    expected_ref = c * p / (c * p).sum()
    new, info = grace_step(g, clients, n, self_mode="exclude")
    assert torch.allclose(info["sim"], cos, atol=1e-12)
    assert torch.allclose(info["consistency"], torch.tensor([-0.1, 0.3, -0.4], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(info["p_prime"], expected_ref, atol=1e-12)
    assert torch.allclose(new["w"], -(expected_ref[:, None] * updates).sum(0), atol=1e-12)  # theta_g - sum p' g
    # site 3 (opposes site 1, orthogonal to site 2) keeps ~0.06 % of the weight instead of its n_k share 25 %
    assert expected_ref[2] < 1e-3

    # paper (include): c = 1 + row sum of the others = (0.8, 1.6, 0.2); all > 0, no shift; max > 1 -> / 1.6
    c = torch.tensor([0.8, 1.6, 0.2], dtype=torch.float64) / 1.6
    expected_paper = c * p / (c * p).sum()
    _, info = grace_step(g, clients, n, self_mode="include")
    assert torch.allclose(info["p_prime"], expected_paper, atol=1e-12)
    assert torch.allclose(expected_paper, torch.tensor([0.125, 0.5, 0.03125], dtype=torch.float64) / 0.65625)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_sum_to_one_and_lie_in_open_unit_interval(seed):
    gen = torch.Generator().manual_seed(seed)
    g, clients = make_states({"w": torch.randn(5, 4, 3, generator=gen), "b": torch.randn(5, 3, generator=gen)})
    _, info = grace_step(g, clients, [3, 1, 4, 1, 5])
    p = info["p_prime"]
    assert p.sum().item() == pytest.approx(1.0) and ((p > 0) & (p < 1)).all()
    assert info["sim"].shape == (5, 5) and info["consistency"].shape == (5,)


def test_two_sites_with_equal_weights_is_fedavg():
    # K = 2: Sigma is symmetric, so c_1 = c_2 and p' = p whatever the updates are.
    gen = torch.Generator().manual_seed(0)
    g, clients = make_states({"w": torch.randn(2, 3, 3, generator=gen), "b": torch.randn(2, 3, generator=gen)})
    new, info = grace_step(g, clients, [10, 10], eta_g=1.0)
    fedavg = weighted_average(clients, [1, 1])
    assert torch.allclose(info["p_prime"], torch.tensor([0.5, 0.5], dtype=torch.float64))
    for key in fedavg:
        assert torch.allclose(new[key], fedavg[key], atol=1e-6)


def test_symmetric_updates_give_uniform_weights_and_fedavg():
    # three updates at 120 degrees: every c_k is 0 (include), so p' = p and the step is FedAvg.
    # float64: after the +1e-3 shift, rounding noise in c ~ 0 shows up in p' magnified ~1000x
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=torch.float64)
    g, clients = make_states({"w": torch.stack([angles.cos(), angles.sin()], dim=1)},
                             {"w": torch.tensor([0.5, 0.5], dtype=torch.float64)})
    new, info = grace_step(g, clients, [1, 1, 1])
    assert torch.allclose(info["p_prime"], torch.full((3,), 1 / 3, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(new["w"], weighted_average(clients, [1, 1, 1])["w"], atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_eta_one_is_p_prime_weighted_mean_and_eta_scales_the_step(mode):
    gen = torch.Generator().manual_seed(4)
    g, clients = make_states({"w": torch.randn(3, 4, generator=gen), "b": torch.randn(3, 2, generator=gen)})
    new, info = grace_step(g, clients, [1, 2, 3], mode=mode)
    mean = weighted_average(clients, info["p_prime"].tolist())
    half, _ = grace_step(g, clients, [1, 2, 3], eta_g=0.5, mode=mode)
    for key in g:
        assert torch.allclose(new[key], mean[key], atol=1e-6)
        assert torch.allclose(half[key], 0.5 * (g[key] + new[key]), atol=1e-6)


def test_bn_buffers_of_a_monai_unet_are_averaged_with_p_prime_and_inputs_not_mutated():
    net = build_unet({"channels": [4, 8], "strides": [2], "norm": "batch"})
    trainable, buffers = grace_keys(net)
    assert set(buffers) == norm_keys(net) - set(trainable)
    assert any(k.endswith("running_mean") for k in buffers) and any(k.endswith("num_batches_tracked") for k in buffers)
    assert set(trainable) == {n for n, _ in net.named_parameters()}

    gen = torch.Generator().manual_seed(0)
    g = {k: v.clone() for k, v in net.state_dict().items()}
    clients = []
    for i in range(3):
        s = {}
        for k, v in g.items():
            if v.is_floating_point():
                sign = 1.0 if i < 2 else -1.0  # site 2 moves the other way
                s[k] = v + sign * 0.1 * torch.ones_like(v) + 0.01 * torch.randn(v.shape, generator=gen)
            else:
                s[k] = v + 10 * i + 1
        clients.append(s)
    g_before, clients_before = copy.deepcopy(g), copy.deepcopy(clients)

    new, info = grace_step(g, clients, [1, 1, 1], trainable_keys=trainable, buffer_keys=buffers)
    p = info["p_prime"]
    assert p[2] < p[0] and p[2] < p[1]  # the opposing site weighs less ...
    expected = weighted_average(clients, p.tolist(), keys=buffers)
    for k in buffers:  # ... in the running statistics too
        assert new[k].dtype == g[k].dtype and torch.equal(new[k], expected[k])
    nbt = next(k for k in buffers if k.endswith("num_batches_tracked"))
    assert int(new[nbt]) == round(sum(float(p[i]) * int(clients[i][nbt]) for i in range(3)))
    assert set(new) == set(g)
    for k in g:
        assert torch.equal(g[k], g_before[k])
        for c, cb in zip(clients, clients_before):
            assert torch.equal(c[k], cb[k])


def test_other_keys_are_copied_unchanged():
    g = {"w": torch.zeros(2), "extra": torch.tensor([7.0])}
    clients = [{"w": torch.tensor([1.0, 0.0]), "extra": torch.tensor([1.0])},
               {"w": torch.tensor([0.0, 1.0]), "extra": torch.tensor([2.0])}]
    new, _ = grace_step(g, clients, [1, 1], trainable_keys=["w"])
    assert torch.equal(new["extra"], g["extra"]) and new["extra"] is not g["extra"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"client_states": "one"}, "K=1"),
        ({"weights": [1]}, "weights"),
        ({"mode": "layers"}, "mode"),
        ({"self_mode": "x"}, "self_mode"),
        ({"eta_g": 0.0}, "eta_g"),
        ({"trainable_keys": ["w"], "buffer_keys": ["w"]}, "overlap"),
        ({"trainable_keys": ["missing"]}, "missing"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    g = {"w": torch.zeros(2)}
    clients = [{"w": torch.ones(2)}, {"w": -torch.ones(2)}]
    args = {"global_state": g, "client_states": clients, "weights": [1, 1], **kwargs}
    if args["client_states"] == "one":
        args["client_states"], args["weights"] = clients[:1], [1]
    with pytest.raises((ValueError, KeyError), match=match):
        grace_step(**args)


def test_matches_naive_computation_end_to_end():
    gen = torch.Generator().manual_seed(7)
    g, clients = make_states({"w": torch.randn(4, 3, generator=gen), "b": torch.randn(4, 2, generator=gen)})
    new, info = grace_step(g, clients, [1, 2, 3, 4], mode="reweight", self_mode="exclude")
    blocks = [update_vectors(g, clients, [k]) for k in ["w", "b"]]
    sim = naive_similarity(blocks, "reweight")
    c = torch.stack([(sim[i].sum() - sim[i, i]) / 3 for i in range(4)])
    if c.min() <= 0:
        c = c - c.min() + 1e-3
    pc = c * torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    assert torch.allclose(info["p_prime"], pc / pc.sum(), atol=1e-12)
    upd = update_vectors(g, clients, ["w", "b"]).double()
    step = (info["p_prime"][:, None] * upd).sum(0)
    stepped = torch.cat([g["w"], g["b"]]).double() - step
    assert torch.allclose(torch.cat([new["w"], new["b"]]).double(), stepped, atol=1e-6)
    assert F.cosine_similarity(upd[0], upd[1], dim=0).item() != 0  # a non-degenerate example


def _stacked_reference_step(g, clients, p_prime, eta_g):
    """The former formulation of the step (stacked float64 copies, then ``g - eta_g * p' U``)."""
    out = {}
    for key, ref in g.items():
        block = ref.double().reshape(1, -1) - torch.stack([c[key].double().reshape(-1) for c in clients])
        out[key] = (ref.double() - eta_g * (p_prime[None, :] @ block).reshape(ref.shape)).to(ref.dtype)
    return out


@pytest.mark.parametrize("eta_g", [1.0, 0.7])
@pytest.mark.parametrize("rule", ["mean", "trimmed_mean"])
def test_kept_and_recomputed_blocks_give_bit_identical_steps(monkeypatch, eta_g, rule):
    import pflseg.algorithms.grace as grace_mod

    torch.manual_seed(3)
    g = {"w": torch.randn(4, 3, 3), "b": torch.randn(5), "h": torch.randn(2, 7, dtype=torch.float64)}
    clients = [{k: v + 1e-2 * torch.randn_like(v) for k, v in g.items()} for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    kept, info = grace_step(g, clients, weights, eta_g=eta_g, rule=rule, trim=0.2)
    monkeypatch.setattr(grace_mod, "KEEP_BLOCKS_BYTES", 0)
    recomputed, info2 = grace_step(g, clients, weights, eta_g=eta_g, rule=rule, trim=0.2)
    assert torch.equal(info["sim"], info2["sim"]) and torch.equal(info["p_prime"], info2["p_prime"])
    for key in g:
        assert torch.equal(kept[key], recomputed[key]) and kept[key].dtype == g[key].dtype
    if rule == "mean":
        expected = _stacked_reference_step(g, clients, info["p_prime"], eta_g)
        for key in g:
            assert torch.equal(kept[key], expected[key])


def test_update_blocks_equal_the_stacked_differences_in_the_promoted_dtype():
    torch.manual_seed(4)
    g = {"w": torch.randn(6, 5), "v": torch.randn(3, dtype=torch.float16)}
    clients = [{k: v + torch.randn_like(v) for k, v in g.items()} for _ in range(3)]
    keys = ["w", "v"]
    expected = torch.cat([g[k].float().reshape(1, -1) - torch.stack([c[k].float().reshape(-1) for c in clients])
                          for k in keys], dim=1)  # float32 and float16 inputs: float32 updates
    u = update_vectors(g, clients, keys)
    assert u.dtype == torch.float32 and torch.equal(u, expected)
