"""IoU and ASSD (MONAI) next to Dice: hand-computed cases."""

import math

import pytest
import torch

from pflseg.train import evaluate
from pflseg.train.evaluate import assd_scores, iou_scores
from tests.unit.train.test_loop import Scale, Squares


def test_iou_of_overlapping_squares_by_hand():
    pred = torch.zeros(1, 8, 8, dtype=torch.bool)
    label = pred.clone()
    pred[0, 0:4, 0:4] = True  # 16 pixels
    label[0, 0:4, 2:6] = True  # 16 pixels, 8 shared
    assert iou_scores(pred, label).tolist() == pytest.approx([8 / 24])
    empty = torch.zeros(2, 4, 4, dtype=torch.bool)
    assert iou_scores(empty, empty).tolist() == [1.0, 1.0]


def test_assd_of_a_shifted_square_and_empty_masks():
    pred = torch.zeros(2, 16, 16, dtype=torch.bool)
    label = pred.clone()
    pred[0, 4:8, 4:8] = True
    label[0, 4:8, 4:8] = True
    assert assd_scores(pred, label).tolist() == [0.0, 0.0]  # identical; class 1 empty in both
    label[0] = False
    label[0, 4:8, 5:9] = True  # shifted by one pixel: every border pixel lies 0 or 1 away
    got = assd_scores(pred, label)
    assert 0.0 < got[0] <= 1.0 and got[1] == 0.0
    label[1, 2, 2] = True  # class 1 only in the ground truth: undefined
    assert math.isinf(float(assd_scores(pred, label)[1]))


def test_evaluate_reports_iou_and_assd_on_request():
    out = evaluate(Scale(10.0), Squares(), torch.device("cpu"), surface=True)
    assert out["iou"] == pytest.approx(1.0) and out["assd"] == 0.0 and out["assd_undefined"] == 0
    bad = evaluate(Scale(-10.0), Squares(), torch.device("cpu"), surface=True)
    assert bad["iou"] == 0.0 and bad["assd"] > 0
    assert "assd" not in evaluate(Scale(10.0), Squares(), torch.device("cpu"))
