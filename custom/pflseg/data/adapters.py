"""Dataset adapters: index data where it lies into per-site datalists (nothing is copied).

:func:`index_dataset` reads one of the :data:`LAYOUTS`, pairs every image with its mask, assigns
cases to training / validation / testing (keeping a published train/test split where the layout
has one) and writes ``<out>/dataset.json`` plus ``<out>/<site>/datalist.json`` whose entries point to
the original files by absolute path. :func:`index_report` does the same and returns what it found
per site (what ``pflseg data index`` prints).

The ``generic`` layout takes any site folder names (they become the site names) holding either
``images/`` + ``masks/`` or ``train/`` and/or ``test/`` with ``images/`` + ``masks/`` each (the
published test part stays the test split; validation is carved from train by case; cases are named
``train/<stem>`` and ``test/<stem>`` so equal names in the two parts never collide). How the masks
encode classes is decided per site from their values (:mod:`pflseg.data.masks`): two-valued
``{0, v}`` masks are binary, ``mask_threshold`` binarises lossy masks, ``classes`` names labelled
masks. Images may be gray, RGB, RGBA (alpha dropped), 16-bit or palette (converted); their channel
count is dataset.json's ``in_channels``. A generic site folder with ``images/`` and no ``masks/`` is an
outside site without masks (what test-time routing and Tent adapt on): all its images are testing entries
without a label.

Every image and mask is read whole at indexing time: a truncated or corrupt file, a 4D NIfTI, NaN / Inf
values, and a training site whose validation or test split comes out empty are refused naming the file
(or the site) and the fix. ``out`` is never written over another data root (``datalist.claim_out``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pflseg.data.check import empty_split
from pflseg.data.datalist import claim_out, split_cases, suggested_train_size, write_datalist, write_dataset_json
from pflseg.data.errors import DataError, Problem, problems_error, shape_mismatch, unreadable
from pflseg.data.files import file_stem, image_header, is_image_file, is_nifti, read_array
from pflseg.data.masks import MaskValues, SiteEncoding, site_encoding
from pflseg.data.summary import FileScan, IndexReport, scan_record, short_side, summarize_site

LAYOUTS: dict[str, str] = {
    "saml": "<root>/<Site>/CaseNN.nii.gz + CaseNN_segmentation.nii.gz (or _Segmentation); prostate volumes",
    "nvflare_prostate": "<root>/<site>/Image/<case>.nii.gz + <root>/<site>/Mask/<case>.nii.gz",
    "prostate_slices": "<root>/<site>/{train,test}/{image,mask}/NN_MM.png; case NN, slice MM; mask 0 = prostate",
    "fundus": "<root>/Domain<k>/{train,test}/ROIs/{image,mask}/*.png; RGB; mask 0 cup, 128 rim, 255 background",
    "generic": "<root>/<site>/{images,masks}/ or <root>/<site>/{train,test}/{images,masks}/, matched by file "
               "stem; PNG, JPEG or NIfTI; binary {0, v} masks, --mask-threshold for lossy masks, "
               "--classes for labelled masks",
}

# The published ProstateSlice masks draw the gland as 0 on a 255 background (checked on the shared
# fixtures: value 0 covers 0.6-3.5 % of each slice, the gland region), so 0 maps to prostate.
_PROSTATE_SLICE_MAP = {"0": 1, "255": 0}
_FUNDUS_MAP = {"0": 2, "128": 1, "255": 0}
_GENERIC_PARTS = ("train", "test")


def index_dataset(layout: str, root: str | Path, out: str | Path, *args, **kwargs) -> Path:
    """Indexes a dataset in place and writes its data root (dataset.json + datalists); the arguments are
    :func:`index_report`'s. Returns the data root ``out``."""
    return index_report(layout, root, out, *args, **kwargs).out


