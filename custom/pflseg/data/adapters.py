"""Dataset adapters: index data where it lies into per-site datalists (nothing is copied).

:func:`index_dataset` reads one of the :data:`LAYOUTS`, pairs every image with its mask, assigns
cases to training / validation / testing (keeping a published train/test split where the layout
has one) and writes ``<out>/dataset.json`` plus ``<out>/<site>/datalist.json`` whose entries point to
the original files by absolute path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from pflseg.data.datalist import split_cases, write_dataset_json, write_datalist
from pflseg.data.errors import DataError
from pflseg.data.files import file_stem, is_image_file, is_nifti, mask_plane, n_channels, read_array

LAYOUTS: dict[str, str] = {
    "saml": "<root>/<Site>/CaseNN.nii.gz + CaseNN_segmentation.nii.gz (or _Segmentation); prostate volumes",
    "nvflare_prostate": "<root>/<site>/Image/<case>.nii.gz + <root>/<site>/Mask/<case>.nii.gz",
    "prostate_slices": "<root>/<site>/{train,test}/{image,mask}/NN_MM.png; case NN, slice MM; mask 0 = prostate",
    "fundus": "<root>/Domain<k>/{train,test}/ROIs/{image,mask}/*.png; RGB; mask 0 cup, 128 rim, 255 background",
    "generic": "<root>/<site>/{images,masks}/ matched by file stem; PNG, JPEG or NIfTI; binary or 0..C masks",
}

# The published ProstateSlice masks draw the gland as 0 on a 255 background (checked on the shared
# fixtures: value 0 covers 0.6-3.5 % of each slice, the gland region), so 0 maps to prostate.
_PROSTATE_SLICE_MAP = {"0": 1, "255": 0}
_BINARY_255_MAP = {"0": 0, "255": 1}
_FUNDUS_MAP = {"0": 2, "128": 1, "255": 0}


def index_dataset(
    layout: str,
    root: str | Path,
    out: str | Path,
    seed: int = 0,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    classes: list[str] | None = None,
) -> Path:
    """Indexes a dataset in place and writes its data root (dataset.json + datalists).

    Args:
        layout: One of :data:`LAYOUTS`.
        root: Folder holding the original data.
        out: Data root to write (may equal ``root``).
        seed: Seed of the case-level split.
        val_fraction: Fraction of cases for validation.
        test_fraction: Fraction of cases for testing; ignored where the layout has a published
            test split.
        classes: Class names (``generic`` only; inferred from the masks when None).

    Returns:
        The data root ``out``.

    Raises:
        DataError: Unknown layout, missing folder, no sites found, an image without its mask (or
            a mask without its image), or masks that are neither binary nor labelled 0..C.
    """
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout {layout!r}. Fix: use one of {', '.join(LAYOUTS)}")
    root = Path(os.path.abspath(root))
    if not root.is_dir():
        raise DataError(f"{root}: data folder not found. Fix: pass the folder that holds the site folders")
    meta = {"name": root.name, "task": "prostate", "classes": ["prostate"], "label_encoding": "nested",
            "in_channels": 1}
    if layout == "saml":
        sites = _saml(root)
    elif layout == "nvflare_prostate":
        sites = _nvflare_prostate(root)
    elif layout == "prostate_slices":
        sites = _published_split(root, "*", ("image", "mask"), _PROSTATE_SLICE_MAP, slices=True)
    elif layout == "fundus":
        sites = _published_split(root, "Domain*", ("ROIs/image", "ROIs/mask"), _FUNDUS_MAP, slices=False)
        meta.update(task="fundus", classes=["disc", "cup"], in_channels=3)
    else:
        sites = _generic(root)
        meta.update(_generic_meta(sites, classes))
    if not sites:
        raise DataError(f"{root}: no sites found for layout {layout!r} ({LAYOUTS[layout]}). "
                        "Fix: point --root at the folder holding the site folders, or pick the matching layout")
    out = Path(out)
    for site, records in sites.items():
        write_datalist(out / site, site, _assign_splits(site, records, seed, val_fraction, test_fraction))
    write_dataset_json(out, sites=list(sites), layout=layout, **meta)
    return out


def _assign_splits(site, records, seed, val_fraction, test_fraction) -> dict[str, list[dict]]:
    """Groups records into splits by case; records with a published split keep it."""
    published = any("split" in r for r in records)
    free = sorted({r["case"] for r in records if r.get("split") != "testing"})
    split = split_cases(free, seed, site, val_fraction, 0.0 if published else test_fraction)
    entries: dict[str, list[dict]] = {}
    for r in records:
        name = "testing" if r.get("split") == "testing" else split[r["case"]]
        entries.setdefault(name, []).append({k: v for k, v in r.items() if k != "split"})
    return entries


def _site_dirs(root: Path, pattern: str = "*") -> list[Path]:
    """Visible sub-folders of root matching pattern, sorted by name."""
    return sorted(p for p in root.glob(pattern) if p.is_dir() and not p.name.startswith((".", "_")))


def _images(folder: Path) -> list[Path]:
    """Image files in a folder, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and is_image_file(p) and not p.name.startswith("."))


