"""Training datasets: a site's datalist split as cached, normalised 2D slices.

Each item is a dict::

    {"image": FloatTensor (C_in, H, W), z-scored per image (per channel),
     "intensity": FloatTensor (C_in, 2), the (mean, std) per channel that z-scoring removed,
     "label": FloatTensor (C_classes, H, W) in {0, 1} (nested or exclusive encoding),
     "case": str, "slice": int, "site": str, "has_label": bool}

with H = W = ``size``. ``image * std + mean`` (``intensity``) is the resized slice in its file's own
intensity units (a std of 0, a constant image, is kept as 1, as z-scoring divides by 1 then): what a
consumer that needs first-order intensity (FedSM's selector) reads; the segmentation nets get ``image``.
3D volumes are sliced along their last axis (every slice one sample);
2D images are one sample each (``slice`` from the datalist entry, 0 by default). ``(site, case)``
and ``slice`` are enough to reassemble per-case predictions for per-case Dice.

Loading uses MONAI: ``LoadImaged`` (nibabel for NIfTI, PIL for PNG/JPEG), then :class:`LabelMapd`
(label_map + range check), then per slice ``Resized`` (image: area averaging when shrinking,
bilinear when enlarging; label: nearest), ``NormalizeIntensityd`` and :class:`EncodeLabelsd`. Unreadable files,
image/mask shape mismatches, wrong channel counts and bad label values raise :class:`DataError`
with the same text as :func:`pflseg.data.check.check_dataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from monai.data import NibabelReader, PILReader
from monai.transforms import Compose, LoadImage, MapTransform, NormalizeIntensityd, Resized

from pflseg.data.datalist import SPLITS, read_datalist, read_dataset_info, resolve
from pflseg.data.errors import DataError, Problem, problems_error, shape_mismatch, unreadable
from pflseg.data.files import convert_image, convert_mask, is_nifti
from pflseg.data.labels import encode_labels, map_labels


def load_dataset_info(root: str | Path) -> dict:
    """Reads and validates ``<root>/dataset.json``.

    Raises:
        DataError: Missing file, invalid JSON, missing/unknown keys or bad values (all listed).
    """
    info, problems = read_dataset_info(root)
    if problems:
        raise problems_error(problems, root)
    return info


class LabelMapd(MapTransform):
    """Applies the entry's ``label_map`` (or ``label_threshold``) to the label and checks the classes are 0..C.

    Reads ``d["label_map"]`` and ``d["label_threshold"]`` (optional), ``d["site"]`` and
    ``d["label_path"]`` for messages.

    Args:
        keys: Label key(s).
        n_classes: Number of classes C.
    """

    def __init__(self, keys, n_classes: int):
        super().__init__(keys)
        self.n_classes = n_classes

    def __call__(self, data: dict) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            mask = np.asarray(d[key])
            d[key] = map_labels(d.get("site", ""), d.get("label_path", ""), mask, d.get("label_map"), self.n_classes,
                                d.get("label_threshold"))
        return d


class KeepIntensityd(MapTransform):
    """Stores the per-channel (mean, std) of ``d[key]`` as ``d["intensity"]`` (C, 2) float32, computed as
    ``NormalizeIntensityd(channel_wise=True)`` does (population std, 0 -> 1), so that the z-scored image
    times std plus mean gives the image back."""

    def __call__(self, data: dict) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            x = torch.as_tensor(d[key]).detach().float().flatten(1)
            std = x.std(dim=1, unbiased=False)
            d["intensity"] = torch.stack([x.mean(dim=1), torch.where(std == 0, torch.ones_like(std), std)], dim=1)
        return d


class EncodeLabelsd(MapTransform):
    """Class indices (1, H, W) -> binary channels (C, H, W) float32 (nested or exclusive rule).

    Args:
        keys: Label key(s).
        n_classes: Number of classes C.
        encoding: "nested" (channel c = label > c) or "exclusive" (channel c = label == c + 1).
    """

    def __init__(self, keys, n_classes: int, encoding: str):
        super().__init__(keys)
        self.n_classes, self.encoding = n_classes, encoding

    def __call__(self, data: dict) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            label = np.asarray(torch.as_tensor(d[key]).detach().cpu())[0]
            d[key] = torch.from_numpy(encode_labels(np.rint(label), self.n_classes, self.encoding))
        return d


class SliceDataset(torch.utils.data.Dataset):
    """The 2D slices of one site's split (see the module docstring for the items).

    Args:
        root: Data root.
        site: Site name (one of dataset.json "sites").
        split: "training", "validation" or "testing".
        size: Output height and width in pixels.
        cache: Keep every processed slice in memory (built once, here); otherwise load per item.
        foreground_only: Keep only slices whose label has foreground.
        transform: Optional callable applied to each item dict after loading (e.g. augmentation).
    """

    def __init__(
        self,
        root: str | Path,
        site: str,
        split: str,
        size: int = 64,
        cache: bool = True,
        foreground_only: bool = False,
        transform: Callable[[dict], dict] | None = None,
    ):
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: expected one of {SPLITS}")
        if size < 4:
            raise ValueError(f"size={size}: need >= 4")
        self.root, self.site, self.split, self.size = Path(root), site, split, size
        self.info = load_dataset_info(root)
        if site not in self.info["sites"]:
            raise DataError(f"site {site!r} is not in {self.root / 'dataset.json'} (sites: {self.info['sites']}). "
                            "Fix: use one of those site names or re-index the data")
        self.entries = read_datalist(root, site).get(split, [])
        if split == "training" and not self.entries:
            raise DataError(f"[{site}] {self.root / site / 'datalist.json'}: empty site: no training entries. "
                            "Fix: add training cases for this site or remove it from dataset.json")
        self.n_classes = len(self.info["classes"])
        self.transform = transform
        self._load = {  # images: alpha dropped, palette -> gray/RGB; masks: palette indices kept
            role: LoadImage(reader=[NibabelReader(), PILReader(converter=convert, reverse_indexing=False)],
                            image_only=True, dtype=np.float32)
            for role, convert in (("image", convert_image), ("label", convert_mask))
        }  # NIfTI: nibabel only (a reader list is tried last-first: PIL would fail on, and log, every volume)
        self._load_nifti = LoadImage(reader=NibabelReader(), image_only=True, dtype=np.float32)
        self._label_map = LabelMapd("label", self.n_classes)
        self._slice_tf = {  # area averaging when shrinking (no aliasing, no border fall-off), else bilinear
            shrink: Compose([
                Resized("image", (size, size), mode="area" if shrink else "bilinear"),
                Resized("label", (size, size), mode="nearest"),
                KeepIntensityd("image"),
                NormalizeIntensityd("image", channel_wise=True),
                EncodeLabelsd("label", self.n_classes, self.info["label_encoding"]),
            ])
            for shrink in (False, True)
        }
        self._last: tuple[int, list[dict]] | None = None
        if cache or foreground_only:
            samples = [s for k in range(len(self.entries)) for s in self._slices(k)]
            keep = [s for s in samples if not foreground_only or s["label"].any()]
            self._cache = keep if cache else None
            self.index = [(s["_entry"], s["slice_pos"]) for s in keep]
        else:
            self._cache = None
            self.index = [(k, z) for k in range(len(self.entries)) for z in range(self._depth(k))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        if self._cache is not None:
            sample = self._cache[i]
        else:
            k, z = self.index[i]
            if self._last is None or self._last[0] != k:
                self._last = (k, self._slices(k))
            sample = self._last[1][z]
        item = {key: v for key, v in sample.items() if not key.startswith("_") and key != "slice_pos"}
        item = dict(item, image=item["image"].clone(), intensity=item["intensity"].clone(), label=item["label"].clone())
        return self.transform(item) if self.transform is not None else item

    def _paths(self, k: int) -> tuple[Path, Path | None]:
        """Absolute image and label paths of entry k."""
        entry, site_dir = self.entries[k], self.root / self.site
        label = entry.get("label")
        return resolve(site_dir, entry["image"]), (resolve(site_dir, label) if label else None)

    def _depth(self, k: int) -> int:
        """Number of slices of entry k, from the header only."""
        path, _ = self._paths(k)
        if not is_nifti(path):
            return 1
        try:
            import nibabel as nib

            shape = nib.load(str(path)).shape
        except Exception as err:  # noqa: BLE001 - any reader failure is a data problem
            raise unreadable(self.site, path, err).error() from err
        return int(shape[2]) if len(shape) >= 3 else 1

    def _read(self, path: Path, role: str = "image") -> np.ndarray:
        """Loads an image (role "image") or mask ("label") as (C, H, W, D) float32 (see the module docstring)."""
        try:
            data = np.asarray((self._load_nifti if is_nifti(path) else self._load[role])(str(path)))
        except Exception as err:  # noqa: BLE001
            raise unreadable(self.site, path, err.__cause__ or err).error() from err
        if is_nifti(path):
            data = data.reshape(data.shape[:3]) if data.ndim > 3 else data
            return data[None, :, :, None] if data.ndim == 2 else data[None]
        return data[None, :, :, None] if data.ndim == 2 else np.moveaxis(data, -1, 0)[..., None]

    def _slices(self, k: int) -> list[dict]:
        """Processed 2D samples of entry k, in slice order."""
        entry = self.entries[k]
        image_path, label_path = self._paths(k)
        image = self._read(image_path)
        if image.shape[0] != self.info["in_channels"]:
            raise Problem(self.site, str(image_path),
                          f"image has {image.shape[0]} channel(s), dataset.json says in_channels="
                          f"{self.info['in_channels']}", "convert the image or fix in_channels in dataset.json",
                          "channel_count").error()
        if label_path is not None:
            label = self._read(label_path, "label")[:1]
            if label.shape[1:] != image.shape[1:]:
                raise shape_mismatch(self.site, image_path, label_path, image.shape[1:], label.shape[1:]).error()
            d = self._label_map({"label": label, "label_map": entry.get("label_map"), "site": self.site,
                                 "label_threshold": entry.get("label_threshold"), "label_path": str(label_path)})
            label = d["label"].astype(np.float32)
        else:
            label = np.zeros((1,) + image.shape[1:], np.float32)
        first = int(entry.get("slice", 0)) if image.shape[-1] == 1 else 0
        out, transform = [], self._slice_tf[min(image.shape[1:3]) > self.size]
        for z in range(image.shape[-1]):
            d = transform({"image": torch.from_numpy(np.ascontiguousarray(image[..., z])),
                                "label": torch.from_numpy(np.ascontiguousarray(label[..., z]))})
            out.append({
                "image": _plain(d["image"]),
                "intensity": _plain(d["intensity"]),
                "label": _plain(d["label"]),
                "case": str(entry["case"]),
                "slice": first + z,
                "site": self.site,
                "has_label": label_path is not None,
                "_entry": k,
                "slice_pos": z,
            })
        return out


def _plain(x) -> torch.Tensor:
    """A contiguous float32 torch.Tensor (MetaTensor metadata dropped)."""
    x = x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(x)
    return x.float().contiguous()


#: One site's split as 2D samples (see :class:`SliceDataset`).
site_dataset = SliceDataset


def pooled_dataset(
    root: str | Path,
    sites: Sequence[str] | None,
    split: str,
    size: int = 64,
    cache: bool = True,
    foreground_only: bool = False,
    transform: Callable[[dict], dict] | None = None,
) -> torch.utils.data.ConcatDataset:
    """Several sites' splits concatenated (centralized training); ``sites=None`` takes all."""
    names = list(sites) if sites is not None else load_dataset_info(root)["sites"]
    if not names:
        raise ValueError("sites is empty: pass at least one site name (or None for all)")
    return torch.utils.data.ConcatDataset([
        SliceDataset(root, s, split, size=size, cache=cache, foreground_only=foreground_only, transform=transform)
        for s in names
    ])


def case_of(sample: dict) -> tuple[str, str]:
    """The ``(site, case)`` key of a sample, for per-case aggregation."""
    return str(sample["site"]), str(sample["case"])
