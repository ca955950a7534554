"""IoU and ASSD (MONAI) next to Dice: hand-computed cases."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from pflseg.train import evaluate
from pflseg.train.evaluate import adabn, assd_scores, iou_scores
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


def test_adabn_running_stats_are_the_training_images_and_weights_stay():
    torch.manual_seed(0)
    images = torch.randn(8, 1, 6, 6) * 3 + 2
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Dropout(0.5),
                        nn.Conv2d(3, 1, 1))
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 2.0)
        net[1].bias.uniform_(-1.0, 1.0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    loader = DataLoader([{"image": x} for x in images], batch_size=4)  # two equal batches

    out = adabn(net, loader, torch.device("cpu"))

    with torch.no_grad():
        feats = net[0](images)  # the BN layer's inputs, (8, 3, 6, 6)
    per_batch_var = torch.stack([f.transpose(0, 1).flatten(1).var(1) for f in feats.split(4)])
    assert torch.allclose(net[1].running_mean, feats.mean((0, 2, 3)), atol=1e-5)  # the data set's mean
    assert torch.allclose(net[1].running_var, per_batch_var.mean(0), atol=1e-5)  # cumulative, not momentum 0.1
    assert out is net and not any(m.training for m in net.modules()) and net[1].momentum == 0.1
    stats = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items() if k not in stats)
    plain = nn.Sequential(nn.Conv2d(1, 1, 1), nn.InstanceNorm2d(1))  # nothing to re-estimate
    kept = {k: v.clone() for k, v in plain.state_dict().items()}
    assert all(torch.equal(v, kept[k]) for k, v in adabn(plain, loader, torch.device("cpu")).state_dict().items())
