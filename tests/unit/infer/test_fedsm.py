"""FedSM inference (Algorithm 2) on tiny hand-made models, selectors and datasets."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from pflseg.infer.fedsm import evaluate_super_model
from pflseg.train.evaluate import evaluate

CPU = torch.device("cpu")
H = W = 4


class FixedModel(nn.Module):
    """Segmentation "model": the same logit map (C, H, W) for every image."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits.float())

    def forward(self, x):
        return self.logits.expand(x.shape[0], *self.logits.shape).clone()


class ThresholdModel(nn.Module):
    """Segmentation "model": foreground where the image is > 0 (one channel)."""

    def forward(self, x):
        return torch.where(x[:, :1] > 0, 10.0, -10.0)


class ImageSelector(nn.Module):
    """Selector: logits read from the image's first row, columns 0..n-1 (per-sample routing)."""

    def __init__(self, n_classes: int):
        super().__init__()
        self.n = n_classes

    def forward(self, x):
        return x[:, 0, 0, : self.n].clone()


class FixedSelector(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits, dtype=torch.float32))

    def forward(self, x):
        return self.logits.expand(x.shape[0], -1).clone()


def mask(*pixels, c=1):
    """(c, H, W) float mask with the given (row, col) pixels set in every channel."""
    m = torch.zeros(c, H, W)
    for r, q in pixels:
        m[:, r, q] = 1.0
    return m


def item(case, slice_idx, label, image=None, has_label=True, site="s"):
    return {"image": torch.zeros(1, H, W) if image is None else image, "label": label, "case": case,
            "slice": slice_idx, "site": site, "has_label": has_label}


def three_models():
    """Global predicts pixel (0,0); personalized k predicts pixel (k+1, k+1) - disjoint predictions."""
    glob = FixedModel(mask((0, 0)) * 20 - 10)
    pers = [FixedModel(mask((k + 1, k + 1)) * 20 - 10) for k in range(3)]
    return glob, pers


def selector_image(logits):
    img = torch.zeros(1, H, W)
    img[0, 0, : len(logits)] = torch.tensor(logits, dtype=torch.float32)
    return img


@pytest.fixture
def routed_dataset():
    """Four single-slice cases; labels = personalized 1's pixel; selector logits vary per sample."""
    label = mask((2, 2))
    logits = [[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [0.1, 0.0, 0.0]]  # last one unsure
    return [item(f"c{i}", 0, label, image=selector_image(lg)) for i, lg in enumerate(logits)]


def test_gamma_one_is_the_global_model(routed_dataset):
    glob, pers = three_models()
    out = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, gammas=(1.0,))

    expected = evaluate(glob, routed_dataset, CPU)
    assert out["super"]["1.0"]["dice"] == pytest.approx(expected["dice"])
    assert out["super"]["1.0"]["dice_per_class"] == pytest.approx(expected["dice_per_class"])
    assert out["global"]["dice"] == pytest.approx(expected["dice"])
    assert out["super"]["1.0"]["selection"] == [1.0, 0.0, 0.0, 0.0]
    assert out["personalized"] is None and out["predictions"] is None
    assert out["n_images"] == 4 and out["n_cases"] == 4


def test_gamma_zero_always_picks_the_argmax_personalized_model(routed_dataset):
    glob, pers = three_models()
    out = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, gammas=(0.0,))

    # argmax per sample: 0, 1, 2, 0 -> only sample 1 routed to personalized 1 (the labelled pixel).
    assert out["super"]["0.0"]["selection"] == pytest.approx([0.0, 0.5, 0.25, 0.25])
    assert out["super"]["0.0"]["per_case"] == {"c0": [0.0], "c1": [1.0], "c2": [0.0], "c3": [0.0]}
    assert out["super"]["0.0"]["dice"] == pytest.approx(0.25)


def test_threshold_sends_unsure_samples_to_the_global_model(routed_dataset):
    glob, pers = three_models()
    out = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, gammas=(0.5,))

    # max softmax of [0.1, 0, 0] is ~0.36 < 0.5 -> global; the confident ones keep their argmax.
    assert out["super"]["0.5"]["selection"] == pytest.approx([0.25, 0.25, 0.25, 0.25])


