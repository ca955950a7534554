"""The privacy path of a model update at the site's one exit (``pflseg.flare.outbox.leave`` ->
``pflseg.flare.privacy.private_update``): defaults send the trained weights unchanged; ``send: diff`` sends trained -
received as FLARE's DIFF; ``dp`` clips and noises the aggregated model weights, with noise from fresh randomness
and one release per (job, task, round)."""

import math
import re

import pytest
import torch
from nvflare.app_common.abstract.fl_model import ParamsType

from pflseg.algorithms.dp import update_norm
from pflseg.flare.controllers.base import add_diff
from pflseg.flare.outbox import leave
from pflseg.flare.privacy import private_update
from pflseg.flare.state import prefixed, unprefixed
from tests.unit.flare.sites.conftest import Federation


def update_privacy(send="weights", clip=None, sigma=0.0):
    return {"privacy": {"update": {"send": send, "dp": {"clip": clip, "noise_multiplier": sigma}}}}


def float_update(params: dict, sent: dict, prefix="global.") -> dict:
    return {k: params[k] - sent[k] for k in params if k.startswith(prefix) and params[k].is_floating_point()}


def sent(site, out, task="train"):
    """What leaves ``site`` for its task's ``out`` (the Outgoing): through the one exit."""
    return leave(site.name, task, out, site=site)


def release(site, msg):
    """A training round at ``site`` and what leaves it."""
    return sent(site, site.train(msg))


def test_defaults_send_the_trained_model_itself(federation):
    fed = federation("fedavg")
    site = fed.site()
    out = release(site, fed.message(0))
    assert out.params_type == ParamsType.FULL and out.meta["NUM_STEPS_CURRENT_ROUND"] == out.metrics["n_samples"] > 0
    trained = unprefixed("model", fed.store().load(0))
    assert all(torch.equal(out.params[f"global.{k}"], v) for k, v in trained.items())  # bit for bit
    params = {"global.x": torch.ones(2)}
    assert private_update(params, None, site.cfg["privacy"]["update"], site="site-1", prefixes=("global.",),
                          variances=[]) == (params, ParamsType.FULL)  # nothing taken, nothing needed
    assert not (site.store.root.parent / "dp_releases").exists()  # no noise: no release to remember
    assert release(site, fed.message(0)).params_type == ParamsType.FULL  # a round answered again, as before


def test_diff_sends_trained_minus_received_and_the_server_gets_the_model_back(federation):
    fed = federation("fedavg", **update_privacy("diff"))
    msg = fed.message(0)
    out = release(fed.site(), msg)
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
    out = release(fed.site(), msg)
    full = out.params if send == "weights" else {k: msg.params[k] + v for k, v in out.params.items()}
    assert update_norm(float_update(full, msg.params)) == pytest.approx(1e-3, rel=1e-3)  # it trained further than C
    trained = prefixed("global", unprefixed("model", fed.store().load(0)))
    assert all(torch.equal(full[k], trained[k]) for k, v in trained.items() if not v.is_floating_point())


def noise_of(out) -> torch.Tensor:
    """The released float coordinates of a diff reply (running variances, floored, left out)."""
    return torch.cat([v.flatten().double() for k, v in sorted(out.params.items())
                      if v.is_floating_point() and not k.endswith("running_var")])


