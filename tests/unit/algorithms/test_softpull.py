import pytest
import torch

from pflseg.algorithms.fedavg import weighted_average
from pflseg.algorithms.softpull import check_lam, lam_for, mixing_matrix, softpull


def _states():
    # K = 3 personalized states: a float parameter and an integer buffer.
    return [
        {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "n": torch.tensor(3)},
        {"w": torch.tensor([[5.0, 6.0], [7.0, 8.0]]), "n": torch.tensor(6)},
        {"w": torch.tensor([[0.0, -3.0], [9.0, 1.0]]), "n": torch.tensor(11)},
    ]


def test_lam_one_returns_equal_values_in_new_objects():
    states = _states()
    out = softpull(states, lam=1.0)
    assert len(out) == 3
    for before, after in zip(states, out):
        assert after is not before
        for key in before:
            assert after[key] is not before[key]
            assert after[key].dtype == before[key].dtype
            assert torch.equal(after[key], before[key])


def test_lam_one_over_k_is_the_unweighted_fedavg_of_the_personalized_models():
    states = _states()
    mean = weighted_average(states, [1, 1, 1])
    out = softpull(states, lam=1 / 3)
    for k in range(3):
        assert torch.allclose(out[k]["w"], mean["w"])
        assert torch.equal(out[k]["n"], mean["n"])  # (3 + 6 + 11) / 3 = 6.67 -> 7


def test_closed_form_for_lam_0_7():
    states = _states()
    out = softpull(states, lam=0.7)
    # site 0: 0.7 * w0 + 0.15 * (w1 + w2)
    expected = 0.7 * states[0]["w"] + 0.15 * (states[1]["w"] + states[2]["w"])
    assert torch.allclose(out[0]["w"], expected)
    assert out[0]["n"].dtype == torch.int64 and int(out[0]["n"]) == 5  # 0.7 * 3 + 0.15 * (6 + 11) = 4.65 -> 5


def test_integer_buffer_rounds_half_to_even_like_torch_round():
    a, b = {"n": torch.tensor(1, dtype=torch.int32)}, {"n": torch.tensor(2, dtype=torch.int32)}
    out = softpull([a, b], lam=0.5)  # both 1.5
    assert out[0]["n"].dtype == torch.int32 and int(out[0]["n"]) == 2 and int(out[1]["n"]) == 2


@pytest.mark.parametrize("num_sites, lam", [(2, 0.5), (3, 1 / 3), (3, 0.7), (4, 0.3), (6, 1.0)])
def test_mixing_matrix_rows_sum_to_one(num_sites, lam):
    m = mixing_matrix(num_sites, lam)
    assert m.shape == (num_sites, num_sites) and m.dtype == torch.float64
    assert torch.allclose(m.sum(dim=1), torch.ones(num_sites, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(m.diagonal(), torch.full((num_sites,), lam, dtype=torch.float64))


@pytest.mark.parametrize("lam", [0.25, 0.3, 0.7, 1.0])
def test_every_parameter_mixing_coefficients_sum_to_one(lam):
    # Feed indicator states (site j holds 1, the others 0): output k then holds coefficient M[k, j].
    num_sites, shape = 4, (2, 3)
    coeffs = torch.zeros(num_sites, num_sites, *shape, dtype=torch.float64)
    for j in range(num_sites):
        states = [{"w": torch.full(shape, float(i == j), dtype=torch.float64)} for i in range(num_sites)]
        for k, out in enumerate(softpull(states, lam)):
            coeffs[k, j] = out["w"]
    # Every element of every output model is a convex combination: coefficients sum to 1.
    assert torch.allclose(coeffs.sum(dim=1), torch.ones(num_sites, *shape, dtype=torch.float64), atol=1e-12)
    assert (coeffs >= 0).all()
    # And a state that is the same at every site is a fixed point.
    same = [{"w": torch.full(shape, 2.5)} for _ in range(num_sites)]
    assert all(torch.allclose(o["w"], torch.full(shape, 2.5)) for o in softpull(same, lam))


def test_inputs_are_not_mutated():
    states = _states()
    copies = [{k: v.clone() for k, v in s.items()} for s in states]
    softpull(states, lam=0.5)
    for s, c in zip(states, copies):
        assert all(torch.equal(s[k], c[k]) for k in c)


def test_single_site_returns_a_copy():
    s = {"w": torch.tensor([1.0, 2.0])}
    (out,) = softpull([s], lam=0.7)
    assert out["w"] is not s["w"] and torch.equal(out["w"], s["w"])


@pytest.mark.parametrize("num_sites, lam", [(3, 0.2), (2, 0.49), (3, 1.01), (2, float("nan")), (4, -1.0)])
def test_out_of_range_lam_is_rejected_naming_lam_and_k(num_sites, lam):
    states = [{"w": torch.zeros(1)} for _ in range(num_sites)]
    with pytest.raises(ValueError, match=rf"lam.*K = {num_sites}"):
        softpull(states, lam)
    with pytest.raises(ValueError, match="lam"):
        mixing_matrix(num_sites, lam)


def test_mismatched_states_name_the_key():
    with pytest.raises(KeyError, match="'v'"):
        softpull([{"w": torch.zeros(1)}, {"w": torch.zeros(1), "v": torch.zeros(1)}], 0.5)
    with pytest.raises(ValueError, match="'w'"):
        softpull([{"w": torch.zeros(1)}, {"w": torch.zeros(2)}], 0.5)
    with pytest.raises(ValueError, match="states"):
        softpull([], 0.5)


@pytest.mark.parametrize("lam, k, expected", [(0.3, 3, 1 / 3), (0.3, 2, 0.5), (0.7, 2, 0.7), (0.3, 1, 1.0),
                                              (0.5, 4, 0.5)])
def test_lam_for_fewer_sites_is_at_least_one_over_their_number(lam, k, expected):
    """lam set for a larger federation, mixing the k models that came back: never below 1/k (check_lam's range)."""
    assert lam_for(lam, k) == pytest.approx(expected) and check_lam(lam_for(lam, k), k) == pytest.approx(expected)
    with pytest.raises(ValueError, match="K"):
        lam_for(lam, 0)
