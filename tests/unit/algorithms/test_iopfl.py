import pytest
import torch

from pflseg.algorithms.iopfl import average_states, ema_update, paper_eq4_update, update_person


def test_first_round_copies_the_local_model():
    local = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    person = ema_update(None, local)
    assert torch.equal(person["w"], local["w"]) and person["w"].data_ptr() != local["w"].data_ptr()
    local["w"] += 1  # no aliasing: P_k keeps its value
    assert torch.equal(person["w"], torch.tensor([1.0, 2.0]))


def test_ema_rule_against_hand_computation():
    person = {"w": torch.tensor([1.0, -2.0]), "n": torch.tensor(3)}
    local = {"w": torch.tensor([3.0, 2.0]), "n": torch.tensor(5)}
    out = ema_update(person, local, tau=0.9)
    # 0.1 * 1 + 0.9 * 3 = 2.8 ; 0.1 * -2 + 0.9 * 2 = 1.6
    assert torch.allclose(out["w"], torch.tensor([2.8, 1.6]))
    assert out["n"].item() == 5  # integer buffers take the newest value
    assert torch.equal(person["w"], torch.tensor([1.0, -2.0]))  # inputs untouched


def test_paper_eq4_rule_against_hand_computation():
    person = {"w": torch.tensor([1.0])}
    local, g_now, g_prev = {"w": torch.tensor([4.0])}, {"w": torch.tensor([3.0])}, {"w": torch.tensor([2.5])}
    out = paper_eq4_update(person, local, g_now, g_prev, tau=0.5)
    # 0.5 * 1 + 0.5 * ((4 - 3) + (3 - 2.5)) = 0.5 + 0.75
    assert torch.allclose(out["w"], torch.tensor([1.25]))
    assert torch.allclose(update_person("paper_eq4", person, local, g_now, None, 0.5)["w"], torch.tensor([1.0]))


@pytest.mark.parametrize("bad", [{"rule": "nope"}, {"tau": 1.5}])
def test_bad_arguments_are_named(bad):
    args = {"rule": "ema", "tau": 0.9, **bad}
    with pytest.raises(ValueError, match="rule|tau"):
        update_person(args["rule"], {"w": torch.ones(1)}, {"w": torch.ones(1)}, {"w": torch.ones(1)}, None, args["tau"])


def test_average_states():
    out = average_states([{"w": torch.tensor([0.0, 2.0])}, {"w": torch.tensor([2.0, 4.0])}])
    assert torch.equal(out["w"], torch.tensor([1.0, 3.0]))
