"""Evaluation: foreground Dice per class, per 2D image and per case (slices reassembled into volumes).

Predictions are ``sigmoid(logits) > 0.5`` per class channel. Per-case Dice stacks a case's slices in
slice order into a (C, H, W, D) volume and scores it with MONAI's DiceMetric; a class absent from both
prediction and ground truth of a case counts as 1 (perfect), absent from ground truth only as 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from monai.metrics import DiceMetric
from torch import nn
from torch.utils.data import Dataset

from pflseg.train.loop import make_loader


@torch.no_grad()
def predict(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 32):
    """Yield ``(sample_meta, pred (C,H,W) bool, label (C,H,W) bool)`` for every sample, in dataset order."""
    model.to(device).eval()
    for batch in make_loader(dataset, batch_size, shuffle=False):
        logits = model(batch["image"].to(device))
        preds = (torch.sigmoid(logits) > 0.5).cpu()
        for i in range(preds.shape[0]):
            yield (batch["case"][i], int(batch["slice"][i])), preds[i], batch["label"][i] > 0.5


def dice_scores(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-class Dice of one sample: pred/label (C, ...) bool -> (C,) float, empty-vs-empty = 1."""
    metric = DiceMetric(include_background=True, reduction="none", ignore_empty=False)
    return metric(pred[None].float(), label[None].float())[0]


def evaluate(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 32) -> dict:
    """Score ``model`` on ``dataset``.

    Returns:
        ``dice`` (mean over cases and classes), ``dice_per_class`` (per class, over cases),
        ``dice_image`` (mean over 2D images and classes), ``n_cases``, ``n_images``, ``per_case``.
    """
    if len(dataset) == 0:
        raise ValueError("evaluate: empty dataset")
    by_case: dict[str, list] = defaultdict(list)
    image_scores = []
    for (case, slice_idx), pred, label in predict(model, dataset, device, batch_size):
        by_case[case].append((slice_idx, pred, label))
        image_scores.append(dice_scores(pred, label))
    per_case = {}
    for case, items in by_case.items():
        items.sort(key=lambda t: t[0])
        pred = torch.stack([p for _, p, _ in items], dim=-1)
        label = torch.stack([l for _, _, l in items], dim=-1)
        per_case[case] = dice_scores(pred, label)
    case_tensor = torch.stack(list(per_case.values()))
    return {
        "dice": float(case_tensor.mean()),
        "dice_per_class": [float(x) for x in case_tensor.mean(0)],
        "dice_image": float(torch.stack(image_scores).mean()),
        "n_cases": len(per_case),
        "n_images": len(image_scores),
        "per_case": {k: [float(x) for x in v] for k, v in sorted(per_case.items())},
    }
