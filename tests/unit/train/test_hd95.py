"""HD95 (MONAI, 95th percentile Hausdorff distance) beside ASSD: hand-computed cases; no other metric moves."""

import math
import sys

import torch

from pflseg.train import evaluate
from pflseg.train.evaluate import hd95_scores
from tests.unit.train.test_loop import Scale, Squares


def test_hd95_of_a_shifted_square_and_empty_masks():
    pred = torch.zeros(2, 16, 16, dtype=torch.bool)
    label = pred.clone()
    pred[0, 4:8, 4:8] = True
    label[0, 4:8, 4:8] = True
    assert hd95_scores(pred, label).tolist() == [0.0, 0.0]  # identical; class 1 empty in both
    label[0] = False
    label[0, 4:8, 7:11] = True  # shifted by three pixels: the far columns lie 3 apart, the 95th percentile too
    assert hd95_scores(pred, label).tolist() == [3.0, 0.0]
    label[1, 2, 2] = True  # class 1 only in the ground truth: undefined
    assert math.isinf(float(hd95_scores(pred, label)[1]))


def test_evaluate_reports_hd95_beside_assd_and_changes_nothing_else(monkeypatch):
    for scale in (10.0, -10.0):
        out = evaluate(Scale(scale), Squares(), torch.device("cpu"), surface=True)
        assert out["hd95_undefined"] == out["assd_undefined"] and len(out["hd95_per_class"]) == 1
        assert (out["hd95"] == 0.0) if scale > 0 else (out["hd95"] >= out["assd"] > 0)
        with monkeypatch.context() as m:
            m.setattr(sys.modules["pflseg.train.evaluate"], "hd95_scores", lambda p, l: torch.zeros(p.shape[0]))
            stubbed = evaluate(Scale(scale), Squares(), torch.device("cpu"), surface=True)
        assert {k: v for k, v in out.items() if not k.startswith("hd95")} == {
            k: v for k, v in stubbed.items() if not k.startswith("hd95")}
    assert "hd95" not in evaluate(Scale(10.0), Squares(), torch.device("cpu"))
