import math

import numpy as np
import pytest
import torch

from pflseg.algorithms.alignment import (
    DomainDiscriminator,
    adversarial_alignment,
    coral,
    grad_reverse,
    mmd,
    pixel_samples,
)


def as_map(channels):
    """(d, N) list of per-channel pixel values -> feature map (1, d, 1, N)."""
    return torch.tensor(channels, dtype=torch.float64)[None, :, None, :]


def test_pixel_samples_makes_every_pixel_a_sample():
    f = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2)
    x = pixel_samples(f)
    assert x.shape == (8, 3)
    assert torch.equal(x[5], f[1, :, 0, 1])  # sample order: batch, then rows, then columns


@pytest.mark.parametrize(
    "local, global_, expected",
    [
        # Cov_l = [[1, 0], [0, 0]], Cov_g = 0: ||diff||^2 = 1, / (4 * 2^2)
        ([[1, -1, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]], 1 / 16),
        # Cov_g = [[0, 0], [0, 4]]: diff = diag(1, -4), ||diff||^2 = 17
        ([[1, -1, 0], [0, 0, 0]], [[0, 0, 0], [2, -2, 0]], 17 / 16),
        # a mean shift alone changes nothing
        ([[1, -1, 0], [0, 0, 0]], [[6, 4, 5], [3, 3, 3]], 0.0),
        # Cov_l = [[1, 1], [1, 1]] (perfectly correlated), Cov_g = I: diff = [[0, 1], [1, 0]]
        ([[1, -1, 0], [1, -1, 0]], [[1, -1, 0, 0], [0, 0, 1, -1]], None),
    ],
)
def test_coral_closed_forms(local, global_, expected):
    if expected is None:
        # Cov_g of the 4 samples (unbiased): diag(2/3, 2/3); diff = [[1/3, 1], [1, 1/3]]
        expected = (2 * (1 / 3) ** 2 + 2 * 1.0) / 16
    assert coral(as_map(local), as_map(global_)).item() == pytest.approx(expected, abs=1e-12)


def test_coral_zero_for_identical_positive_otherwise_and_matches_numpy():
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    h = torch.randn(3, 3, 2, 5, generator=gen, dtype=torch.float64) * 2.0
    assert coral(f, f.clone()).item() == 0.0
    ref = ((np.cov(pixel_samples(f).numpy().T) - np.cov(pixel_samples(h).numpy().T)) ** 2).sum() / (4 * 9)
    value = coral(f, h)
    assert value.item() > 0 and value.item() == pytest.approx(ref, rel=1e-10)


def test_coral_is_differentiable_and_checks_channels():
    f = torch.randn(1, 2, 3, 3, requires_grad=True)
    coral(f, torch.randn(1, 2, 3, 3) * 3).backward()
    assert f.grad is not None and f.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="channel"):
        coral(torch.randn(1, 2, 3, 3), torch.randn(1, 3, 3, 3))


def test_mmd_single_sample_closed_form():
    sigmas = (1.0, 2.0, 4.0, 8.0, 16.0)
    x, y = torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    expected = 2 * len(sigmas) - 2 * sum(math.exp(-1 / (2 * s * s)) for s in sigmas)
    assert mmd(x, y).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("max_samples", [1024, 7])
def test_mmd_zero_for_identical_and_positive_for_shifted(max_samples):
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(2, 3, 4, 4, generator=gen)
    assert mmd(f, f.clone(), max_samples=max_samples).item() == pytest.approx(0.0, abs=1e-6)
    near, far = mmd(f, f + 0.5, max_samples=max_samples).item(), mmd(f, f + 3.0, max_samples=max_samples).item()
    assert 0 < near < far


def test_mmd_subsampling_is_seeded():
    gen = torch.Generator().manual_seed(2)
    f, h = torch.randn(1, 2, 8, 8, generator=gen), torch.randn(1, 2, 8, 8, generator=gen) + 1
    a, b = mmd(f, h, max_samples=10, seed=3), mmd(f, h, max_samples=10, seed=3)
    assert a.item() == b.item() and mmd(f, h, max_samples=10, seed=4).item() != a.item()
    with pytest.raises(ValueError, match="sigmas"):
        mmd(f, h, sigmas=(1.0, -1.0))


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_grad_reverse_flips_the_gradient_sign(lam):
    x = torch.randn(3, requires_grad=True)
    w = torch.tensor([1.0, -2.0, 3.0])
    y = grad_reverse(x, lam)
    assert torch.equal(y, x)
    (y * w).sum().backward()
    assert torch.allclose(x.grad, -lam * w)


def test_adversarial_alignment_reverses_feature_gradient_but_trains_discriminator_normally():
    torch.manual_seed(0)
    disc = DomainDiscriminator(3, hidden=4)
    f_local = torch.randn(2, 3, 4, 4, requires_grad=True)
    f_global = torch.randn(2, 3, 4, 4)

    loss = adversarial_alignment(disc, f_local, f_global)
    assert loss.dim() == 0 and disc(f_local).shape == (2, 1)
    loss.backward()
    rev_feat = f_local.grad.clone()
    rev_disc = [p.grad.clone() for p in disc.parameters()]

    # the same BCE without reversal
    f_local.grad = None
    disc.zero_grad()
    z = torch.cat([disc(f_local).reshape(-1), disc(f_global).reshape(-1)])
    t = torch.tensor([1.0, 1.0, 0.0, 0.0])
    plain = torch.nn.functional.binary_cross_entropy_with_logits(z, t)
    assert plain.item() == pytest.approx(loss.item())
    plain.backward()
    assert rev_feat.abs().sum() > 0 and torch.allclose(rev_feat, -f_local.grad)
    for a, b in zip(rev_disc, disc.parameters()):
        assert torch.allclose(a, b.grad)
