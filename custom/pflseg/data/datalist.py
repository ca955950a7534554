"""Datalists (MONAI decathlon JSON, one per site), dataset.json and case-level splits.

A data root holds ``dataset.json`` and one folder per site with ``datalist.json``::

    <root>/dataset.json          {"name", "task", "classes", "label_encoding", "in_channels",
                                  "sites", "layout"} and optionally "train_size", "site_profiles"
    <root>/<site>/datalist.json  {"site": name, "training": [...], "validation": [...],
                                  "testing": [...]}

``in_channels`` is the number of image channels the readers give (alpha dropped, palette images
converted), ``classes`` the names of the C output channels, and ``train_size`` (written by
``pflseg data index``) a suggested training height = width in pixels: the largest power of two not
above the median short side of the images, at most 256 (:func:`suggested_train_size`).
``site_profiles`` (written by the synthetic generator's presets) maps a site to what made it:
``{"kind": "inside" | "outside", "outside_kind", "split", label knobs, ...}``
(see :mod:`pflseg.data.synth`).

Each entry is ``{"image": path, "label": path, "case": id}`` with optional ``"label_map"``
(raw mask value -> class index, keys are strings) or ``"label_threshold"`` (raw value > threshold
is class 1), and ``"slice"`` (slice index of a 2D image within its case). Paths are relative to the
site folder or absolute.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from pflseg.data.errors import DataError
from pflseg.data.files import private_dir

DATASET_JSON = "dataset.json"
DATALIST_JSON = "datalist.json"
SPLITS = ("training", "validation", "testing")
ENCODINGS = ("nested", "exclusive")
MAX_TRAIN_SIZE = 256
MIN_TRAIN_SIZE = 4


def suggested_train_size(sides: list[int], cap: int = MAX_TRAIN_SIZE) -> int:
    """The largest power of two <= the median of ``sides``, capped at ``cap``, at least 4.

    Args:
        sides: The short side (pixels) of every image (in-plane for volumes).
        cap: Largest size returned.

    Returns:
        A training height = width in pixels, e.g. 256 for 384x384 slices, 128 for 200x180 images.
    """
    if not sides:
        raise ValueError("sides is empty: need the size of at least one image")
    median = float(np.median(sides))
    size = MIN_TRAIN_SIZE
    while size * 2 <= min(median, cap):
        size *= 2
    return size


def split_cases(
    cases: list[str],
    seed: int,
    site: str,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
) -> dict[str, str]:
    """Assigns every case to exactly one split, deterministically.

    With 3 or more cases (and non-zero fractions) each split gets at least one case.

    Args:
        cases: Case ids (duplicates are ignored, order does not matter).
        seed: Random seed; combined with the site name so sites are shuffled independently.
        site: Site name.
        val_fraction: Fraction of cases for validation.
        test_fraction: Fraction of cases for testing (0 when the test split is given).

    Returns:
        Mapping case id -> "training" | "validation" | "testing".
    """
    if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction={val_fraction}, test_fraction={test_fraction}: need 0 <= each, sum < 1")
    unique = sorted(set(cases))
    rng = np.random.default_rng([seed, zlib.crc32(site.encode())])
    order = [unique[i] for i in rng.permutation(len(unique))]
    n = len(order)
    n_test = _count(n, test_fraction)
    n_val = min(_count(n, val_fraction), max(n - n_test - 1, 0))
    split = {c: "testing" for c in order[:n_test]}
    split.update({c: "validation" for c in order[n_test : n_test + n_val]})
    split.update({c: "training" for c in order[n_test + n_val :]})
    return split


def _count(n: int, fraction: float) -> int:
    """Rounded share of ``n``; at least 1 when the fraction is positive and n >= 3."""
    if fraction <= 0 or n == 0:
        return 0
    k = int(round(n * fraction))
    return max(k, 1) if n >= 3 else k


def write_datalist(site_dir: str | Path, site: str, entries: dict[str, list[dict]]) -> Path:
    """Writes ``<site_dir>/datalist.json`` with the three split lists (sorted by case, slice)."""
    site_dir = Path(site_dir)
    private_dir(site_dir)
    body = {"site": site}
    for split in SPLITS:
        body[split] = sorted(entries.get(split, []), key=lambda e: (e["case"], e.get("slice", 0), e["image"]))
    path = site_dir / DATALIST_JSON
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def write_dataset_json(
    root: str | Path,
    *,
    name: str,
    task: str,
    classes: list[str],
    label_encoding: str,
    in_channels: int,
    sites: list[str],
    layout: str,
    train_size: int | None = None,
    site_profiles: dict | None = None,
) -> Path:
    """Writes ``<root>/dataset.json`` (see the module docstring; train_size, site_profiles only when given)."""
    if label_encoding not in ENCODINGS:
        raise ValueError(f"label_encoding={label_encoding!r}: expected one of {ENCODINGS}")
    root = Path(root)
    private_dir(root)
    body = {
        "name": name,
        "task": task,
        "classes": list(classes),
        "label_encoding": label_encoding,
        "in_channels": int(in_channels),
        "sites": list(sites),
        "layout": layout,
    }
    if train_size is not None:
        body["train_size"] = int(train_size)
    if site_profiles is not None:
        body["site_profiles"] = site_profiles
    path = root / DATASET_JSON
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def claim_out(out: str | Path, *, name: str, layout: str, writes: list[str]) -> None:
    """Refuses to write a data root over another one (``pflseg data synth`` / ``data index``).

    ``out`` may be missing or empty, an earlier data root of the same kind (its dataset.json has this ``name``
    (the indexed folder's name, ``synthetic-<task>``) and ``layout``: it is rewritten), or, without a
    dataset.json, hold only the site folders about to be written (``writes``; an interrupted earlier write).

    Raises:
        DataError: ``out`` is a file, holds another data root, or holds other files (naming them and the fix).
    """
    out = Path(out)
    fix = "pass another --out (a new or empty folder), or move the folder away yourself"
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: is a file, not a folder. Fix: {fix}")
    if not out.is_dir():
        return
    info_path = out / DATASET_JSON
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            info = None
        if not isinstance(info, dict):
            raise DataError(f"{info_path}: not a data root's dataset.json; not overwritten. Fix: {fix}")
        if info.get("name") != name or info.get("layout") != layout:
            raise DataError(f"{out}: holds another data root (name {info.get('name')!r}, layout "
                            f"{info.get('layout')!r}); "
                            f"writing name {name!r}, layout {layout!r} there would overwrite it. Fix: {fix}")
        return
    others = sorted(p.name for p in out.iterdir() if not (p.is_dir() and p.name in writes))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise DataError(f"{out}: not empty and not a data root (no dataset.json; holds {shown}); not overwritten. "
                        f"Fix: {fix}")


def read_datalist(root: str | Path, site: str) -> dict:
    """Reads ``<root>/<site>/datalist.json``.

    Raises:
        DataError: The file is missing or not valid JSON with the three split lists.
    """
    path = Path(root) / site / DATALIST_JSON
    if not path.is_file():
        raise DataError(
            f"[{site}] {path}: datalist not found. Fix: run `pflseg data index` (or `pflseg data synth`) "
            f"for this root, or remove {site!r} from dataset.json"
        )
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"[{site}] {path}: not valid JSON ({err}). Fix: regenerate the datalist") from err
    if not isinstance(body, dict) or not all(isinstance(body.get(s, []), list) for s in SPLITS):
        raise DataError(
            f"[{site}] {path}: expected an object with lists {SPLITS}. Fix: regenerate the datalist"
        )
    return body


def resolve(site_dir: str | Path, path: str) -> Path:
    """Resolves a datalist path: absolute paths stay, relative ones are under the site folder."""
    p = Path(path)
    return p if p.is_absolute() else Path(site_dir) / p


_INFO_TYPES = {"name": str, "task": str, "classes": list, "label_encoding": str, "in_channels": int,
               "sites": list, "layout": str}
_OPTIONAL_INFO_TYPES = {"train_size": int, "site_profiles": dict}


def _problem(path: Path, what: str, fix: str, code: str = "dataset_json_invalid"):
    from pflseg.data.errors import Problem

    return Problem("", str(path), what, fix, code)


#: sub-folders that mark a site folder of a layout ``pflseg data index`` reads (generic, nvflare_prostate, the
#: published splits)
RAW_MARKERS = ("images", "masks", "train", "test", "Image", "Mask")


def raw_sites(root: Path, limit: int = 200) -> list[str]:
    """The folders of ``root`` that look like the site folders of un-indexed data: holding ``RAW_MARKERS`` folders
    or image files (the first ``limit`` entries of each are looked at); none when a folder holds a datalist.json
    (an indexed root that lost its dataset.json)."""
    from pflseg.data.files import is_image_file

    found = []
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []
    for folder in folders[:limit]:
        try:
            entries = [p for _, p in zip(range(limit), folder.iterdir())]
        except OSError:
            continue
        if any(p.name == DATALIST_JSON for p in entries):  # an indexed site: the root lost its dataset.json
            return []
        if any(p.is_dir() and p.name in RAW_MARKERS or p.is_file() and is_image_file(p) for p in entries):
            found.append(folder.name)
    return found


def missing_root(root: Path):
    """The problem of a data root without dataset.json, in the user's terms: no such folder, a file, a raw folder
    of images not indexed yet (``raw_sites``: "run `pflseg data index` first"), or a folder that is no data root."""
    from pflseg.data.errors import Problem

    make = "`pflseg data index` (your images and masks) or `pflseg data synth` (synthetic data)"
    if not root.exists():
        return Problem("", str(root), "data root not found (no such folder)",
                       f"pass the folder that {make} wrote (it holds dataset.json)", "dataset_json_missing")
    if not root.is_dir():
        return Problem("", str(root), "is a file, not a data root folder",
                       f"pass the folder that {make} wrote (it holds dataset.json)", "dataset_json_missing")
    raw = raw_sites(root)
    if raw:
        shown = ", ".join(raw[:5]) + (f" and {len(raw) - 5} more" if len(raw) > 5 else "")
        return Problem("", str(root), f"raw data, not indexed yet (no dataset.json; site folders {shown})",
                       f"run `pflseg data index --layout generic --root {root} --out {root}-index` first (layouts: "
                       f"`pflseg data index --help`), then pass {root}-index", "not_indexed")
    return Problem("", str(root / DATASET_JSON), "dataset.json not found: not a data root",
                   f"make one with {make}, or check that the path is right", "dataset_json_missing")


def read_dataset_info(root: str | Path) -> tuple[dict | None, list]:
    """Reads and validates ``<root>/dataset.json``.

    Returns:
        ``(info, problems)``: info is None when the file is missing or invalid, and problems is a
        list of :class:`~pflseg.data.errors.Problem` saying why.
    """
    path = Path(root) / DATASET_JSON
    fix = ("make it again with `pflseg data index` (your images and masks) or `pflseg data synth` (synthetic), or "
           "write it by hand (see pflseg.data.datalist)")
    if not path.is_file():
        return None, [missing_root(Path(root))]
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, [_problem(path, f"not valid JSON ({err})", fix)]
    if not isinstance(info, dict):
        return None, [_problem(path, "expected a JSON object", fix)]
    problems = []
    for key, kind in _INFO_TYPES.items():
        if key not in info:
            problems.append(_problem(path, f"missing key {key!r}", fix))
        elif not isinstance(info[key], kind) or (kind is int and isinstance(info[key], bool)):
            problems.append(_problem(path, f"{key!r} must be a {kind.__name__}, got {info[key]!r}", fix))
    if not problems:
        if info["label_encoding"] not in ENCODINGS:
            problems.append(_problem(path, f"label_encoding {info['label_encoding']!r} is not one of {ENCODINGS}", fix))
        if not info["classes"] or not all(isinstance(c, str) for c in info["classes"]):
            problems.append(_problem(path, f"classes must be a non-empty list of names, got {info['classes']!r}", fix))
        if not info["sites"] or not all(isinstance(s, str) and s for s in info["sites"]):
            problems.append(_problem(path, f"sites must be a non-empty list of names, got {info['sites']!r}", fix))
        if info["in_channels"] < 1:
            problems.append(_problem(path, f"in_channels must be >= 1, got {info['in_channels']}", fix))
    value = info.get("train_size", MIN_TRAIN_SIZE)
    if not isinstance(value, int) or isinstance(value, bool) or value < MIN_TRAIN_SIZE:
        problems.append(_problem(path, f"'train_size' must be an integer >= {MIN_TRAIN_SIZE}, got {value!r}",
                                fix))
    profiles = info.get("site_profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        problems.append(_problem(path, f"'site_profiles' must map site names to objects, got {profiles!r:.80}",
                                fix))
    known = list(_INFO_TYPES) + list(_OPTIONAL_INFO_TYPES)
    unknown = sorted(set(info) - set(known))
    if unknown:
        problems.append(_problem(path, f"unknown key(s) {unknown}", f"remove them; known keys are {known}"))
    return (None if problems else info), problems