def test_confident_selector_gives_the_personalized_model():
    glob, pers = three_models()
    data = [item("a", 0, mask((2, 2))), item("b", 0, mask((2, 2), (0, 0))), item("c", 0, mask((1, 1)))]
    selector = FixedSelector([0.0, 50.0, 0.0])
    out = evaluate_super_model(glob, pers, selector, data, CPU, own_index=1)

    expected = evaluate(pers[1], data, CPU)
    for g in ("0.0", "0.5", "0.9", "0.99"):
        assert out["super"][g]["dice"] == pytest.approx(expected["dice"])
        assert out["super"][g]["selection"] == [0.0, 0.0, 1.0, 0.0]
    assert out["super"]["1.0"]["dice"] == pytest.approx(evaluate(glob, data, CPU)["dice"])
    assert out["personalized"]["dice"] == pytest.approx(expected["dice"])
    assert out["personalized"]["per_case"] == {"a": [1.0], "b": pytest.approx([2 / 3]), "c": [0.0]}


def test_temperature_softens_the_selector_and_the_histogram_counts_images(routed_dataset):
    glob, pers = three_models()
    # logits 5 vs 0: max prob 0.987 at T = 1 (personalized at gamma 0.9); at T = 4 it is 0.63 (global)
    sharp = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, gammas=(0.9,))
    soft = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, gammas=(0.9,), temperature=4.0)
    assert sharp["super"]["0.9"]["selected"] == [1, 1, 1, 1] and sharp["temperature"] == 1.0
    assert soft["super"]["0.9"]["selected"] == [4, 0, 0, 0] and soft["temperature"] == 4.0
    assert soft["super"]["0.9"]["selection"] == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="temperature"):
        evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, temperature=0.0)


def test_the_selector_sees_the_intensity_view_when_asked(routed_dataset):
    glob, pers = three_models()
    # z-scored images of zeros, kept mean 30: the intensity view is asinh(30) in every pixel
    data = [dict(d, image=torch.zeros(1, H, W), intensity=torch.tensor([[30.0, 1.0]])) for d in routed_dataset]
    seen = []

    class Spy(ImageSelector):
        def forward(self, x):
            seen.append(x.clone())
            return super().forward(x)

    evaluate_super_model(glob, pers, Spy(3), data, CPU, gammas=(0.0,), selector_input="intensity")
    assert torch.allclose(seen[0], torch.full_like(seen[0], float(np.arcsinh(30.0))))
    seen.clear()
    evaluate_super_model(glob, pers, Spy(3), data, CPU, gammas=(0.0,))  # default: the z-scored image
    assert torch.equal(seen[0], torch.zeros_like(seen[0]))


def test_selection_frequencies_sum_to_one(routed_dataset):
    glob, pers = three_models()
    out = evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, batch_size=3)

    assert set(out["super"]) == {"0.0", "0.5", "0.9", "0.99", "1.0"}
    for entry in out["super"].values():
        assert len(entry["selection"]) == 4
        assert sum(entry["selection"]) == pytest.approx(1.0)


def test_cases_are_reassembled_from_their_slices():
    # Prediction = image > 0. Case A (2 slices) and case B (3 slices), interleaved and out of order.
    def img(*pixels):
        return mask(*pixels)

    data = [
        item("B", 2, mask((1, 1)), image=img((1, 1))),          # B: TP 1
        item("A", 1, mask((0, 0), (0, 1)), image=img()),          # A: FN 2
        item("B", 0, mask(), image=img((3, 3))),                  # B: FP 1
        item("A", 0, mask((2, 2)), image=img((2, 2))),            # A: TP 1
        item("B", 1, mask((0, 2)), image=img((0, 2))),            # B: TP 1
    ]
    selector = FixedSelector([9.0, 0.0])
    out = evaluate_super_model(ThresholdModel(), [ThresholdModel(), ThresholdModel()], selector, data, CPU,
                               batch_size=2)

    # Volume Dice: A = 2*1 / (1 + 3) = 0.5, B = 2*2 / (3 + 2) = 0.8 (mean per case, not per image).
    assert out["n_cases"] == 2 and out["n_images"] == 5
    assert out["global"]["per_case"]["A"] == pytest.approx([0.5])
    assert out["global"]["per_case"]["B"] == pytest.approx([0.8])
    assert out["global"]["dice"] == pytest.approx(0.65)
    assert out["super"]["0.9"]["dice"] == pytest.approx(0.65)