def _raise_unpaired(missing: list[str]) -> None:
    """Raises one DataError for all images without masks / masks without images."""
    if missing:
        lines = "\n".join(f"  - {m}" for m in missing)
        raise DataError(f"{len(missing)} unpaired file(s):\n{lines}\n"
                        "Fix: add the missing files or move the unpaired ones out of the data folder")


def _saml(root: Path) -> dict[str, list[dict]]:
    """SAML release: CaseNN.nii.gz next to CaseNN_segmentation.nii.gz in each site folder."""
    sites, missing = {}, []
    for site_dir in _site_dirs(root):
        files = [p for p in _images(site_dir) if is_nifti(p)]
        masks = {file_stem(p)[: -len("_segmentation")]: p for p in files
                 if file_stem(p).lower().endswith("_segmentation")}
        images = {file_stem(p): p for p in files if not file_stem(p).lower().endswith("_segmentation")}
        for case, image in images.items():
            if case not in masks:
                missing.append(f"[{site_dir.name}] {image}: no mask {case}_segmentation.nii.gz")
        for case, mask in masks.items():
            if case not in images:
                missing.append(f"[{site_dir.name}] {mask}: no image {case}.nii.gz")
        records = [{"image": str(images[c]), "label": str(masks[c]), "case": c} for c in sorted(images) if c in masks]
        if records:
            sites[site_dir.name] = records
    _raise_unpaired(missing)
    return sites


def _pair_folder(site: str, image_dir: Path, mask_dir: Path, missing: list[str]) -> list[tuple[Path, Path]]:
    """Pairs images and masks of two folders by file stem; unpaired files go to ``missing``."""
    for folder in (image_dir, mask_dir):
        if not folder.is_dir():
            raise DataError(f"[{site}] {folder}: folder not found. Fix: create it with the "
                            f"{'images' if folder == image_dir else 'masks'} of this site, or remove the site folder")
    images = {file_stem(p): p for p in _images(image_dir)}
    masks = {file_stem(p): p for p in _images(mask_dir)}
    missing += [f"[{site}] {images[s]}: no mask named {s}.* in {mask_dir}" for s in sorted(images) if s not in masks]
    missing += [f"[{site}] {masks[s]}: no image named {s}.* in {image_dir}" for s in sorted(masks) if s not in images]
    return [(images[s], masks[s]) for s in sorted(images) if s in masks]


def _nvflare_prostate(root: Path) -> dict[str, list[dict]]:
    """NVFlare prostate example: <site>/Image/<case>.nii.gz and <site>/Mask/<case>.nii.gz."""
    sites, missing = {}, []
    for site_dir in _site_dirs(root):
        pairs = _pair_folder(site_dir.name, site_dir / "Image", site_dir / "Mask", missing)
        if pairs:
            sites[site_dir.name] = [{"image": str(i), "label": str(m), "case": file_stem(i)} for i, m in pairs]
    _raise_unpaired(missing)
    return sites


