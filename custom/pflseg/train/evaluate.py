"""Evaluation: foreground Dice per class, per 2D image and per case (slices reassembled into volumes).

Predictions are ``sigmoid(logits) > 0.5`` per class channel. Per-case Dice stacks a case's slices in
slice order into a (C, H, W, D) volume and scores it with MONAI's DiceMetric; a class absent from both
prediction and ground truth of a case counts as 1 (perfect), absent from ground truth only as 0.
IoU (MONAI ``compute_iou``) follows the same rule. ASSD (average symmetric surface distance, MONAI
``compute_average_surface_distance``, on request: it costs a distance transform per case and class) is
in pixels of the resized slices (slice spacing 1); a class empty in both is 0, a class empty in only one
of prediction and ground truth has no surface distance: it is left out of the mean and counted in
``assd_undefined``. HD95 (95th percentile of the symmetric Hausdorff distance, MONAI
``compute_hausdorff_distance(percentile=95)``) comes with ASSD, under the same rules (``hd95``,
``hd95_per_class``, ``hd95_undefined``); it changes no other metric.

``adabn`` (AdaBN, Li et al. 2016) re-estimates a model's batch-norm running statistics on other images
before it is evaluated: the "statistics" part of a personalization gain, without touching any weight.

``amp`` and ``channels_last`` (``train.amp``, ``train.channels_last``; ``pflseg.train.loop``) apply to the forward
passes here as in training: autocast on the model's device, logits cast to float32 before the sigmoid, so every
metric is computed in float32; off (the default) changes nothing. ``amp_forward`` is that rule for one forward pass,
for the paths that score or adapt a model elsewhere (FedSM's selector and super model, IOP-FL's routing and Tent,
overlays).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
from monai.metrics import DiceMetric, compute_average_surface_distance, compute_hausdorff_distance, compute_iou
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pflseg.train.loop import amp_dtype, autocast, image_to, make_loader, memory_format


def amp_forward(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                dtype: torch.dtype | None) -> torch.Tensor:
    """``model(x)`` with the forward pass under autocast in ``dtype`` (``pflseg.train.loop.amp_dtype`` of ``train.amp``)
    on ``x``'s device and its output cast to float32 outside autocast: what follows (sigmoid, softmax, losses,
    statistics) computes in float32. ``dtype`` None (amp off, or fp16 off CUDA): ``model(x)`` as it is, nothing added.

    ``model`` is any callable of one tensor (a module, ``selector.embed``)."""
    if dtype is None:
        return model(x)
    with autocast(dtype, x.device):
        out = model(x)
    return out.float()


def amp_model(model: Callable[[torch.Tensor], torch.Tensor],
              dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` whose calls go through ``amp_forward`` in ``dtype``; ``model`` itself for None."""
    if dtype is None:
        return model
    return lambda x: amp_forward(model, x, dtype)


@torch.no_grad()
def predict(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 32, amp: str = "off",
            channels_last: bool = False):
    """Yield ``(sample_meta, pred (C,H,W) bool, label (C,H,W) bool)`` for every sample, in dataset order; the forward
    passes with ``amp`` / ``channels_last`` (module docstring)."""
    device = torch.device(device)
    dtype = amp_dtype(amp, device)
    model.to(device).eval()
    with memory_format(model, channels_last):
        for batch in make_loader(dataset, batch_size, shuffle=False, device=device):
            with autocast(dtype, device):
                logits = model(image_to(batch["image"], device, channels_last))
            preds = (torch.sigmoid(logits.float()) > 0.5).cpu()
            for i in range(preds.shape[0]):
                yield (batch["case"][i], int(batch["slice"][i])), preds[i], batch["label"][i] > 0.5


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The batch-norm layers of ``model`` that keep running statistics (found by module type)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@torch.no_grad()
def adabn(model: nn.Module, loader: DataLoader, device: torch.device, amp: str = "off",
          channels_last: bool = False) -> nn.Module:
    """AdaBN: replace the running statistics of every batch-norm layer of ``model`` by those of ``loader``'s images.

    Statistics are reset, then one pass over ``loader`` without gradients with the batch-norm layers in train
    mode (every other module in eval mode, so dropout stays off) and ``momentum=None``: each running mean /
    variance becomes the cumulative average of the batches' means / unbiased variances (the data set's mean
    exactly when the batches are of equal size). Weights, affine parameters and momenta are left as they were.

    Args:
        model: the network, changed in place; its batch-norm inputs are (B, C, H, W) features.
        loader: batches with an ``image`` (B, C_in, H, W).
        device: where the forward passes run.
        amp, channels_last: as in training (module docstring); the running statistics stay float32 buffers.

    Returns:
        ``model``, in eval mode. A model without batch-norm layers is returned unchanged (in eval mode).
    """
    device = torch.device(device)
    dtype = amp_dtype(amp, device)
    model.to(device).eval()
    norms = batch_norms(model)
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    try:
        if norms:
            with memory_format(model, channels_last):
                for batch in loader:
                    with autocast(dtype, device):
                        model(image_to(batch["image"], device, channels_last))
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.eval()
    return model


