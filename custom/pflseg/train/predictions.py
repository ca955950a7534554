"""Per-case scoring and prediction files shared by every site-side inference (FedSM super model, IOP-FL
routing): slices grouped by case, Dice per case, and label maps written as NIfTI volumes / PNG images.

``by_case`` maps ``(site, case)`` to its samples in slice order; a sample is ``{"has_label": bool,
"label": (C, H, W) bool or None, "preds": {model key: (C, H, W) bool}, "choice": {route key: model key}}``.

Predictions (and the overlays, ``pflseg.train.overlays``) show patients: their folder is made ``0700`` and every
file ``0600`` (``private_dir``, ``private_file``), whatever the process's umask.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pflseg.train.evaluate import dice_scores

#: modes of what a site writes about its patients: a folder only its user enters, files only its user reads
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def private_dir(folder: str | Path) -> Path:
    """``folder`` (made if missing, with its parents) with mode ``PRIVATE_DIR``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, PRIVATE_DIR)
    return folder


def private_file(path: str | Path) -> Path:
    """``path`` created empty (or truncated) with mode ``PRIVATE_FILE``, for a writer that opens it by name
    (PIL, nibabel: they truncate it and keep its mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
    finally:
        os.close(fd)
    return Path(path)


def case_dice(by_case: dict, names: dict, pick) -> dict:
    """Per-case Dice of the prediction ``pick(sample)`` (a model key) over the labelled slices;
    ``per_case`` is keyed by the case's file name (``names``)."""
    per_case = {}
    for case, items in by_case.items():
        labelled = [s for s in items if s["has_label"]]
        if not labelled:
            continue
        pred = torch.stack([s["preds"][pick(s)] for s in labelled], dim=-1)
        label = torch.stack([s["label"] for s in labelled], dim=-1)
        per_case[case] = dice_scores(pred, label)
    if not per_case:
        return {"dice": None, "dice_per_class": None, "per_case": {}}
    scores = torch.stack(list(per_case.values()))
    return {
        "dice": float(scores.mean()),
        "dice_per_class": [float(x) for x in scores.mean(0)],
        "per_case": {names[c]: [float(x) for x in v] for c, v in sorted(per_case.items())},
    }



def case_names(cases: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """File-safe, unique names: the sanitised case id; ``<site>_<case>`` when the id repeats across
    sites; a ``-<n>`` suffix if sanitising still collides."""
    counts = defaultdict(int)
    for _, case in cases:
        counts[case] += 1
    names, used = {}, set()
    for site, case in sorted(cases):
        base = _safe(case if counts[case] == 1 or not site else f"{site}_{case}")
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}-{n}"
        used.add(name)
        names[(site, case)] = name
    return names


def _safe(text: str) -> str:
    """Characters outside [A-Za-z0-9._-] -> '_'; no leading dot; never empty."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text).lstrip(".")
    return name or "case"


def _label_map(pred: torch.Tensor, encoding: str) -> np.ndarray:
    """Binary channels (C, ...) -> uint8 class map (...): nested = channel sum, exclusive = c + 1 of the
    highest positive channel."""
    p = pred.to(torch.uint8)
    if encoding == "nested":
        out = p.sum(0)
    else:
        weights = torch.arange(1, p.shape[0] + 1, dtype=torch.uint8).view(-1, *([1] * (p.ndim - 1)))
        out = (p * weights).amax(0)
    return out.numpy().astype(np.uint8)


def write_predictions(by_case: dict, names: dict, route_key: str, out_dir: Path, encoding: str) -> None:
    import nibabel as nib
    from PIL import Image

    private_dir(out_dir)
    for case, items in by_case.items():
        preds = [s["preds"][s["choice"][route_key]] for s in items]
        if len(preds) == 1:
            Image.fromarray(_label_map(preds[0], encoding)).save(private_file(out_dir / f"{names[case]}.png"))
        else:
            volume = _label_map(torch.stack(preds, dim=-1), encoding)  # (H, W, D)
            nib.save(nib.Nifti1Image(volume, np.eye(4)), str(private_file(out_dir / f"{names[case]}.nii.gz")))