def _published_split(root: Path, pattern: str, sub: tuple[str, str], label_map: dict, slices: bool):
    """Layouts with <site>/{train,test}/<image sub>/ and <mask sub>/; the test folder is kept as testing.

    Case ids carry the part (``train-00``, ``test-g0001``): published parts number cases independently.
    """
    sites, missing = {}, []
    for site_dir in _site_dirs(root, pattern):
        parts = [p for p in ("train", "test") if (site_dir / p).is_dir()]
        if not parts:
            continue
        records = []
        for part in parts:
            pairs = _pair_folder(site_dir.name, site_dir / part / sub[0], site_dir / part / sub[1], missing)
            for image, mask in pairs:
                record = {"image": str(image), "label": str(mask), "label_map": dict(label_map)}
                if slices:
                    match = re.fullmatch(r"(.+)_(\d+)", file_stem(image))
                    case, index = (match.group(1), int(match.group(2))) if match else (file_stem(image), 0)
                    record.update(case=f"{part}-{case}", slice=index)
                else:
                    record["case"] = f"{part}-{file_stem(image)}"
                if part == "test":
                    record["split"] = "testing"
                records.append(record)
        if records:
            sites[site_dir.name] = records
    _raise_unpaired(missing)
    return sites


def _generic(root: Path) -> dict[str, list[dict]]:
    """Generic: <site>/images/ and <site>/masks/ paired by file stem."""
    sites, missing = {}, []
    for site_dir in _site_dirs(root):
        if not (site_dir / "images").is_dir() and not (site_dir / "masks").is_dir():  # not a site
            continue
        pairs = _pair_folder(site_dir.name, site_dir / "images", site_dir / "masks", missing)
        if pairs:
            sites[site_dir.name] = [{"image": str(i), "label": str(m), "case": file_stem(i)} for i, m in pairs]
    _raise_unpaired(missing)
    return sites


def _generic_meta(sites: dict[str, list[dict]], classes: list[str] | None) -> dict:
    """Infers label encoding, classes and input channels of a generic dataset from its files.

    Masks with values in {0, 255} get label_map {"0": 0, "255": 1}; {0, 1} masks are used as is;
    other integer masks are labelled 0..C (exclusive encoding).
    """
    values: set[int] = set()
    for records in sites.values():
        for r in records:
            try:
                mask, _ = read_array(r["label"], mask=True)
            except Exception as err:  # noqa: BLE001 - any reader failure is a data problem
                raise DataError(f"{r['label']}: cannot read mask ({err}). Fix: re-export the mask") from err
            plane = mask_plane(mask, is_nifti(r["label"]))
            if not np.all(np.equal(np.mod(plane, 1), 0)):
                raise DataError(f"{r['label']}: mask has non-integer values. Fix: save masks as integer labels 0..C")
            values |= {int(v) for v in np.unique(plane)}
    first = next(iter(sites.values()))[0]["image"]
    try:
        image, _ = read_array(first)
    except Exception as err:  # noqa: BLE001
        raise DataError(f"{first}: cannot read image ({err}). Fix: re-export the image") from err
    meta = {"task": "segmentation", "in_channels": n_channels(image, is_nifti(first)), "label_encoding": "nested"}
    if values <= {0, 255} and 255 in values:
        for records in sites.values():
            for r in records:
                r["label_map"] = dict(_BINARY_255_MAP)
        n_classes = 1
    elif values <= {0, 1}:
        n_classes = 1
    elif min(values) >= 0 and max(values) <= 64:
        n_classes = max(values)
        meta["label_encoding"] = "exclusive"
    else:
        raise DataError(f"masks hold values {sorted(values)[:12]}... which are neither binary (0/1 or 0/255) nor "
                        "class labels 0..C. Fix: save masks losslessly (PNG/NIfTI) with values 0..C")
    if classes is not None:
        if len(classes) < n_classes:
            raise DataError(f"classes={classes} names {len(classes)} class(es) but the masks hold labels up to "
                            f"{n_classes}. Fix: pass one class name per label value 1..{n_classes}")
        n_classes = len(classes)
        if n_classes > 1:
            meta["label_encoding"] = "exclusive"
    meta["classes"] = list(classes) if classes is not None else (
        ["foreground"] if n_classes == 1 else [f"class{k}" for k in range(1, n_classes + 1)])
    return meta