def index_report(
    layout: str,
    root: str | Path,
    out: str | Path,
    seed: int = 0,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    classes: list[str] | None = None,
    mask_threshold: float | None = None,
) -> IndexReport:
    """Indexes a dataset in place, writes its data root and reports what it found per site.

    Args:
        layout: One of :data:`LAYOUTS`.
        root: Folder holding the original data.
        out: Data root to write (may equal ``root``).
        seed: Seed of the case-level split.
        val_fraction: Fraction of cases for validation (carved from the training cases).
        test_fraction: Fraction of cases for testing; ignored where a site has a published test split.
        classes: Class names (``generic`` only). None: binary masks, class "foreground". Needed for
            masks with more than two values, which are labels 0..C.
        mask_threshold: ``generic`` only: mask value > threshold is foreground (lossy, e.g. JPEG, masks).

    Returns:
        An :class:`~pflseg.data.summary.IndexReport` (``.out`` is the data root written).

    Raises:
        DataError: Unknown layout, missing folder, no sites found, an image without its mask (or
            a mask without its image), unreadable files, image/mask size mismatches, images with
            different channel counts, or masks whose encoding is ambiguous (each names the file,
            the values seen and the option to use).
    """
    _check_options(layout, classes, mask_threshold)
    root = Path(os.path.abspath(root))
    if not root.is_dir():
        raise DataError(f"{root}: data folder not found. Fix: pass the folder that holds the site folders")
    out = Path(out)
    meta = {"name": root.name, "task": "prostate", "classes": ["prostate"], "label_encoding": "nested",
            "in_channels": 1}
    ignored: list[str] = []
    problems: list[Problem] = []  # every problem, found in one pass, raised together
    missing: list[str] = []  # unpaired files (generic)
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
        sites = _generic(root, Path(os.path.abspath(out)), ignored, problems, missing)
    if not sites and not problems and not missing:
        raise DataError(f"{root}: no sites found for layout {layout!r} ({LAYOUTS[layout]}). "
                        "Fix: point --root at the folder holding the site folders, or pick the matching layout")
    scans, unreadable_files = _scan(sites)
    problems += unreadable_files + _shape_problems(sites, scans)
    notes: dict[str, list[str]] = {site: [] for site in sites}
    if layout == "generic":
        problems += _mask_problems(sites, scans, classes, mask_threshold, notes)
    if problems or missing:
        raise _all_problems(problems, missing, root)
    if layout == "generic":
        meta.update(_generic_meta(sites, scans, classes))
    splits = {site: _assign_splits(site, records, seed, val_fraction, test_fraction) for site, records in sites.items()}
    _note_empty_splits(sites, splits, root, notes)
    claim_out(out, name=meta["name"], layout=layout, writes=list(sites))
    summaries = []
    for site, records in sites.items():
        entries = splits[site]
        write_datalist(out / site, site, entries)
        summary = summarize_site(site, entries, scans, meta["classes"], meta["label_encoding"])
        summary.notes[:0] = notes[site]
        summaries.append(summary)
    train_size = suggested_train_size([short_side(scan.image_shape) for scan in scans.values()])
    write_dataset_json(out, sites=list(sites), layout=layout, train_size=train_size, **meta)
    info = dict(meta, sites=list(sites), layout=layout, train_size=train_size)
    return IndexReport(root=root, out=out, layout=layout, info=info, sites=summaries, ignored=ignored)


def _check_options(layout: str, classes: list[str] | None, mask_threshold: float | None) -> None:
    """Refuses an unknown layout and class / threshold options that the layout or each other rule out."""
    if layout not in LAYOUTS:
        raise DataError(f"unknown layout {layout!r}. Fix: use one of {', '.join(LAYOUTS)}")
    if layout != "generic" and (classes is not None or mask_threshold is not None):
        raise DataError(f"--classes and --mask-threshold apply to --layout generic; layout {layout!r} "
                        "knows its masks. Fix: drop them, or use --layout generic")
    if classes is not None and (not classes or not all(isinstance(c, str) and c.strip() for c in classes)):
        raise DataError(f"classes={classes!r}: need one non-empty name per class. Fix: e.g. --classes disc,cup")
    if mask_threshold is not None and classes is not None and len(classes) > 1:
        raise DataError(f"--mask-threshold makes every mask binary (one class), but --classes names {len(classes)} "
                        f"classes ({','.join(classes)}). Fix: pass one class name, or drop --mask-threshold for "
                        "labelled masks")


