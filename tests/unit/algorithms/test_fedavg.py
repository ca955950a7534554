import pytest
import torch

from pflseg.algorithms.fedavg import normalized_weights, weighted_average


def test_weighted_average_matches_closed_form():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(8)}
    out = weighted_average([a, b], [1, 3])
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]))  # 0.25 * a + 0.75 * b
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7


def test_inputs_are_not_mutated():
    a, b = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    weighted_average([a, b], [1, 1])
    assert torch.equal(a["w"], torch.ones(3)) and torch.equal(b["w"], torch.zeros(3))


def test_only_requested_keys():
    a, b = {"x": torch.ones(1), "y": torch.ones(1)}, {"x": torch.zeros(1), "y": torch.zeros(1)}
    assert set(weighted_average([a, b], [1, 1], keys=["x"])) == {"x"}


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2], [float("nan"), 1], []])
def test_bad_weights_are_rejected(weights):
    with pytest.raises(ValueError, match="weight"):
        normalized_weights(weights)


def test_shape_mismatch_names_the_key():
    with pytest.raises(ValueError, match="'w'"):
        weighted_average([{"w": torch.ones(2)}, {"w": torch.ones(3)}], [1, 1])


@pytest.mark.parametrize("other", [torch.float64, torch.int64])
def test_dtype_mismatch_names_the_key_instead_of_following_the_first_state(other):
    with pytest.raises(ValueError, match=r"'w'.*dtype"):
        weighted_average([{"w": torch.ones(2)}, {"w": torch.ones(2, dtype=other)}], [1, 1])
    with pytest.raises(ValueError, match=r"'w'.*dtype"):
        weighted_average([{"w": torch.ones(2, dtype=other)}, {"w": torch.ones(2)}], [1, 1])


def test_the_blocked_average_is_the_whole_tensor_float64_average_bit_for_bit():
    """weighted_average works BLOCK elements at a time; across 2.5 blocks, a 0-d tensor and an integer buffer it
    equals acc = sum_k p_k * float64(w_k) over whole tensors, in site order, cast back: bit for bit."""
    from pflseg.algorithms.fedavg import BLOCK

    torch.manual_seed(0)
    states = [{"w": torch.randn(int(2.5 * BLOCK)), "s": torch.randn(()), "n": torch.tensor(7 + k)} for k in range(3)]
    weights = [3.0, 1.0, 2.0]
    out = weighted_average(states, weights)
    p = normalized_weights(weights)
    for key, ref in states[0].items():
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for pk, s in zip(p, states):
            acc += s[key].double() * pk
        expect = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
        assert out[key].dtype == ref.dtype and out[key].shape == ref.shape and torch.equal(out[key], expect), key
