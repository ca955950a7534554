"""Per-case scoring and prediction files shared by every site-side inference (FedSM super model, IOP-FL
routing): slices grouped by case, Dice per case, and label maps written as NIfTI volumes / PNG images.

``by_case`` maps ``(site, case)`` to its samples in slice order; a sample is ``{"has_label": bool,
"label": (C, H, W) bool or None, "preds": {model key: (C, H, W) bool}, "choice": {route key: model key}}``.

Predictions are written where the site can lay them over its scans: given the case's source files
(``case_sources`` of the dataset the slices came from), each input file gets one prediction file of its own
size and geometry: a NIfTI input a ``.nii.gz`` of the input's shape, affine and header (the slices resized back
from the training size with MONAI's ``Resize``, nearest neighbour, as ``Resized`` inverts a label), a PNG/JPEG
input a PNG of the input's height and width. Without sources (a dataset that is not a
:class:`~pflseg.data.datasets.SliceDataset`) a case is written at the training size: one slice as a PNG, several
as a ``.nii.gz`` with an identity affine.

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

from pflseg.data.datalist import resolve
from pflseg.data.files import is_nifti, private_dir
from pflseg.train.evaluate import dice_scores

#: modes of what a site writes about its patients: a folder only its user enters (``private_dir``), files only its
#: user reads
PRIVATE_FILE = 0o600


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


def case_sources(dataset) -> dict[tuple[str, str], list[tuple[int, Path]]]:
    """``(site, case)`` -> ``[(first slice, image file)]`` of every datalist entry behind ``dataset``: a
    :class:`~pflseg.data.datasets.SliceDataset`, or a ``ConcatDataset`` / ``Subset`` of them (a site's
    ``all_images``); {} for any other dataset."""
    from torch.utils.data import ConcatDataset, Subset

    from pflseg.data.datasets import SliceDataset

    out: dict = defaultdict(list)
    parts = [dataset]
    while parts:
        part = parts.pop(0)
        if isinstance(part, ConcatDataset):
            parts.extend(part.datasets)
        elif isinstance(part, Subset):
            parts.append(part.dataset)
        elif isinstance(part, SliceDataset):
            for entry in part.entries:
                item = (int(entry.get("slice", 0)), resolve(part.root / part.site, entry["image"]))
                if item not in out[part.site, str(entry["case"])]:
                    out[part.site, str(entry["case"])].append(item)
    return {case: sorted(files) for case, files in out.items()}


def _resized(label_map: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A (h, w) uint8 label map at ``shape`` (nearest neighbour: labels stay labels)."""
    if tuple(label_map.shape) == tuple(shape):
        return label_map
    from monai.transforms import Resize

    out = Resize(spatial_size=shape, mode="nearest")(torch.from_numpy(label_map[None].astype(np.float32)))
    return np.asarray(out)[0].astype(np.uint8)


def _write_like(source: Path, slices: dict[int, np.ndarray], stem: Path) -> None:
    """Label maps ``{slice within the file: (h, w) uint8}`` written in ``source``'s geometry: a NIfTI input ->
    ``<stem>.nii.gz`` of its shape, affine and header (slices not given stay 0); a PNG/JPEG -> ``<stem>.png``
    of its size."""
    if is_nifti(source):
        import nibabel as nib

        image = nib.load(str(source))
        shape = tuple(int(n) for n in image.shape)
        depth = shape[2] if len(shape) >= 3 else 1
        volume = np.zeros((shape[0], shape[1], depth), np.uint8)
        for z, label_map in slices.items():
            if 0 <= z < depth:
                volume[..., z] = _resized(label_map, shape[:2])
        header = image.header.copy()
        header.set_data_dtype(np.uint8)
        out = nib.Nifti1Image(volume.reshape(shape), image.affine, header)
        nib.save(out, str(private_file(stem.with_name(stem.name + ".nii.gz"))))
    else:
        from PIL import Image

        with Image.open(source) as im:
            width, height = im.size
        label_map = next(iter(slices.values()))
        Image.fromarray(_resized(label_map, (height, width))).save(private_file(stem.with_name(stem.name + ".png")))


def write_predictions(by_case: dict, names: dict, route_key: str, out_dir: Path, encoding: str,
                      sources: dict | None = None) -> None:
    """One prediction file per case (per input file of the case), the route ``route_key``'s model's; see the
    module docstring. ``sources``: :func:`case_sources` of the dataset (None: the training size)."""
    import nibabel as nib
    from PIL import Image

    private_dir(out_dir)
    for case, items in by_case.items():
        preds = [s["preds"][s["choice"][route_key]] for s in items]
        files = (sources or {}).get(case)
        if files:
            maps = {int(s.get("slice", i)): _label_map(p, encoding) for i, (s, p) in enumerate(zip(items, preds))}
            for first, source in files:
                mine = {z - first: m for z, m in maps.items() if z == first or (len(files) == 1 and z >= first)}
                if mine:
                    _write_like(source, mine, out_dir / (names[case] if len(files) == 1 else f"{names[case]}_{first}"))
        elif len(preds) == 1:
            Image.fromarray(_label_map(preds[0], encoding)).save(private_file(out_dir / f"{names[case]}.png"))
        else:
            volume = _label_map(torch.stack(preds, dim=-1), encoding)  # (H, W, D)
            nib.save(nib.Nifti1Image(volume, np.eye(4)), str(private_file(out_dir / f"{names[case]}.nii.gz")))