def _note_empty_splits(sites: dict[str, list[dict]], splits: dict[str, dict[str, list[dict]]], root: Path,
                       notes: dict[str, list[str]]) -> None:
    """Adds a warning note to each training site whose validation or testing split is empty (an outside site
    needs only its images)."""
    for site, entries in splits.items():
        if any("label" in r for r in sites[site]):
            cases = len({r["case"] for r in sites[site]})
            notes[site] += [f"warning: {_rule(empty_split(site, root / site, split, cases))}"  # data check's words
                            for split in ("validation", "testing") if not entries.get(split)]


def _rule(problem: Problem) -> str:
    """A problem's words without its file: ``"<problem>. Fix: <fix>"``."""
    return f"{problem.problem}. Fix: {problem.fix}"


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


def _unpaired_text(missing: list[str]) -> str:
    lines = "\n".join(f"  - {m}" for m in missing)
    return (f"{len(missing)} unpaired file(s):\n{lines}\n"
            "Fix: add the missing files or move the unpaired ones out of the data folder")


def _raise_unpaired(missing: list[str]) -> None:
    """Raises one DataError for all images without masks / masks without images."""
    if missing:
        raise DataError(_unpaired_text(missing))


def _all_problems(problems: list[Problem], missing: list[str], root: Path) -> DataError:
    """One DataError for every problem and every unpaired file found (each part as it reads alone)."""
    if not problems:
        return DataError(_unpaired_text(missing))
    error = problems_error(problems, root)
    return DataError(f"{error}\n{_unpaired_text(missing)}", problems) if missing else error


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
    images, masks = _by_stem(site, image_dir), _by_stem(site, mask_dir)
    missing += [f"[{site}] {images[s]}: no mask named {s}.* in {mask_dir}" for s in sorted(images) if s not in masks]
    missing += [f"[{site}] {masks[s]}: no image named {s}.* in {image_dir}" for s in sorted(masks) if s not in images]
    return [(images[s], masks[s]) for s in sorted(images) if s in masks]


def _by_stem(site: str, folder: Path) -> dict[str, Path]:
    """A folder's image files by file stem.

    Raises:
        DataError: Two files share a stem (``a.png`` and ``a.jpg``): which one pairs is unclear.
    """
    files: dict[str, Path] = {}
    same = []
    for path in _images(folder):
        stem = file_stem(path)
        if stem in files:
            same.append(f"  - [{site}] {path}: same name as {files[stem].name}")
        else:
            files[stem] = path
    if same:
        lines = "\n".join(same)
        raise DataError(f"{len(same)} file(s) with the name of another file in {folder}:\n{lines}\n"
                        "Fix: keep one file per name (move the others out of the data folder)")
    return files


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


def _generic(root: Path, out: Path, ignored: list[str], problems: list[Problem],
             missing: list[str]) -> dict[str, list[dict]]:
    """Generic: <site>/{images,masks}/ or <site>/{train,test}/{images,masks}/, paired by file stem.

    Folders that hold none of images/, masks/, train/, test/ are not sites, and files and folders a site does not
    read (``_strays``: a sub-folder of images/, a text file, a stray folder) are not indexed: each is listed in
    ``ignored`` with the reason (the output folder, when it lies inside ``root``, is passed over). Layout problems
    go to ``problems``, unpaired files to ``missing`` (the caller reports them with the files' own problems).
    """
    sites = {}
    ignored += _strays(root, {p.name for p in _site_dirs(root)}, "a file beside the site folders, not read")
    for site_dir in _site_dirs(root):
        site = site_dir.name
        if site_dir == out:
            continue
        flat = [name for name in ("images", "masks") if (site_dir / name).is_dir()]
        parts = [part for part in _GENERIC_PARTS if (site_dir / part).is_dir()]
        if flat or parts:
            ignored += _site_strays(site_dir, flat, parts)
        if flat and parts:
            problems.append(Problem(site, str(site_dir), f"holds both {'/, '.join(flat)}/ and {'/, '.join(parts)}/",
                                    "keep either <site>/images + <site>/masks, or <site>/train and <site>/test "
                                    "each with images + masks"))
            continue
        if not flat and not parts:
            ignored.append(f"{site_dir}: not a site folder (no images/, masks/, train/ or test/ inside)")
            continue
        n_missing = len(missing)
        images_only = flat == ["images"]  # an outside site without masks, every image a testing entry
        records = (_unlabelled_records(site, site_dir / "images") if images_only
                   else _paired_records(site, site_dir, parts, missing))
        if records:
            sites[site] = records
        elif images_only:
            problems.append(Problem(site, str(site_dir / "images"), "no image files",
                                    "add the site's images (PNG, JPEG or NIfTI), or remove the site folder"))
        elif len(missing) == n_missing:  # no files at all (unpaired ones are reported below)
            problems.append(Problem(site, str(site_dir), "no image files in its images/ and masks/ folders",
                                    "add the site's images and masks (PNG, JPEG or NIfTI), or remove the site folder"))
    return sites


