"""The site side of ``privacy.update`` (``Site.private_update``): defaults send the trained weights unchanged;
``send: diff`` sends trained - received as FLARE's DIFF; ``dp`` clips and noises the aggregated model weights."""

import math

import pytest
import torch
from nvflare.app_common.abstract.fl_model import ParamsType

from pflseg.algorithms.dp import update_norm
from pflseg.flare.controllers.base import add_diff
from pflseg.flare.state import prefixed, unprefixed


def update_privacy(send="weights", clip=None, sigma=0.0):
    return {"privacy": {"update": {"send": send, "dp": {"clip": clip, "noise_multiplier": sigma}}}}


def float_update(params: dict, sent: dict, prefix="global.") -> dict:
    return {k: params[k] - sent[k] for k in params if k.startswith(prefix) and params[k].is_floating_point()}


def test_defaults_send_the_trained_model_itself(federation):
    fed = federation("fedavg")
    site = fed.site()
    out = site.train(fed.message(0))
    assert out.params_type == ParamsType.FULL
    trained = unprefixed("model", fed.store().load(0))
    assert all(torch.equal(out.params[f"global.{k}"], v) for k, v in trained.items())  # bit for bit
    params = {"global.x": torch.ones(2)}
    assert site.private_update(params, None) == (params, ParamsType.FULL)  # nothing taken, nothing needed


def test_diff_sends_trained_minus_received_and_the_server_gets_the_model_back(federation):
    fed = federation("fedavg", **update_privacy("diff"))
    msg = fed.message(0)
    out = fed.site().train(msg)
    assert out.params_type == ParamsType.DIFF
    trained = prefixed("global", unprefixed("model", fed.store().load(0)))
    key = next(k for k, v in trained.items() if v.is_floating_point() and not torch.equal(v, msg.params[k]))
    assert torch.equal(out.params[key], trained[key] - msg.params[key])
    ints = [k for k, v in trained.items() if not v.is_floating_point()]
    assert ints and all(out.params[k].dtype == torch.int64 for k in ints)
    assert add_diff(out, msg.params, msg.params) is None
    assert all(torch.allclose(out.params[k], v, atol=1e-6) and out.params[k].dtype == v.dtype for k,
               v in trained.items())


@pytest.mark.parametrize("send", ["weights", "diff"])
def test_clip_bounds_the_update_norm_and_leaves_int_buffers(federation, send):
    fed = federation("fedavg", **update_privacy(send, clip=1e-3))
    msg = fed.message(0)
    out = fed.site().train(msg)
    full = out.params if send == "weights" else {k: msg.params[k] + v for k, v in out.params.items()}
    assert update_norm(float_update(full, msg.params)) == pytest.approx(1e-3, rel=1e-3)  # it trained further than C
    trained = prefixed("global", unprefixed("model", fed.store().load(0)))
    assert all(torch.equal(full[k], trained[k]) for k, v in trained.items() if not v.is_floating_point())


def test_noise_is_sigma_c_reproducible_per_site_and_round_and_secret_seeded(federation):
    clip, sigma = 1e-4, 10.0  # the noise (std 1e-3) dwarfs the clipped update
    fed = federation("fedavg", **update_privacy("diff", clip=clip, sigma=sigma))
    site = fed.site()
    msg = fed.message(0)
    first = site.train(msg)
    again = site.train(fed.message(0))
    floats = {k: v for k, v in first.params.items() if v.is_floating_point() and not k.endswith("running_var")}
    noise = torch.cat([v.flatten() for v in floats.values()])
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.1)
    assert all(torch.equal(first.params[k], again.params[k]) for k in first.params)  # same site, round: same noise
    other = fed.site("site-2").dp_generator(0)
    assert not torch.equal(torch.randn(8, generator=site.dp_generator(0)), torch.randn(8, generator=other))
    assert not torch.equal(torch.randn(8, generator=site.dp_generator(0)),
                           torch.randn(8, generator=site.dp_generator(1)))
    # the seed comes from the site's salt, not from anything the server knows: another salt, other noise
    (site.store.root.parent / "privacy_salt").write_text("ab" * 32)
    site.pseudonyms._salt = None
    assert not torch.equal(first.params[next(iter(floats))], site.train(fed.message(0)).params[next(iter(floats))])


def test_noise_never_makes_a_running_variance_negative(federation):
    fed = federation("fedavg", **update_privacy("weights", clip=1.0, sigma=100.0))
    msg = fed.message(0)
    out = fed.site().train(msg)
    variances = [k for k in out.params if k.endswith("running_var")]
    assert variances and all(bool((out.params[k] >= 0).all()) for k in variances)
    assert any(float(out.params[k].min()) == 0.0 for k in variances)  # the floor acted


def test_fedsm_covers_global_and_personalized_models_only(federation):
    fed = federation("fedsm", **update_privacy("weights", clip=1e-3))
    site = fed.site()
    sent = {**prefixed("global", fed.initial), **prefixed("person", fed.initial), "select.w": torch.zeros(3)}
    trained = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in sent.items()}
    params, kind = site.private_update(trained, fed.message(0, sent))
    assert kind == ParamsType.FULL
    both = {**float_update(params, sent, "global."), **float_update(params, sent, "person.")}
    assert update_norm(both) == pytest.approx(1e-3, rel=1e-3)  # one norm over the two models
    assert torch.equal(params["select.w"], torch.ones(3))  # the selector goes as it is


def test_a_method_reply_without_the_received_model_is_refused_when_dp_is_on(federation):
    fed = federation("fedavg", **update_privacy("weights", clip=1.0))
    with pytest.raises(RuntimeError, match="privacy.update"):
        fed.site().reply({"global.x": torch.ones(1)}, {"val_dice": 0.5}, n_samples=3)
    with pytest.raises(RuntimeError, match="not received"):
        fed.site().private_update({"global.x": torch.ones(1)}, fed.message(0, {}))
    assert math.isfinite(fed.cfg["privacy"]["update"]["dp"]["clip"])
