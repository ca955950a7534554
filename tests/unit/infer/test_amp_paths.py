"""``train.amp`` beyond the loop and ``evaluate``, on a CPU: FedSM's super model, IOP-FL's routing and Tent, and the
overlays run their forward passes under bf16 autocast, with float32 logits and losses, close to float32; off (the
default) they never enter autocast. Old-vs-new with amp off was checked bit for bit once (every output and written
file equal); here off is checked by dtype (no bf16 convolution, float32 everywhere).

Tolerances: measured on these tiny nets (UNets trained 2-3 epochs on 32 x 32 discs, 16 images), bf16 against float32:
the logits' largest difference 0.7-0.9 % of their largest value (2 %), the unsupervised loss 2e-4 relative (bound
5e-3), the predicted foreground 7e-4 (0.01); Tent's kept and the plain predictions 99.9 % equal pixels (98 %);
routing's Dice 9e-5, every method within 3.5e-4 (0.01), its mean coefficients 9e-5 (0.01); the super model's Dice
within 7e-4 (0.01) with the same selection counts (exact: the test's selector has wide margins), d2_min 2.7 % relative
(0.1: bf16 features with cancellation, by construction); the overlays' pixels 0.05 % different (2 %). The bounds catch
a path computed wrongly (no autocast, a map that changes), not rounding."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from pflseg.algorithms import routing as algorithms_routing
from pflseg.infer import routing as infer_routing
from pflseg.infer.fedsm import evaluate_super_model
from pflseg.infer.routing import final_loss, predict, route_site, tent
from pflseg.train.evaluate import amp_forward, amp_model
from pflseg.train.loop import AMP_DTYPES
from pflseg.train.overlays import write_overlays
from tests.unit.train.test_amp import ConvDtypes, Discs, cpu_grad_scalers, train

CPU = torch.device("cpu")
CFG = {"router": "normalised", "loss_weights": "paper", "beta": 0.01, "noise_std": 0.5, "rot_flip": False,
       "shape_radius": 1, "epochs": 1, "steps": 0, "lr": 1e-2, "lr_grid": [], "lr_trial_steps": 0, "batch_size": 4,
       "norm_affine": False, "rest": None}


@pytest.fixture(scope="module")
def nets():
    """Two small UNets (batch norm) trained in float32 on the discs: confident maps, so bf16 flips few pixels. ``train``
    seeds itself (seed 0: the same start, b one epoch short of a); the weights still depend on the torch thread count
    (float sums in another order), one thread in every test (conftest)."""
    _, a, _ = train("off", epochs=3)
    _, b, _ = train("off", epochs=2)
    return a.eval(), b.eval()


@pytest.fixture
def data():
    ds = Discs(16, 1)
    for item in ds.items:
        item.update(site="site-9", has_label=True)
    return ds


def test_amp_forward_casts_up_outside_autocast_and_is_the_plain_call_when_off(nets):
    net = nets[0]
    x = Discs(4, 3).items[0]["image"][None]
    with torch.no_grad():
        plain = amp_forward(net, x, None)
        mixed = amp_forward(net, x, torch.bfloat16)
        assert torch.equal(plain, net(x)) and plain.dtype == torch.float32
        assert mixed.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        # bf16 really ran (not bit-equal), and close: bf16 keeps 8 significant bits, so the bound is relative to the
        # logits' size (largest 15 here); measured 0.68 % of it with one torch thread, 0.92 % with two. The absolute
        # 0.1 this replaces was 0.67 % of 15: it failed on rounding (0.1019 measured), not on a wrong path.
        assert 0 < (mixed - plain).abs().max() < 0.02 * plain.abs().max()
    assert amp_model(net, None) is net  # off: the model itself, nothing wrapped


def test_unsupervised_loss_and_tent_under_bf16_close_to_float32_and_off_stays_float32(nets, data, monkeypatch):
    """The adaptation's loss gets float32 logits outside autocast (the model handed to ``unsupervised_loss`` casts
    them up); off hands it the model itself."""
    seen = []
    real = algorithms_routing.unsupervised_loss

    def recording(model, images, *args):
        out = model(images)
        seen.append((out.dtype, torch.is_autocast_enabled("cpu"), isinstance(model, torch.nn.Module)))
        return real(model, images, *args)

    monkeypatch.setattr(infer_routing, "unsupervised_loss", recording)
    weights = algorithms_routing.loss_weights("paper", 0.01)
    results = {}
    for amp in ("off", "bf16"):
        seen.clear()
        with ConvDtypes() as dtypes:
            loss = final_loss(nets[0], data, "cpu", weights, CFG, 0, amp=amp)
            adapted = tent(copy.deepcopy(nets[0]), data, "cpu", CFG, 0, steps=4, amp=amp)
            preds = predict(nets[0], data, "cpu", 4, 0, amp=amp)
        assert dtypes == {AMP_DTYPES[amp] or torch.float32}
        assert set(seen) == {(torch.float32, False, amp == "off")}
        results[amp] = loss, adapted, preds
    (loss32, tent32, pred32), (loss16, tent16, pred16) = results["off"], results["bf16"]
    assert abs(loss16[0] - loss32[0]) < 5e-3 * loss32[0] and abs(loss16[1] - loss32[1]) < 0.01  # loss, foreground
    assert tent16["steps"] == tent32["steps"] == 4
    for kept, ref in ((tent16["best"].pred, tent32["best"].pred), (pred16, pred32)):
        assert kept.keys() == ref.keys()
        equal = sum(int((kept[k] == ref[k]).sum()) for k in ref) / sum(v.numel() for v in ref.values())
        assert equal > 0.98


def test_route_site_under_bf16_scores_every_method_close_to_float32(nets, data):
    scored = {}
    for amp in ("off", "bf16"):
        with ConvDtypes() as dtypes:
            scored[amp] = route_site([nets[0], nets[1]], nets[1], data, CPU, CFG, comparators=["global_bn", "tent"],
                                     amp=amp)
        assert dtypes == {AMP_DTYPES[amp] or torch.float32}
    off, bf16 = scored["off"], scored["bf16"]
    assert off["methods"].keys() == bf16["methods"].keys() == {"global_bn", "tent", "routing", "routing_final"}
    for name, entry in off["methods"].items():
        assert entry["dice"] > 0.2 and abs(bf16["methods"][name]["dice"] - entry["dice"]) < 0.01, name
    coef16, coef32 = bf16["coefficients"]["routing"]["mean"], off["coefficients"]["routing"]["mean"]
    assert max(abs(a - b) for a, b in zip(coef16, coef32)) < 0.01


def test_route_site_fp16_steps_through_a_gradient_scaler(nets, data, monkeypatch):
    """fp16 exists on CUDA only; here a CPU stands in for it (autocast in float16 and a CPU GradScaler patched in),
    to run the scaled step: every adaptation's backward pass goes through the scaler, and the result is float32's."""
    monkeypatch.setattr(infer_routing, "amp_dtype", lambda amp, device: AMP_DTYPES[amp])
    scalers = cpu_grad_scalers(monkeypatch)
    with ConvDtypes() as dtypes:
        half = route_site([nets[0], nets[1]], nets[1], data, CPU, CFG, comparators=["tent"], amp="fp16")
    assert dtypes == {torch.float16} and len(scalers) == 2  # routing's run and Tent's
    steps = [half["diagnostics"]["adaptation"]["routing"]["steps"], 4]  # 16 images in batches of 4, one pass each
    assert [s.scaled for s in scalers] == steps
    off = route_site([nets[0], nets[1]], nets[1], data, CPU, CFG, comparators=["tent"])
    for name, entry in off["methods"].items():
        assert abs(half["methods"][name]["dice"] - entry["dice"]) < 0.01, name


class MeanSelector(torch.nn.Module):
    """A selector by mean intensity through a 1 x 1 convolution (bf16 under autocast): class 0 above ``threshold``,
    class 1 below, logits +-``scale`` x the distance (class 2, if any, 0). The threshold lies mid-way in the widest
    gap between the images' means, so that bf16's rounding moves no image across it."""

    def __init__(self, classes: int, threshold: float, scale: float = 200.0):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, classes, 1)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.weight[:2, 0, 0, 0] = torch.tensor([scale, -scale])
            self.conv.bias.zero_()
            self.conv.bias[:2] = torch.tensor([-scale * threshold, scale * threshold])

    def forward(self, x):
        return self.conv(x).mean((2, 3))

    def embed(self, x):
        return self.forward(x)


def widest_gap(data) -> float:
    means = sorted(float(item["image"].mean()) for item in data.items)
    _, i = max((b - a, i) for i, (a, b) in enumerate(zip(means, means[1:])))
    return (means[i] + means[i + 1]) / 2


@pytest.mark.parametrize("extra", [False, True])
def test_super_model_under_bf16_close_to_float32(nets, data, extra, tmp_path):
    classes = 3 if extra else 2
    torch.manual_seed(2)
    f64 = dict(dtype=torch.float64)
    familiar = {"mean": torch.randn(2, classes, **f64), "precision": torch.eye(classes, **f64)}
    kw = dict(gammas=(0.0, 0.5, 0.9), own_index=0, extra=extra, batch_size=8, familiarity=familiar)
    out = {}
    for amp in ("off", "bf16"):
        with ConvDtypes() as dtypes:
            out[amp] = evaluate_super_model(nets[0], [nets[0], nets[1]], MeanSelector(classes, widest_gap(data)), data,
                                            CPU, amp=amp, out_dir=tmp_path / amp, **kw)
        assert dtypes == {AMP_DTYPES[amp] or torch.float32}
    off, bf16 = out["off"], out["bf16"]
    for key in ("global", "personalized"):
        assert off[key]["dice"] > 0.3 and abs(bf16[key]["dice"] - off[key]["dice"]) < 0.01
    assert off["super"].keys() == bf16["super"].keys()
    for route, entry in off["super"].items():
        assert abs(bf16["super"][route]["dice"] - entry["dice"]) < 0.01
        assert bf16["super"][route]["selected"] == entry["selected"]
    assert max(abs(a - b) / b for a, b in zip(bf16["d2_min"], off["d2_min"])) < 0.1  # the features' bf16 rounding
    assert sorted(p.name for p in (tmp_path / "bf16").iterdir()) == sorted(p.name for p in (tmp_path / "off").iterdir())


def test_overlays_under_bf16_draw_about_the_float32_prediction(nets, data, tmp_path):
    per_case = {f"case{i}": [0.2 * i] for i in range(4)}
    pictures = {}
    for amp in ("off", "bf16"):
        with ConvDtypes() as dtypes:
            paths = write_overlays(nets[0], data, CPU, tmp_path / amp, per_case, site="s", amp=amp)
        assert dtypes == {AMP_DTYPES[amp] or torch.float32}
        pictures[amp] = [np.asarray(Image.open(p)) for p in paths]
    assert [a.shape for a in pictures["off"]] == [b.shape for b in pictures["bf16"]]
    for a, b in zip(pictures["off"], pictures["bf16"]):
        assert (a != b).any(-1).mean() < 0.02  # pixels of the three panels (and the title) that differ
