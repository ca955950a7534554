"""Overlays drawn at the site: which cases, which slice, what the picture holds."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

from pflseg.train.overlays import COLOURS, pick_cases, render, write_overlays
from tests.unit.train.test_loop import Scale, Squares


@pytest.mark.parametrize("per_case, expected", [
    ({"a": [0.9]}, [("best-1", "a")]),
    ({"a": [0.9], "b": [0.1]}, [("worst-1", "b"), ("best-1", "a")]),
    ({"a": [0.9], "b": [0.1], "c": [0.5]}, [("worst-1", "b"), ("best-2", "c"), ("best-1", "a")]),
    ({"a": [0.9], "b": [0.1, 0.3], "c": [0.5], "d": [0.3], "e": [0.15]},  # b's mean 0.2
     [("worst-1", "e"), ("worst-2", "b"), ("best-2", "c"), ("best-1", "a")]),
    ({"x": [0.5], "y": [0.5]}, [("worst-1", "y"), ("best-1", "x")]),  # ties: by name
])
def test_pick_cases_best_and_worst(per_case, expected):
    assert [(t, c) for t, c, _ in pick_cases(per_case, n=2)] == expected


def test_render_puts_image_truth_and_prediction_side_by_side():
    image = torch.zeros(1, 8, 8)
    label = torch.zeros(1, 8, 8, dtype=torch.bool)
    label[0, :4] = True
    pred = torch.zeros_like(label)
    canvas = np.asarray(render(image, label, pred, "t"))
    k = 20  # 8 px enlarged to at least 160
    assert canvas.shape == (8 * k + 32, 3 * 8 * k + 8, 3)
    truth_pixel, pred_pixel = canvas[16 + 5, 8 * k + 4 + 5], canvas[16 + 5, 2 * (8 * k + 4) + 5]
    assert tuple(truth_pixel) == tuple(int(0.45 * c) for c in COLOURS[0]) and tuple(pred_pixel) == (0, 0, 0)


def test_write_overlays_for_the_worst_and_best_case(tmp_path):
    out = tmp_path / "overlays"
    out.mkdir()
    (out / "old.png").write_bytes(b"")
    paths = write_overlays(Scale(10.0), Squares(), torch.device("cpu"), out,
                           {"case0": [0.25], "case1": [0.75]}, site="site-1")
    assert [p.name for p in paths] == ["worst-1_case0.png", "best-1_case1.png"]
    assert sorted(p.name for p in out.iterdir()) == ["best-1_case1.png", "worst-1_case0.png"]
    with Image.open(paths[0]) as im:
        assert im.mode == "RGB" and im.size == (3 * 160 + 8, 160 + 32)


def test_overlays_and_predictions_are_private_whatever_the_umask(tmp_path):
    """Before: patient image panels and predicted masks were written 0644 in 0755 folders."""
    from pflseg.train.predictions import write_predictions

    previous = os.umask(0o022)
    try:
        paths = write_overlays(Scale(10.0), Squares(), torch.device("cpu"), tmp_path / "overlays",
                               {"case0": [0.25], "case1": [0.75]}, site="site-1")
        pred = torch.zeros(1, 4, 4, dtype=torch.bool)
        by_case = {("s", "a"): [{"preds": {"m": pred}, "choice": {"r": "m"}}],
                   ("s", "b"): [{"preds": {"m": pred}, "choice": {"r": "m"}}] * 2}
        write_predictions(by_case, {("s", "a"): "a", ("s", "b"): "b"}, "r", tmp_path / "predictions", "exclusive")
    finally:
        os.umask(previous)
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "overlays") == mode(tmp_path / "predictions") == 0o700
    written = [*paths, *(tmp_path / "predictions").iterdir()]
    assert sorted(p.name for p in written) == ["a.png", "b.nii.gz", "best-1_case1.png", "worst-1_case0.png"]
    assert {mode(p) for p in written} == {0o600}


def test_the_title_names_the_site_and_the_case_apart():
    """Before: "HospitalA case002" drawn in PIL's small font read as "HospitalAcase002"."""
    from pflseg.train.overlays import overlay_title

    assert overlay_title("HospitalA", "case002", None, 0.8123, "best-1") == \
        "site HospitalA | case case002 | Dice 0.812 (best-1)"
    assert overlay_title("", "c", 4, 0.5, "worst-1") == "case c | slice 4 | Dice 0.500 (worst-1)"