def _site_strays(site_dir: Path, flat: list[str], parts: list[str]) -> list[str]:
    """What a generic site folder holds besides its images/ + masks/ (``flat``) or train/ + test/ (``parts``)
    folders, as ``_strays`` lists it, the site folder's own entries first."""
    holds = "images/ and masks/" if flat else "train/ and test/"
    ignored = _strays(site_dir, set(flat or parts), f"not read (a site folder holds {holds} only)")
    for base in [site_dir / part for part in parts] or [site_dir]:
        folders = [base / n for n in ("images", "masks") if (base / n).is_dir()]
        if parts:
            ignored += _strays(base, {f.name for f in folders}, f"not read ({base.name}/ holds images/ "
                                                                 "and masks/ only)")
        for folder in folders:
            ignored += _strays(folder, set(), "", images=True)
    return ignored


def _unlabelled_records(site: str, image_dir: Path) -> list[dict]:
    """An outside site's records: every image of ``image_dir`` a testing entry without a label, by file stem."""
    return [{"image": str(image), "case": case, "split": "testing"}
            for case, image in sorted(_by_stem(site, image_dir).items())]


def _paired_records(site: str, site_dir: Path, parts: list[str], missing: list[str]) -> list[dict]:
    """A generic site's image + mask records from <site>/ or each of its train/ and test/ parts (cases named
    ``<part>/<stem>``, the test part kept as testing); unpaired files go to ``missing``."""
    records = []
    for part in parts or [None]:
        base = site_dir / part if part else site_dir
        for image, mask in _pair_folder(site, base / "images", base / "masks", missing):
            record = {"image": str(image), "label": str(mask),
                      "case": f"{part}/{file_stem(image)}" if part else file_stem(image)}
            if part == "test":
                record["split"] = "testing"
            records.append(record)
    return records


#: files of pflseg's own in a data folder indexed in place (``--out`` = ``--root``): not strays
_OWN_FILES = ("dataset.json", "datalist.json")


def _strays(folder: Path, keep: set[str], why: str, images: bool = False) -> list[str]:
    """What indexing passes over in ``folder``, one ``"<path>: <why>"`` each: every visible entry not named in
    ``keep``; in an images/ or masks/ folder (``images``) its sub-folders and the files that are no image. Hidden
    entries (``.DS_Store``, ``.git``) and pflseg's own files (``_OWN_FILES``) are not listed."""
    out = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name in keep or entry.name in _OWN_FILES:
            continue
        if images:
            if entry.is_dir():
                out.append(f"{entry}: a sub-folder of {folder.name}/ (only files directly in {folder.name}/ are read)")
            elif not is_image_file(entry):
                out.append(f"{entry}: not an image file (PNG, JPEG or NIfTI)")
        elif entry.is_file() or not entry.name.startswith("_"):
            out.append(f"{entry}: {why}")
    return out