def test_noise_is_sigma_c_from_fresh_randomness_and_a_round_leaves_once(federation, tiny_root, tmp_path, monkeypatch):
    """Issue 39 F4: the noise was seeded by an HMAC of (job name, seed, round), all chosen by the server, and a site
    answered one round twice: subtracting two releases recovered the clipped update. Now: fresh randomness, one
    release per (job, task, round), and two jobs of the same name and seed draw independent noise."""
    clip, sigma = 1e-4, 10.0  # the noise (std 1e-3) dwarfs the clipped update (norm 1e-4 over every coordinate)
    over = update_privacy("diff", clip=clip, sigma=sigma)
    fed = federation("fedavg", **over)
    site = fed.site()
    first = release(site, fed.message(0))
    noise = noise_of(first)
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.05) and abs(float(noise.mean())) < 1e-4
    # the same round asked again, of this site object or of a new one (another worker): refused, naming job and round
    for again in (site, fed.site()):
        out = release(again, fed.message(0))
        error = out.meta["pflseg_error"]
        assert not out.params and "refusing a second release of round 0 of job fedavg" in error, error
        assert "task 'train'" in error and "(detail in the site's <state>/site_errors.log)" in error
    marks = tmp_path / "state" / "site-1" / "dp_releases"
    assert [p.name for p in marks.iterdir()] == ["no-job-id.fedavg.train.round0"]
    assert oct(marks.stat().st_mode & 0o777) == "0o700"
    assert "pflseg_error" not in release(site, fed.message(1)).meta  # the next round leaves
    # another job of the same name and seed (here: another state root): the same training, independent noise
    other = Federation("fedavg", tiny_root, tmp_path / "other", monkeypatch, **over).site()
    second = noise_of(release(other, fed.message(0)))
    assert float(torch.corrcoef(torch.stack([noise, second]))[0, 1]) == pytest.approx(0.0, abs=0.05)
    assert float((noise - second).std()) == pytest.approx(math.sqrt(2) * sigma * clip, rel=0.05)  # nothing cancels


def test_a_release_is_remembered_per_job_id(federation):
    fed = federation("fedavg", **update_privacy("diff", clip=1e-4, sigma=1.0))
    site = fed.site()
    for job_id in ("job-a", "job-b"):
        site.job_id = job_id  # (a FLARE job id, as the executor gives it)
        assert "pflseg_error" not in release(site, fed.message(0)).meta
    site.job_id = "job-a"
    assert re.search(r"round 0 of job fedavg \(job id job-a", release(site, fed.message(0)).meta["pflseg_error"])


def test_noise_never_makes_a_running_variance_negative(federation):
    fed = federation("fedavg", **update_privacy("weights", clip=1.0, sigma=100.0))
    out = release(fed.site(), fed.message(0))
    variances = [k for k in out.params if k.endswith("running_var")]
    assert variances and all(bool((out.params[k] >= 0).all()) for k in variances)
    assert any(float(out.params[k].min()) == 0.0 for k in variances)  # the floor acted


def test_fedsm_covers_global_and_personalized_models_only(federation):
    fed = federation("fedsm", **update_privacy("weights", clip=1e-3))
    site = fed.site()
    sent = {**prefixed("global", fed.initial), **prefixed("person", fed.initial), "select.w": torch.zeros(3)}
    trained = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in sent.items()}
    params, kind = private_update(trained, fed.message(0, sent), site.cfg["privacy"]["update"], site=site.name,
                                  prefixes=site.dp_prefixes, variances=site.running_variances())
    assert kind == ParamsType.FULL
    both = {**float_update(params, sent, "global."), **float_update(params, sent, "person.")}
    assert update_norm(both) == pytest.approx(1e-3, rel=1e-3)  # one norm over the two models
    assert torch.equal(params["select.w"], torch.ones(3))  # the selector goes as it is


def test_a_method_reply_without_the_received_model_is_refused_when_dp_is_on(federation):
    fed = federation("fedavg", **update_privacy("weights", clip=1.0))
    site = fed.site()
    out = sent(site, site.reply({"global.x": torch.ones(1)}, {"val_dice": 0.5}, n_samples=3))
    assert "privacy.update" in out.meta["pflseg_error"] and not out.params  # refused at the exit: nothing leaves
    with pytest.raises(RuntimeError, match="not received"):
        private_update({"global.x": torch.ones(1)}, fed.message(0, {}), site.cfg["privacy"]["update"], site="site-1",
                       prefixes=site.dp_prefixes, variances=[])
    assert math.isfinite(fed.cfg["privacy"]["update"]["dp"]["clip"])
