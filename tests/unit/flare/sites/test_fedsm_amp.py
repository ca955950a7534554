"""FedSM's selector and super model under ``train.amp``, on a CPU: the selector's scoring, its three fits (lda
statistics, epoch gradient, per-batch Adam), FedSM-extra's labels and the inference task run their forward passes
under bf16 autocast, close to float32; off never enters autocast; fp16 (float32 on a CPU) is refused for the
epoch gradient and steps the batch fit through a gradient scaler.

Tolerances, measured bf16 against float32 on the tiny synthetic sites (compact selector, dropout 0, 32 x 32): the
summed validation NLL 3e-3 relative (bound 0.02), the lda Gram matrix 5e-3 and class sums 3e-3 relative (0.03), the
selector loss 2e-5 (lda, epoch) and 2.5e-4 (batch) relative (0.01); the epoch gradient 0.55 % relative over all its
coordinates, cosine 0.999996 (bounds 0.05 and 0.999; per tensor up to 5 %: bf16 through ten layers of a freshly
initialised selector); the batch fit's update of the selector (after - before) cosine 0.983 with float32's, 0.998
under the fp16 stand-in (bound 0.95; 19 % relative: Adam moves every coordinate by about lr whatever its gradient's
size, so coordinates of a near-zero gradient move by the rounding's sign); FedSM-extra's labels and the validation
accuracies equal."""

import pytest
import torch

from pflseg.config import ConfigError
from pflseg.flare.sites import fedsm as fedsm_site
from pflseg.flare.state import prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.nets.selector import SELECTOR_DEFAULTS, build_selector, selector_cfg
from pflseg.train.loop import AMP_DTYPES
from tests.unit.train.test_amp import ConvDtypes, cpu_grad_scalers

LDA = {"selector_fit": "lda"}
EPOCH = {"selector_fit": "softmax", "selector_steps": "epoch"}
BATCH = {"selector_fit": "softmax", "selector_steps": "batch"}