def _scan(sites: dict[str, list[dict]]) -> tuple[dict[str, FileScan], list[Problem]]:
    """Reads every record's image header and mask: image path -> scan, and the unreadable files."""
    scans, problems = {}, []
    for site, records in sites.items():
        for r in records:
            scan, unreadable_files = scan_record(site, r) if "label" in r else _scan_image_only(site, r)
            if scan is not None:
                try:  # the whole image: a truncated file, NaN / Inf values (the header alone does not tell)
                    read_array(r["image"])
                except Exception as err:  # noqa: BLE001 - any reader failure is a data problem
                    unreadable_files.append(unreadable(site, r["image"], err))
                    scan = None
            problems += unreadable_files
            if scan is not None:
                scans[r["image"]] = scan
    return scans, problems


def _scan_image_only(site: str, record: dict) -> tuple[FileScan | None, list[Problem]]:
    """The scan of an image without a mask (an outside site's): its header, no mask values."""
    try:
        shape, channels, mode = image_header(record["image"])
    except Exception as err:  # noqa: BLE001
        return None, [unreadable(site, record["image"], err)]
    return FileScan(image_shape=tuple(shape), channels=channels, mode=mode, mask=MaskValues("", (), False, False),
                    counts=(), mask_shape=tuple(shape)), []


def _shape_problems(sites: dict[str, list[dict]], scans: dict[str, FileScan]) -> list[Problem]:
    """Every image whose mask has another spatial shape."""
    return [
        shape_mismatch(site, r["image"], r["label"], scans[r["image"]].image_shape, scans[r["image"]].mask_shape)
        for site, records in sites.items() for r in records
        if "label" in r and r["image"] in scans and scans[r["image"]].image_shape != scans[r["image"]].mask_shape
    ]


def _mask_problems(
    sites: dict[str, list[dict]],
    scans: dict[str, FileScan],
    classes: list[str] | None,
    mask_threshold: float | None,
    notes: dict[str, list[str]],
) -> list[Problem]:
    """Decides each site's mask encoding and writes it into its records (and its note).

    Returns:
        One problem per site whose masks are ambiguous (that site's records are left unchanged).
    """
    problems = []
    for site, records in sites.items():
        if not any("label" in r for r in records):  # an outside site without masks
            notes[site].append("no masks: an outside site (images only, all testing)")
            continue
        read = [scans[r["image"]].mask for r in records if r["image"] in scans]  # unreadable ones are reported
        if not read:
            continue
        decision = site_encoding(site, read, classes, mask_threshold)
        if isinstance(decision, Problem):
            problems.append(decision)
            continue
        for r in records:
            _apply(r, decision)
        notes[site].append(decision.note)
    return problems


def _generic_meta(sites: dict[str, list[dict]], scans: dict[str, FileScan], classes: list[str] | None) -> dict:
    """dataset.json fields of a generic data set: task, in_channels, classes, label_encoding.

    Raises:
        DataError: The images have different channel counts (naming one image of each kind).
    """
    by_channels: dict[int, list[tuple[str, str]]] = {}
    for site, records in sites.items():
        for r in records:
            by_channels.setdefault(scans[r["image"]].channels, []).append((site, r["image"]))
    if len(by_channels) > 1:
        kinds = "; ".join(f"{c} channel(s): {len(files)} image(s), e.g. [{files[0][0]}] {files[0][1]}"
                          for c, files in sorted(by_channels.items()))
        raise DataError(f"images have different channel counts ({kinds}). Fix: convert the images to one kind "
                        "(all grayscale or all RGB) before indexing")
    return {
        "task": "segmentation",
        "in_channels": next(iter(by_channels)),
        "classes": list(classes) if classes else ["foreground"],
        "label_encoding": "nested" if not classes or len(classes) == 1 else "exclusive",
    }


def _apply(record: dict, decision: SiteEncoding) -> None:
    """Writes a site's mask encoding into one of its records."""
    if decision.label_map is not None:
        record["label_map"] = dict(decision.label_map)
    if decision.threshold is not None:
        record["label_threshold"] = decision.threshold