def test_unlabelled_data_gives_no_dice_but_selection(routed_dataset, tmp_path):
    glob, pers = three_models()
    data = [dict(d, has_label=False) for d in routed_dataset]
    out = evaluate_super_model(glob, pers, ImageSelector(3), data, CPU, own_index=0, out_dir=tmp_path)

    assert out["global"]["dice"] is None and out["global"]["dice_per_class"] is None
    assert out["personalized"]["dice"] is None
    for entry in out["super"].values():
        assert entry["dice"] is None and entry["dice_per_class"] is None
        assert sum(entry["selection"]) == pytest.approx(1.0)
    assert out["super"]["0.0"]["selection"] == pytest.approx([0.0, 0.5, 0.25, 0.25])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.png", "c1.png", "c2.png", "c3.png"]


def test_only_labelled_slices_count_for_dice():
    data = [item("a", 0, mask((0, 0))), item("a", 1, mask((1, 1)), has_label=False)]
    glob = FixedModel(mask((0, 0)) * 20 - 10)
    out = evaluate_super_model(glob, [glob], FixedSelector([1.0]), data, CPU)
    assert out["global"]["per_case"] == {"a": [1.0]}


def test_predictions_are_written_per_case(tmp_path):
    # Two nested classes (disc, cup). Global: disc at (0,0), disc+cup at (1,1); personalized 0: nothing.
    logits_g = torch.full((2, H, W), -10.0)
    logits_g[0, 0, 0] = logits_g[0, 1, 1] = logits_g[1, 1, 1] = 10.0
    glob, pers0 = FixedModel(logits_g), FixedModel(torch.full((2, H, W), -10.0))
    vol_image = selector_image([0.0, 0.0])  # unsure -> global at save_gamma 0.9
    data = [  # dataset order != slice order: the volume must be stacked by slice index
        item("vol/1", 2, mask(c=2), image=selector_image([0.0, 9.0])),  # confident -> personalized 1
        item("vol/1", 0, mask(c=2), image=vol_image),
        item("img 2", 0, mask(c=2), image=vol_image),
        item("vol/1", 1, mask(c=2), image=vol_image),
    ]
    out_dir = tmp_path / "pred"
    out = evaluate_super_model(glob, [pers0, pers0], ImageSelector(2), data, CPU, out_dir=out_dir)

    assert out["predictions"] == str(out_dir)
    assert sorted(p.name for p in out_dir.iterdir()) == ["img_2.png", "vol_1.nii.gz"]
    nii = nib.load(str(out_dir / "vol_1.nii.gz"))
    volume = np.asarray(nii.dataobj)
    assert volume.shape == (H, W, 3) and volume.dtype == np.uint8
    assert np.array_equal(nii.affine, np.eye(4))
    expected = np.zeros((H, W), np.uint8)
    expected[0, 0], expected[1, 1] = 1, 2  # channel sum: disc only = 1, disc + cup = 2
    assert np.array_equal(volume[..., 0], expected) and np.array_equal(volume[..., 1], expected)
    assert not volume[..., 2].any()  # slice 2 was routed to an empty personalized model
    png = np.asarray(Image.open(out_dir / "img_2.png"))
    assert png.shape == (H, W) and png.dtype == np.uint8 and np.array_equal(png, expected)


def test_save_gamma_need_not_be_reported(tmp_path):
    glob, pers = three_models()
    data = [item("x", 0, mask((2, 2)), image=selector_image([0.0, 0.0, 9.0]))]
    out = evaluate_super_model(glob, pers, ImageSelector(3), data, CPU, gammas=(1.0,), save_gamma=0.5,
                               out_dir=tmp_path)
    assert list(out["super"]) == ["1.0"]
    png = np.asarray(Image.open(tmp_path / "x.png"))
    assert png[3, 3] == 1 and png.sum() == 1  # personalized 2's pixel, not the global model's


def test_extra_route_uses_the_k_plus_one_class_rule():
    glob, pers = three_models()
    label = mask((0, 0))  # the global model's pixel
    logits = [[0.1, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.0], [0.0, 0.0, 0.0, 0.2], [0.0, 0.1, 0.0, 0.0]]
    data = [item(f"c{i}", 0, label, image=selector_image(lg)) for i, lg in enumerate(logits)]
    out = evaluate_super_model(glob, pers, ImageSelector(4), data, CPU, extra=True, gammas=(0.99,))

    # class 0 -> global even though it is barely ahead (no gamma); class k + 1 -> personalized k.
    assert list(out["super"]) == ["extra"]
    assert out["super"]["extra"]["selection"] == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert out["super"]["extra"]["per_case"] == {"c0": [1.0], "c1": [0.0], "c2": [0.0], "c3": [0.0]}


