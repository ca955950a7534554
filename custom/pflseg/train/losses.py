"""Segmentation losses (MONAI): Dice, optionally plus binary cross-entropy, on sigmoid outputs."""

from __future__ import annotations

from monai.losses import DiceCELoss, DiceLoss
from torch import nn


def build_loss(name: str) -> nn.Module:
    """``dice`` -> DiceLoss(sigmoid); ``dice_ce`` -> DiceCELoss(sigmoid) (Dice + BCE). Inputs (B, C, H, W) logits."""
    if name == "dice":
        return DiceLoss(sigmoid=True, smooth_nr=1e-5, smooth_dr=1e-5)
    if name == "dice_ce":
        return DiceCELoss(sigmoid=True, smooth_nr=1e-5, smooth_dr=1e-5)
    raise ValueError(f"train.loss: unknown loss '{name}'; known: dice, dice_ce")
