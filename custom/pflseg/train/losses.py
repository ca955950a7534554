"""Segmentation losses (MONAI): Dice, optionally plus binary cross-entropy, on sigmoid outputs."""

from __future__ import annotations

from monai.losses import DiceCELoss, DiceLoss
from torch import nn


def build_loss(name: str, reduction: str = "mean") -> nn.Module:
    """``dice`` -> DiceLoss(sigmoid); ``dice_ce`` -> DiceCELoss(sigmoid) (Dice + BCE). Inputs (B, C, H, W) logits.

    Dice is computed over the whole batch (``batch=True``): 2D slices without foreground are common in
    volumes, and a per-slice Dice on them would push the model towards predicting nothing.
    ``reduction="none"`` gives one Dice loss per sample and class (B, C, 1, 1), for per-sample model choices.
    """
    if name == "dice":
        return DiceLoss(sigmoid=True, batch=reduction != "none", reduction=reduction, smooth_nr=1e-5, smooth_dr=1e-5)
    if name == "dice_ce":
        if reduction == "none":  # per-sample losses (FedSM-extra labels): Dice per sample
            return DiceLoss(sigmoid=True, reduction="none", smooth_nr=1e-5, smooth_dr=1e-5)
        return DiceCELoss(sigmoid=True, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)
    raise ValueError(f"train.loss: unknown loss '{name}'; known: dice, dice_ce")