@pytest.mark.parametrize("extra", [False, True])
def test_soft_mixing_of_a_confident_selector_is_the_hard_rule(routed_dataset, extra):
    glob, pers = three_models()
    for i, sample in enumerate(routed_dataset):  # one-hot posteriors (softmax of +-60): 0, 1, 2 and (extra) the global
        sample["image"] = selector_image([60.0 if c == i % (4 if extra else 3) else -60.0 for c in range(4)])
    kw = dict(gammas=(0.0, 0.5, 0.9, 1.0), extra=extra)
    hard = evaluate_super_model(glob, pers, ImageSelector(4 if extra else 3), routed_dataset, CPU, **kw)
    soft = evaluate_super_model(glob, pers, ImageSelector(4 if extra else 3), routed_dataset, CPU, **kw, mixing="soft")
    assert hard["mixing"] == "hard" and soft["mixing"] == "soft"
    assert list(soft["super"]) == list(hard["super"])
    for r, entry in hard["super"].items():
        assert soft["super"][r]["per_case"] == entry["per_case"]
        assert soft["super"][r]["selected"] == entry["selected"]
        assert soft["super"][r]["selection"] == pytest.approx(entry["selection"])


def test_soft_mixing_weighs_the_models_probabilities_by_the_posterior(tmp_path):
    # posterior 0.4 / 0.3 / 0.3: site 0's model predicts pixel (1, 1), sites 1 and 2 both (2, 2), the global (0, 0)
    glob = FixedModel(mask((0, 0)) * 20 - 10)
    pers = [FixedModel(mask((1, 1)) * 20 - 10), FixedModel(mask((2, 2)) * 20 - 10), FixedModel(mask((2, 2)) * 20 - 10)]
    selector = FixedSelector(torch.tensor([0.4, 0.3, 0.3]).log().tolist())
    data = [item("a", 0, mask((2, 2))), item("b", 0, mask((0, 0)))]
    kw = dict(gammas=(0.0, 0.35), out_dir=tmp_path, save_gamma=0.0)
    hard = evaluate_super_model(glob, pers, selector, data, CPU, **kw)
    soft = evaluate_super_model(glob, pers, selector, data, CPU, **kw, mixing="soft")
    # gamma 0: hard takes site 0's model; soft sees 0.3 + 0.3 = 0.6 > 0.5 on (2, 2) and 0.4 on (1, 1)
    assert hard["super"]["0.0"]["per_case"] == {"a": [0.0], "b": [0.0]}
    assert soft["super"]["0.0"]["per_case"] == {"a": [1.0], "b": [0.0]}
    assert soft["super"]["0.0"]["selection"] == pytest.approx([0.0, 0.4, 0.3, 0.3])  # mean weights
    assert soft["super"]["0.0"]["selected"] == [0, 2, 0, 0]  # largest weight per image
    # gamma 0.35: sites 1 and 2 (0.3 each) give their shares to the global model: 0.6 on (0, 0)
    assert hard["super"]["0.35"]["per_case"] == {"a": [0.0], "b": [0.0]}
    assert soft["super"]["0.35"]["per_case"] == {"a": [0.0], "b": [1.0]}
    assert soft["super"]["0.35"]["selection"] == pytest.approx([0.6, 0.4, 0.0, 0.0])
    assert soft["global"] == hard["global"]
    written = np.asarray(Image.open(tmp_path / "a.png"))  # the written prediction is the soft mix at save_gamma
    assert written[2, 2] == 1 and written.sum() == 1


def test_unknown_mixing_is_named(routed_dataset):
    glob, pers = three_models()
    with pytest.raises(ValueError, match="mixing"):
        evaluate_super_model(glob, pers, ImageSelector(3), routed_dataset, CPU, mixing="logits")


class EmbeddingSelector(ImageSelector):
    """ImageSelector whose features (``embed``) are the image's row 3, columns 0..1."""

    def embed(self, x):
        return x[:, 0, 3, :2].clone()


