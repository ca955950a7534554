"""Prediction overlays, drawn at the site (the images never leave it): for the best and the worst test cases
by Dice, one PNG of image | ground truth | prediction side by side, at the training resolution.

A volume shows the slice with the most ground-truth foreground. Each class has its own colour, the same in
the ground-truth and the prediction panel (for nested labels, e.g. disc and cup, the inner class is drawn
over the outer one). Drawn with PIL (a core dependency), so every site can make them. They show patients: the
folder is ``0700``, every file ``0600`` (``pflseg.train.predictions.private_dir`` / ``private_file``).

The forward passes follow ``train.amp`` (``amp``) as evaluation does (``pflseg.train.evaluate.amp_forward``): autocast
on the model's device, the logits cast to float32 before the sigmoid; off (the default) changes nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from pflseg.train.evaluate import amp_forward
from pflseg.train.loop import amp_dtype
from pflseg.train.predictions import private_dir, private_file

#: class colours (RGB), cycled
COLOURS = [(255, 64, 64), (64, 160, 255), (255, 220, 0), (0, 220, 120), (220, 80, 255), (255, 140, 0)]
ALPHA = 0.45
MIN_PANEL = 160  # panels are enlarged (nearest neighbour) to at least this many pixels
HEADER = 16


def pick_cases(per_case: dict[str, list[float]], n: int = 2) -> list[tuple[str, str, float]]:
    """Up to ``n`` best and ``n`` worst cases by mean Dice over classes (half each when there are fewer
    than 2n cases): ``[(tag, case, dice)]`` from the lowest Dice up; ``worst-1`` is the lowest, ``best-1``
    the highest (ties broken by case name)."""
    ranked = sorted(((float(np.mean(d)), c) for c, d in per_case.items()), key=lambda t: (-t[0], t[1]))
    k = min(len(ranked), 2 * n)
    best, worst = ranked[:(k + 1) // 2], ranked[::-1][:k // 2]
    return [(f"worst-{i}", c, d) for i, (d, c) in enumerate(worst, 1)] + \
        [(f"best-{i}", c, d) for i, (d, c) in reversed(list(enumerate(best, 1)))]


def _to_rgb(image: torch.Tensor) -> np.ndarray:
    """(C, H, W) z-scored image -> (H, W, 3) uint8: RGB when C = 3, else channel 0 in gray; each channel
    stretched between its 1st and 99th percentile."""
    x = image.float().numpy()
    x = x if x.shape[0] == 3 else x[:1].repeat(3, 0)
    lo, hi = np.percentile(x, 1, axis=(1, 2), keepdims=True), np.percentile(x, 99, axis=(1, 2), keepdims=True)
    x = np.clip((x - lo) / np.maximum(hi - lo, 1e-6), 0, 1)
    return (np.moveaxis(x, 0, -1) * 255).astype(np.uint8)


def _tint(rgb: np.ndarray, mask: torch.Tensor) -> np.ndarray:
    """``rgb`` with each class channel of ``mask`` (C, H, W) blended in its colour, class 0 first."""
    out = rgb.astype(np.float32)
    for c in range(mask.shape[0]):
        m = mask[c].numpy().astype(bool)
        out[m] = (1 - ALPHA) * out[m] + ALPHA * np.array(COLOURS[c % len(COLOURS)], np.float32)
    return out.astype(np.uint8)


def render(image: torch.Tensor, label: torch.Tensor, pred: torch.Tensor, title: str) -> Image.Image:
    """One overlay: image, ground truth and prediction (each (C, H, W)) side by side under ``title``."""
    rgb = _to_rgb(image)
    panels = [rgb, _tint(rgb, label), _tint(rgb, pred)]
    h, w = rgb.shape[:2]
    k = max(1, -(-MIN_PANEL // max(h, w)))
    panels = [Image.fromarray(p).resize((w * k, h * k), Image.NEAREST) for p in panels]
    gap = 4
    canvas = Image.new("RGB", (3 * w * k + 2 * gap, h * k + 2 * HEADER), (0, 0, 0))
    draw = ImageDraw.Draw(canvas)
    draw.text((2, 2), title, fill=(255, 255, 255))
    for i, (panel, name) in enumerate(zip(panels, ("image", "ground truth", "prediction"))):
        x = i * (w * k + gap)
        canvas.paste(panel, (x, HEADER))
        draw.text((x + 2, HEADER + h * k + 2), name, fill=(255, 255, 255))
    return canvas


def overlay_title(site: str, case: str, slice_index: int | None, dice: float, tag: str) -> str:
    """An overlay's title, each part named (PIL's small default font makes a bare space easy to miss: "HospitalA
    case002" read as one word): ``site HospitalA | case case002 | slice 4 | Dice 0.812 (best-1)``."""
    parts = ([f"site {site}"] if site else []) + [f"case {case}"]
    if slice_index is not None:
        parts.append(f"slice {slice_index}")
    return " | ".join(parts + [f"Dice {dice:.3f} ({tag})"])


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "case"


@torch.no_grad()
def write_overlays(model: torch.nn.Module, dataset, device: torch.device, out_dir: str | Path,
                   per_case: dict[str, list[float]], site: str = "", n: int = 2, amp: str = "off") -> list[Path]:
    """Write ``<out_dir>/<worst|best>-<k>_<case>.png`` for the ``n`` worst and ``n`` best cases of
    ``per_case`` (case -> Dice per class, as :func:`pflseg.train.evaluate.evaluate` returns it), replacing
    the folder's earlier overlays.

    Args:
        model: The model whose predictions are drawn (its logits, sigmoid > 0.5 per class).
        dataset: The split's 2D samples (``image`` (C, H, W), ``label``, ``case``).
        per_case: Per-case Dice of ``model`` on ``dataset``.
        amp: ``train.amp`` (off | bf16 | fp16) of the forward passes (module docstring).

    Returns:
        The paths written, worst first.
    """
    out_dir = private_dir(out_dir)
    for old in out_dir.glob("*.png"):
        old.unlink()
    chosen = pick_cases(per_case, n)
    wanted = {case for _, case, _ in chosen}
    slices: dict[str, dict] = {}  # the slice with the most ground-truth foreground per chosen case
    depth: dict[str, int] = {}
    for i in range(len(dataset)):
        item = dataset[i]
        case = str(item["case"])
        if case in wanted:
            depth[case] = depth.get(case, 0) + 1
            if case not in slices or item["label"].sum() > slices[case]["label"].sum():
                slices[case] = item
    dtype = amp_dtype(amp, device)
    model.to(device).eval()
    paths = []
    for tag, case, dice in chosen:
        item = slices[case]
        pred = (torch.sigmoid(amp_forward(model, item["image"][None].to(device), dtype)) > 0.5)[0].cpu()
        title = overlay_title(site, case, int(item["slice"]) if depth[case] > 1 else None, dice, tag)
        path = out_dir / f"{tag}_{_safe(case)}.png"
        render(item["image"], item["label"] > 0.5, pred, title).save(private_file(path), format="PNG")
        paths.append(path)
    return paths