def dice_scores(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-class Dice of one sample: pred/label (C, ...) bool -> (C,) float, empty-vs-empty = 1."""
    metric = DiceMetric(include_background=True, reduction="none", ignore_empty=False)
    return metric(pred[None].float(), label[None].float())[0]


def iou_scores(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-class IoU of one sample: pred/label (C, ...) bool -> (C,) float, empty-vs-empty = 1."""
    return compute_iou(pred[None].float(), label[None].float(), include_background=True, ignore_empty=False)[0]


def assd_scores(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-class ASSD of one sample in pixels: (C, ...) bool -> (C,) float; 0 when both are empty, inf
    when only one of them is."""
    with warnings.catch_warnings():  # MONAI warns about empty masks; handled here
        warnings.simplefilter("ignore")
        out = compute_average_surface_distance(pred[None].float(), label[None].float(), include_background=True,
                                               symmetric=True)[0]
    return _empty_rules(out, pred, label)


def hd95_scores(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-class HD95 of one sample in pixels (95th percentile of the surface distances, both directions, the
    larger of the two): (C, ...) bool -> (C,) float; 0 when both are empty, inf when only one of them is."""
    with warnings.catch_warnings():  # MONAI warns about empty masks (and a deprecated argument); handled here
        warnings.simplefilter("ignore")
        out = compute_hausdorff_distance(pred[None].float(), label[None].float(), include_background=True,
                                         percentile=95)[0]
    return _empty_rules(out, pred, label)


def _empty_rules(out: torch.Tensor, pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """A surface distance per class (C,) with the empty-mask rules: 0 where both are empty, inf where one is."""
    both_empty = ~pred.flatten(1).any(1) & ~label.flatten(1).any(1)
    one_empty = pred.flatten(1).any(1) ^ label.flatten(1).any(1)
    out = torch.where(both_empty, torch.zeros_like(out), out)
    return torch.where(one_empty, torch.full_like(out, float("inf")), out)


def evaluate(model: nn.Module, dataset: Dataset, device: torch.device, batch_size: int = 32,
             surface: bool = False, amp: str = "off", channels_last: bool = False) -> dict:
    """Score ``model`` on ``dataset`` (forward passes with ``amp`` / ``channels_last``, module docstring).

    Returns:
        ``dice`` (mean over cases and classes), ``dice_per_class`` (per class, over cases),
        ``dice_image`` (mean over 2D images and classes), ``iou``, ``iou_per_class`` (per case, like
        Dice), ``n_cases``, ``n_images``, ``per_case`` (Dice); with ``surface`` also ``assd``,
        ``assd_per_class`` (mean over the cases where it is defined; None if nowhere) and ``assd_undefined``
        (number of (case, class) pairs left out), and ``hd95``, ``hd95_per_class``, ``hd95_undefined`` alike.
    """
    if len(dataset) == 0:
        raise ValueError("evaluate: empty dataset")
    by_case: dict[str, list] = defaultdict(list)
    image_scores = []
    for (case, slice_idx), pred, label in predict(model, dataset, device, batch_size, amp, channels_last):
        by_case[case].append((slice_idx, pred, label))
        image_scores.append(dice_scores(pred, label))
    per_case, ious, assds, hd95s = {}, [], [], []
    for case, items in by_case.items():
        items.sort(key=lambda t: t[0])
        pred = torch.stack([p for _, p, _ in items], dim=-1)
        label = torch.stack([l for _, _, l in items], dim=-1)
        per_case[case] = dice_scores(pred, label)
        ious.append(iou_scores(pred, label))
        if surface:
            assds.append(assd_scores(pred, label))
            hd95s.append(hd95_scores(pred, label))
    case_tensor, iou = torch.stack(list(per_case.values())), torch.stack(ious)
    out = {
        "dice": float(case_tensor.mean()),
        "dice_per_class": [float(x) for x in case_tensor.mean(0)],
        "dice_image": float(torch.stack(image_scores).mean()),
        "iou": float(iou.mean()),
        "iou_per_class": [float(x) for x in iou.mean(0)],
        "n_cases": len(per_case),
        "n_images": len(image_scores),
        "per_case": {k: [float(x) for x in v] for k, v in sorted(per_case.items())},
    }
    if surface:
        for key, scores in (("assd", assds), ("hd95", hd95s)):
            out.update(surface_summary(key, torch.stack(scores)))
    return out


def surface_summary(key: str, dist: torch.Tensor) -> dict:
    """``key`` (mean over the finite (case, class) values; None if none), ``<key>_per_class`` and
    ``<key>_undefined`` (the count of non-finite values) of per-case distances ``dist`` (N_cases, C)."""
    finite = torch.isfinite(dist)

    def mean(t, m):
        return float(t[m].mean()) if m.any() else None

    return {key: mean(dist, finite), f"{key}_per_class": [mean(dist[:, c], finite[:, c]) for c in range(dist.shape[1])],
            f"{key}_undefined": int((~finite).sum())}
