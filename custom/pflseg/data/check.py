"""Dataset checker: every problem of a data root, found at once, each with its file, site and fix.

:func:`check_dataset` reads dataset.json, every site's datalist and every image and mask once, and
reports unreadable, truncated or corrupt files, 4D images, NaN / Inf values, image/mask shape and
spacing mismatches, missing files, empty sites, empty validation or test splits, cases in more than
one split, wrong channel counts and label values outside the expected set. :func:`require_valid`
raises one :class:`DataError` listing all of them.

A site whose datalist holds only testing entries without masks is an outside site (images only: what
test-time routing and Tent adapt on); it is valid without training, validation or masks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pflseg.data.datalist import DATALIST_JSON, SPLITS, read_datalist, read_dataset_info, resolve
from pflseg.data.errors import (
    DataError,
    Problem,
    problems_error,
    shape_mismatch,
    spacing_mismatch,
    unreadable,
)
from pflseg.data.files import is_nifti, mask_plane, n_channels, read_array, spatial_shape
from pflseg.data.labels import label_problem
from pflseg.progress import Progress

SPACING_RTOL = 1e-3
#: problems ``pflseg data check`` reports but a site's ``require_valid`` lets pass: an empty validation or test
#: split does not stop an outside site (routing, Tent adapt on every image); a job that needs the split refuses
#: it by name at the site (``pflseg.flare.sites.base.Site.data``)
NOT_REFUSED = ("empty_split",)


def check_dataset(root: str | Path, sites: list[str] | None = None, say=None) -> list[Problem]:
    """Finds every problem in a data root.

    Args:
        root: Data root (dataset.json + one folder per site).
        sites: Check only these sites (a site checks its own data: another site's bad file is not its
            problem); None: every site of dataset.json.
        say: Where progress lines go every 10 s while the files are read (``pflseg.progress``; default the
            ``pflseg.progress`` logger).

    Returns:
        The problems found, in site order; empty when the dataset is usable.
    """
    root = Path(root)
    info, problems = read_dataset_info(root)
    if info is None:
        return problems
    n_classes = len(info["classes"])
    chosen = [site for site in info["sites"] if sites is None or site in sites]
    progress = Progress(f"checking {root}", total=sum(_n_entries(root, site) for site in chosen), unit="images",
                        say=say)
    for site in chosen:
        problems += _check_site(root, site, n_classes, info["in_channels"], progress)
    progress.done()
    return problems


def _n_entries(root: Path, site: str) -> int:
    """Datalist entries of a site (0 when its datalist cannot be read: ``_check_site`` says why)."""
    try:
        datalist = read_datalist(root, site)
    except DataError:
        return 0
    return sum(len(datalist.get(split) or []) for split in SPLITS)


def require_valid(root: str | Path, sites: list[str] | None = None) -> dict:
    """Checks a data root (or only ``sites`` of it) and raises when anything is wrong.

    Returns:
        The validated dataset.json contents.

    Raises:
        DataError: Listing all problems at once, one per line.
    """
    problems = [p for p in check_dataset(root, sites) if p.code not in NOT_REFUSED]
    if problems:
        raise problems_error(problems, root)
    return read_dataset_info(root)[0]


def _check_site(root: Path, site: str, n_classes: int, in_channels: int, progress: Progress) -> list[Problem]:
    """Problems of one site: folder, datalist, entries and files."""
    site_dir = root / site
    if not site_dir.is_dir():
        return [Problem(site, str(site_dir), "site listed in dataset.json has no folder",
                        "restore the site folder or remove the site from dataset.json", "site_folder_missing")]
    if not (site_dir / DATALIST_JSON).is_file():
        return [Problem(site, str(site_dir / DATALIST_JSON), "empty site: no datalist.json",
                        "index the site's data (pflseg data index) or remove the site from dataset.json",
                        "datalist_missing")]
    try:
        datalist = read_datalist(root, site)
    except DataError as err:
        return [Problem(site, str(site_dir / DATALIST_JSON), str(err).split(": ", 1)[-1].split(". Fix")[0],
                        "regenerate the datalist", "datalist_invalid")]
    problems = []
    if is_unlabeled_outside(datalist):
        pass  # images only, all testing: an outside site for routing / Tent
    elif not datalist.get("training"):
        problems.append(Problem(site, str(site_dir / DATALIST_JSON), "empty site: no training entries",
                                "add training cases for this site or remove it from dataset.json",
                                "empty_site"))
    else:
        for split in ("validation", "testing"):
            if not datalist.get(split):
                problems.append(empty_split(site, site_dir / DATALIST_JSON, split,
                                            len({str(e.get("case")) for s in SPLITS for e in datalist.get(s, [])
                                                 if isinstance(e, dict)})))
    case_split: dict[str, str] = {}
    for split in SPLITS:
        for k, entry in enumerate(datalist.get(split, [])):
            problems += _check_entry(site, site_dir, split, k, entry, n_classes, in_channels)
            progress.step()
            case = str(entry.get("case", "")) if isinstance(entry, dict) else ""
            if case and case_split.setdefault(case, split) != split:
                problems.append(Problem(site, str(site_dir / DATALIST_JSON),
                                        f"case {case!r} is in both {case_split[case]} and {split}",
                                        "split by case: keep every slice of a case in one split",
                                        "case_in_two_splits", case))
    return problems


def is_unlabeled_outside(datalist: dict) -> bool:
    """True for an outside site without masks: testing entries only, none with a ``label``."""
    testing = datalist.get("testing") or []
    return (not datalist.get("training") and not datalist.get("validation") and bool(testing)
            and all(isinstance(e, dict) and "label" not in e for e in testing))


def empty_split(site: str, datalist: str | Path, split: str, n_cases: int) -> Problem:
    """A training site whose validation or test split has no case (best-model choice or the final test would
    have nothing to score)."""
    why = {"validation": "the site cannot pick its best model", "testing": "the site cannot be tested"}.get(split, "")
    return Problem(site, str(datalist), f"the {split} split is empty ({n_cases} case(s) in all)" + (f": {why}" if why
                                                                                                  else ""),
                   "give the site at least 3 cases (training, validation and test each get one), or a published "
                   "test part and 2 training cases; a site that only adapts (outside site) may stay as it is",
                   "empty_split")


def empty_split_error(root: str | Path, site: str, split: str) -> DataError:
    """``empty_split`` as the error a site raises when a job needs the empty ``split`` of its data (the words of
    ``pflseg data check``, ``data index`` and ``pflseg run``)."""
    path = Path(root) / site / DATALIST_JSON
    try:
        datalist = read_datalist(root, site)
        cases = len({str(e.get("case")) for s in SPLITS for e in datalist.get(s, []) if isinstance(e, dict)})
    except DataError:
        cases = 0
    return empty_split(site, path, split, cases).error()


def _check_entry(site, site_dir, split, k, entry, n_classes, in_channels) -> list[Problem]:
    """Problems of one datalist entry: keys, files, readability, shapes, spacing, labels."""
    where = str(site_dir / DATALIST_JSON)
    if not isinstance(entry, dict) or "image" not in entry or "case" not in entry:
        return [Problem(site, where, f"{split}[{k}] needs 'image' and 'case' keys, got {entry!r}",
                        "regenerate the datalist", "datalist_entry_invalid",
                        str(entry.get("case", "")) if isinstance(entry, dict) else "")]
    image_path = resolve(site_dir, entry["image"])
    if not image_path.is_file():
        return [Problem(site, str(image_path), f"image listed in {split} does not exist",
                        "restore the file or regenerate the datalist", "image_missing")]
    problems = []
    try:
        image, image_spacing = read_array(image_path)
    except Exception as err:  # noqa: BLE001 - any reader failure is a data problem
        problems.append(unreadable(site, image_path, err))
        image = None
    if image is not None and n_channels(image, is_nifti(image_path)) != in_channels:
        problems.append(Problem(site, str(image_path),
                                f"image has {n_channels(image, is_nifti(image_path))} channel(s), dataset.json says "
                                f"in_channels={in_channels}", "convert the image or fix in_channels in dataset.json",
                                "channel_count"))
    if "label" not in entry:
        if split != "testing":
            problems.append(Problem(site, str(image_path), f"{split} entry has no mask ('label' key)",
                                    "add the mask path to the entry (only testing entries may be unlabeled)",
                                    "mask_not_listed"))
        return problems
    label_path = resolve(site_dir, entry["label"])
    if not label_path.is_file():
        problems.append(Problem(site, str(label_path), f"mask of image {image_path} does not exist",
                                "restore the mask file or regenerate the datalist", "mask_missing"))
        return problems
    try:
        label, label_spacing = read_array(label_path, mask=True)
    except Exception as err:  # noqa: BLE001
        problems.append(unreadable(site, label_path, err))
        return problems
    nifti = is_nifti(label_path)
    threshold = entry.get("label_threshold")
    if not nifti and label.ndim == 3 and threshold is None and not (label == label[..., :1]).all():
        problems.append(Problem(site, str(label_path), "colour mask with differing channels",
                                "save the mask as a single-channel (grayscale) image", "colour_mask"))
    label_values = mask_plane(label, nifti)
    problem = label_problem(site, label_path, label_values, entry.get("label_map"), n_classes, threshold)
    if problem is not None:
        problems.append(problem)
    if image is None:
        return problems
    image_shape = spatial_shape(image, is_nifti(image_path))
    label_shape = spatial_shape(label, nifti)
    if image_shape != label_shape:
        problems.append(shape_mismatch(site, image_path, label_path, image_shape, label_shape))
    elif image_spacing is not None and label_spacing is not None and not np.allclose(
        image_spacing, label_spacing, rtol=SPACING_RTOL, atol=0
    ):
        problems.append(spacing_mismatch(site, image_path, label_path, image_spacing, label_spacing))
    return problems