def test_unfamiliar_images_fall_back_to_the_global_model_at_every_gamma(routed_dataset, tmp_path):
    glob, pers = three_models()
    for i, far in enumerate([0.0, 3.0, 0.5, 0.0]):  # sample 1 (confidently personalized 1) is far from every class
        routed_dataset[i]["image"][0, 3, 0] = far
    familiarity = {"mean": torch.tensor([[0.0, 0.0], [0.0, 10.0]], dtype=torch.float64),
                   "precision": torch.eye(2, dtype=torch.float64)}
    kw = dict(gammas=(0.0, 0.5), familiarity=familiarity)
    plain = evaluate_super_model(glob, pers, EmbeddingSelector(3), routed_dataset, CPU, **kw)
    assert plain["d2_min"] == pytest.approx([0.0, 9.0, 0.25, 0.0]) and "super_nofallback" not in plain
    out = evaluate_super_model(glob, pers, EmbeddingSelector(3), routed_dataset, CPU, **kw, familiar_tau=1.0,
                               out_dir=tmp_path, save_gamma=0.0)
    assert out["fallback"] == {"tau": 1.0, "n_fallback": 1, "n_images": 4}
    for g in ("0.0", "0.5"):  # without the fallback: as before; with it: sample 1 moves to the global model
        assert out["super_nofallback"][g]["selected"] == plain["super"][g]["selected"]
        assert out["super_nofallback"][g]["dice"] == plain["super"][g]["dice"]
        assert out["super"][g]["selected"][0] == plain["super"][g]["selected"][0] + 1
        assert out["super"][g]["selected"][2] == plain["super"][g]["selected"][2] - 1
    assert out["super"]["0.0"]["per_case"]["c1"] == [0.0] and plain["super"]["0.0"]["per_case"]["c1"] == [1.0]
    written = np.asarray(Image.open(tmp_path / "c1.png"))
    assert written[0, 0] == 1 and written[2, 2] == 0  # the written prediction is the fallback's (global's pixel)
    with pytest.raises(ValueError, match="familiar_tau"):
        evaluate_super_model(glob, pers, EmbeddingSelector(3), routed_dataset, CPU, familiar_tau=1.0)


def test_unfamiliar_images_fall_back_to_the_global_model_alone_under_soft_mixing(routed_dataset):
    glob, pers = three_models()
    routed_dataset[1]["image"][0, 3, 0] = 3.0  # sample 1 (confidently site 1) is far from every class
    familiarity = {"mean": torch.zeros(1, 2, dtype=torch.float64), "precision": torch.eye(2, dtype=torch.float64)}
    kw = dict(gammas=(0.0,), familiarity=familiarity, mixing="soft")
    out = evaluate_super_model(glob, pers, EmbeddingSelector(3), routed_dataset, CPU, **kw, familiar_tau=1.0)
    raw = out["super_nofallback"]["0.0"]
    assert out["super"]["0.0"]["per_case"]["c1"] == [0.0] and raw["per_case"]["c1"] == [1.0]
    # sample 1's weights move from the posterior (softmax of [0, 5, 0]) to [1, 0, 0, 0]
    moved = torch.softmax(torch.tensor([0.0, 5.0, 0.0]), 0).tolist()
    assert out["super"]["0.0"]["selection"][0] - raw["selection"][0] == pytest.approx(1 / 4)
    assert raw["selection"][2] - out["super"]["0.0"]["selection"][2] == pytest.approx(moved[1] / 4)


@pytest.mark.parametrize(
    "kwargs, selector_classes, match",
    [
        ({"gammas": (1.5,)}, 3, "gammas"),
        ({"own_index": 3}, 3, "own_index"),
        ({}, 4, "selector"),  # K + 1 classes without extra
        ({"extra": True}, 3, "selector"),  # K classes with extra
        ({"out_dir": "x", "save_gamma": -0.1}, 3, "save_gamma"),
    ],
)
def test_bad_arguments_are_named(routed_dataset, kwargs, selector_classes, match):
    glob, pers = three_models()
    with pytest.raises(ValueError, match=match):
        evaluate_super_model(glob, pers, FixedSelector([0.0] * selector_classes), routed_dataset, CPU, **kwargs)


def test_empty_inputs_are_refused(routed_dataset):
    glob, pers = three_models()
    with pytest.raises(ValueError, match="personalized"):
        evaluate_super_model(glob, [], FixedSelector([0.0]), routed_dataset, CPU)
    with pytest.raises(ValueError, match="dataset"):
        evaluate_super_model(glob, pers, FixedSelector([0.0] * 3), [], CPU)
