"""Clip + Gaussian noise on a site's update (pflseg.algorithms.dp): closed forms on small hand-made dicts."""

import math

import pytest
import torch

from pflseg.algorithms.dp import (
    add_noise,
    clip_update,
    floor_at,
    fresh_generator,
    privatize,
    update_norm,
    zcdp_epsilon,
)


def update():
    return {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]]), "n": torch.tensor(7, dtype=torch.int64)}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_norm_counts_float_coordinates_only():
    assert update_norm(update()) == pytest.approx(5.0)  # sqrt(3^2 + 4^2); the int 7 is not a coordinate


@pytest.mark.parametrize("clip, expected", [(1.0, 0.2), (2.5, 0.5), (5.0, 1.0), (100.0, 1.0)])
def test_clip_scales_the_whole_update_to_at_most_c(clip, expected):
    out, norm = clip_update(update(), clip)
    assert norm == pytest.approx(5.0)
    assert update_norm(out) == pytest.approx(min(clip, 5.0), rel=1e-6)
    assert torch.allclose(out["a"], torch.tensor([3.0, 0.0]) * expected)  # one scale for every tensor
    assert torch.allclose(out["b"], torch.tensor([[0.0, 4.0]]) * expected)


def test_clip_bounds_the_norm_of_random_updates():
    g = gen(1)
    for scale in (1e-4, 1.0, 1e4):
        big = {f"w{i}": torch.randn(17, 5, generator=g) * scale for i in range(4)}
        assert update_norm(clip_update(big, 0.7)[0]) <= 0.7 * (1 + 1e-6)


def test_int_buffers_untouched_by_clip_and_noise():
    before = update()
    out, _ = privatize(before, 0.1, 3.0, gen())
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7
    assert before["a"].tolist() == [3.0, 0.0]  # the input is not changed in place


def test_noise_std_is_sigma_times_c():
    sigma, clip = 0.8, 0.5
    zeros = {"w": torch.zeros(200_000), "v": torch.zeros(50, 100)}
    out, norm = privatize(zeros, clip, sigma, gen(3))
    assert norm == 0.0
    noise = torch.cat([out["w"], out["v"].flatten()])
    assert float(noise.mean()) == pytest.approx(0.0, abs=0.01)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.01)  # 250k draws: std error ~0.14 %


def test_clip_then_noise_keeps_the_clipped_signal():
    out, _ = privatize({"w": torch.full((100_000,), 1.0)}, clip=1.0, noise_multiplier=0.5, generator=gen())
    # clipped to norm 1: each coordinate 1/sqrt(1e5); the noise has std 0.5 around it
    assert float(out["w"].mean()) == pytest.approx(1 / math.sqrt(1e5), abs=0.005)
    assert float(out["w"].std()) == pytest.approx(0.5, rel=0.02)


def test_same_seed_same_noise_other_seed_other_noise():
    a, _ = privatize(update(), 1.0, 1.0, gen(42))
    b, _ = privatize(dict(reversed(list(update().items()))), 1.0, 1.0, gen(42))  # key order does not matter
    c, _ = privatize(update(), 1.0, 1.0, gen(43))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["a"], c["a"])


def test_fresh_generators_draw_independent_noise_of_the_configured_std():
    sigma, clip = 0.8, 0.5
    zeros = {"w": torch.zeros(200_000)}
    a, _ = privatize(zeros, clip, sigma, fresh_generator())
    b, _ = privatize(zeros, clip, sigma, fresh_generator())
    assert float(a["w"].std()) == pytest.approx(sigma * clip, rel=0.01)
    assert float(torch.corrcoef(torch.stack([a["w"], b["w"]]))[0, 1]) == pytest.approx(0.0, abs=0.01)  # se 0.0022


def test_noise_keeps_dtype():
    out = add_noise({"h": torch.zeros(4, dtype=torch.float16), "d": torch.zeros(4, dtype=torch.float64)}, 1.0, gen())
    assert out["h"].dtype == torch.float16 and out["d"].dtype == torch.float64
    assert out["d"].abs().sum() > 0


def test_no_clip_no_noise_is_identity_and_noise_without_clip_is_refused():
    out, norm = privatize(update(), None, 0.0)
    assert all(torch.equal(out[k], update()[k]) for k in out) and norm == pytest.approx(5.0)
    with pytest.raises(ValueError, match="needs a clip"):
        privatize(update(), None, 1.0, gen())
    with pytest.raises(ValueError, match="generator"):
        privatize(update(), 1.0, 1.0, None)
    with pytest.raises(ValueError, match="clip"):
        clip_update(update(), 0.0)


def test_floor_keeps_reference_plus_update_nonnegative():
    ref = {"var": torch.tensor([0.5, 0.1, 2.0])}
    out = floor_at({"var": torch.tensor([-1.0, 0.2, -0.5]), "w": torch.tensor([-9.0])}, ref, ["var", "missing"])
    assert torch.allclose(ref["var"] + out["var"], torch.tensor([0.0, 0.3, 1.5]))
    assert out["w"].item() == -9.0  # keys not named are left alone


def test_zcdp_epsilon_closed_form():
    # rho = T s^2 / (2 sigma^2) = 10 * 4 / 2 = 20; eps = 20 + 2 sqrt(20 ln 1e5)
    assert zcdp_epsilon(1.0, 10, 1e-5) == pytest.approx(20 + 2 * math.sqrt(20 * math.log(1e5)))
    assert zcdp_epsilon(2.0, 10, 1e-5, sensitivity=1.0) < zcdp_epsilon(1.0, 10, 1e-5, sensitivity=1.0)
    assert zcdp_epsilon(0.0, 1, 1e-5) == math.inf
    assert zcdp_epsilon(1.0, 0, 1e-5) == 0.0
