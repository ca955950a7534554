"""The arithmetic of the lying site's attacks in tests/integration/evil/sitecustomize.py (issue 39 F1 / F6), which
tests/integration/attack_dice.py runs in the FLARE simulator: the update sent is 99 u, -99 u or 99 ||u|| e."""

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "integration" / "evil" / "sitecustomize.py"


@pytest.fixture(scope="module")
def evil():
    spec = importlib.util.spec_from_file_location("evil_sitecustomize", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # without PFLSEG_TEST_EVIL_SITE it patches nothing
    return module


def _round(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    received = {"global.conv.weight": torch.randn(4, 2, 3, 3, generator=gen), "global.bn.running_var": torch.ones(4),
                "global.bn.num_batches_tracked": torch.tensor(7)}
    trained = {"global.conv.weight": received["global.conv.weight"] + 0.01 * torch.randn(4, 2, 3, 3, generator=gen),
               "global.bn.running_var": received["global.bn.running_var"] + 0.1,
               "global.bn.num_batches_tracked": torch.tensor(9)}
    return received, trained


def _update(sent, received):
    return torch.cat([(sent[k].double() - received[k].double()).reshape(-1)
                      for k in ("global.conv.weight", "global.bn.running_var")])


@pytest.mark.parametrize("kind,factor", [("scaled", 99.0), ("flipped", -99.0)])
def test_scaled_and_flipped_send_plus_or_minus_99_times_the_true_update(evil, kind, factor):
    received, trained = _round()
    sent = evil.lie(kind, trained, received)
    assert torch.allclose(_update(sent, received), factor * _update(trained, received), rtol=1e-4, atol=1e-5)
    assert int(sent["global.bn.num_batches_tracked"]) == 9  # integer buffers pass as trained


def test_fixed_direction_has_99_times_the_true_norm_and_one_direction_whatever_the_round(evil):
    (r0, t0), (r1, t1) = _round(0), _round(1)
    u0, u1 = _update(evil.lie("fixed", t0, r0), r0), _update(evil.lie("fixed", t1, r1), r1)
    assert float(u0.norm()) == pytest.approx(99 * float(_update(t0, r0).norm()), rel=1e-4)
    cosine = float(u0 @ u1 / (u0.norm() * u1.norm()))
    assert cosine == pytest.approx(1.0, abs=1e-5)  # the same direction in another round / seed
    assert abs(float(u0 @ _update(t0, r0)) / float(u0.norm() * _update(t0, r0).norm())) < 0.9  # not the true one


def test_a_diff_reply_is_lied_about_as_a_difference(evil):
    received, trained = _round()
    diff = {k: trained[k] - received[k] if trained[k].is_floating_point() else trained[k] for k in trained}
    sent = evil.lie("scaled", diff, received, diff=True)
    assert torch.allclose(sent["global.conv.weight"], 99 * diff["global.conv.weight"])


def test_an_unknown_attack_is_named(evil):
    received, trained = _round()
    with pytest.raises(ValueError, match="PFLSEG_TEST_EVIL_ATTACK='bogus'"):
        evil.lie("bogus", trained, received)