@pytest.fixture(autouse=True)
def no_dropout(monkeypatch):
    """No random dropout masks: float32 and bf16 runs differ by their arithmetic only."""
    monkeypatch.setitem(SELECTOR_DEFAULTS["compact"], "dropout", 0.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fit(federation, mode: dict, amp: str):
    """Score a seeded selector on site-1's validation split and fit it on its training split (label 0), as a round
    does; the scores, what the site sends, its metrics, the convolutions' output dtypes and the selector before."""
    fed = federation("fedsm", fedsm=mode, train={"amp": amp})
    site = fed.site()
    torch.manual_seed(3)
    selector = build_selector(selector_cfg(fed.cfg, 2)).to(site.device)
    start = {k: v.clone() for k, v in selector.state_dict().items()}
    msg = fed.message(0, prefixed("select", start), selector_label=0)
    with ConvDtypes() as dtypes:
        scored = site.score_selector(selector, site.site_labels(0))
        params, metrics = site.fit_selector(selector, site.site_labels(0), msg, 0)
    return scored, params, metrics, dtypes, start


@pytest.mark.parametrize("mode", [LDA, EPOCH, BATCH], ids=["lda", "epoch", "batch"])
def test_selector_scoring_and_fit_under_bf16_close_to_float32(federation, mode):
    s32, p32, m32, d32, start = fit(federation, mode, "off")
    s16, p16, m16, d16, _ = fit(federation, mode, "bf16")
    assert d32 == {torch.float32} and d16 == {torch.bfloat16}  # off: autocast never entered
    assert s16["selector_val_acc"] == s32["selector_val_acc"]
    assert max(abs(a - b) / b for a, b in zip(s16["selector_val_nll"], s32["selector_val_nll"])) < 0.02
    assert abs(m16["selector_loss"] - m32["selector_loss"]) < 0.01 * m32["selector_loss"]
    assert p16.keys() == p32.keys() and all(v.dtype == p32[k].dtype for k, v in p16.items())  # float32 sent
    if mode is LDA:
        assert torch.equal(p16["stats.count"], p32["stats.count"])
        assert rel(p16["stats.gram"], p32["stats.gram"]) < 0.03 and rel(p16["stats.sum"], p32["stats.sum"]) < 0.03
    if mode is EPOCH:
        g16, g32 = (torch.cat([v.flatten() for v in unprefixed("grad", p).values()]) for p in (p16, p32))
        assert rel(g16, g32) < 0.05 and torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.999
    if mode is BATCH:
        assert m16["selector_val_acc_local"] == m32["selector_val_acc_local"]
        moved16, moved32 = (torch.cat([(v - start[k]).flatten() for k, v in unprefixed("select", p).items()])
                            for p in (p16, p32))
        assert torch.nn.functional.cosine_similarity(moved16, moved32, dim=0) > 0.95

def test_extra_labels_and_fit_under_bf16_as_float32(federation):
    """FedSM-extra: the candidate models' per-sample losses (under autocast, in float32) label the same samples."""
    out = {}
    for amp in ("off", "bf16"):
        fed = federation("fedsm", fedsm={**LDA, "extra_rounds": 1}, train={"amp": amp})
        torch.manual_seed(4)
        params = prefixed("select", build_selector(selector_cfg(fed.cfg, 3)).state_dict())
        for i, name in enumerate(("global", "person.site-1", "person.site-2")):
            torch.manual_seed(10 + i)
            params.update(prefixed(name, build_net(fed.cfg["net"]).state_dict()))
        with ConvDtypes() as dtypes:
            out[amp] = fed.site().train_selector(fed.message(2, params))
        assert dtypes == {AMP_DTYPES[amp] or torch.float32}
    off, bf16 = out["off"], out["bf16"]
    assert torch.equal(bf16.params["stats.count"], off.params["stats.count"])
    assert len(set(off.params["stats.count"].tolist()) - {0.0}) > 1  # more than one candidate wins somewhere
    assert bf16.metrics["selector_val_acc"] == off.metrics["selector_val_acc"]
    assert rel(bf16.params["stats.sum"], off.params["stats.sum"]) < 0.03


@pytest.mark.parametrize("mode", [LDA, BATCH], ids=["lda", "batch"])
def test_fp16_on_a_cpu_computes_the_selector_in_float32_bit_for_bit(federation, mode):
    _, p32, m32, _, _ = fit(federation, mode, "off")
    _, p16, m16, dtypes, _ = fit(federation, mode, "fp16")
    assert dtypes == {torch.float32} and m16 == m32
    assert p16.keys() == p32.keys() and all(torch.equal(v, p32[k]) for k, v in p16.items())


def test_fp16_with_the_epoch_gradient_is_refused_when_the_config_is_checked():
    """FedSMSection.check_amp, run by ``method(cfg)``: at build, at the server and at a site's first message;
    FedSM-extra alike (same section)."""
    from pflseg.config import load_job_config
    from pflseg.flare.methods import method

    over = {"fedsm": EPOCH, "train": {"amp": "fp16"}}
    with pytest.raises(ConfigError, match="train.amp=fp16.*epoch"):
        method(load_job_config("fedsm", overrides=over))
    with pytest.raises(ConfigError, match="train.amp=fp16"):
        method(load_job_config("fedsm_extra", overrides=over), "job config sent by the server")
    method(load_job_config("fedsm", overrides={**over, "train": {"amp": "bf16"}}))  # bf16: no scaler needed


def test_fp16_batch_fit_steps_through_a_gradient_scaler(federation, monkeypatch):
    """fp16 exists on CUDA only; a CPU stands in (float16 autocast, a CPU GradScaler patched in): every per-batch
    Adam step of the selector's fit goes through the scaler, and the fit is about float32's."""
    _, p32, m32, _, start = fit(federation, BATCH, "off")
    monkeypatch.setattr(fedsm_site, "amp_dtype", lambda amp, device: AMP_DTYPES[amp])
    scalers = cpu_grad_scalers(monkeypatch)
    _, p16, m16, dtypes, _ = fit(federation, BATCH, "fp16")
    assert dtypes == {torch.float16} and len(scalers) == 1
    assert scalers[0].scaled == int(p16["moment.0.step"]) > 0  # one scaled backward per Adam step
    assert abs(m16["selector_loss"] - m32["selector_loss"]) < 0.01 * m32["selector_loss"]
    moved16, moved32 = (torch.cat([(v - start[k]).flatten() for k, v in unprefixed("select", p).items()])
                        for p in (p16, p32))
    assert torch.nn.functional.cosine_similarity(moved16, moved32, dim=0) > 0.95


def test_inference_task_passes_train_amp_to_the_super_model(federation, monkeypatch):
    seen = []
    real = fedsm_site.evaluate_super_model

    def recording(*args, **kwargs):
        seen.append(kwargs["amp"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fedsm_site, "evaluate_super_model", recording)
    for amp in ("off", "bf16"):
        fed = federation("fedsm_infer", train={"amp": amp})
        selector = build_selector(selector_cfg(fed.cfg, 2)).state_dict()
        params = {**prefixed("global", fed.initial), **prefixed("person.site-1", fed.initial),
                  **prefixed("person.site-2", fed.initial), **prefixed("select", selector)}
        with ConvDtypes() as dtypes:
            out = fed.site("site-1").infer(fed.message(0, params, inside_sites=["site-1", "site-2"]))
        assert dtypes == {AMP_DTYPES[amp] or torch.float32} and out.metrics["infer"]["n_images"] > 0
    assert seen == ["off", "off", "bf16", "bf16"]  # testing, then validation
