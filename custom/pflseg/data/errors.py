"""Data errors and problem reports that a person can act on.

Every problem names the site, the file, what is wrong and how to fix it. The same
:class:`Problem` objects are produced by :func:`pflseg.data.check.check_dataset` and raised (as
:class:`DataError`) by the training datasets, so a bad file reads the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DataError(Exception):
    """A dataset, datalist or image cannot be used; the message names the path and the fix.

    Attributes:
        problems: the :class:`Problem` objects behind the message (empty when it was raised as plain text);
            a site sends their codes and pseudonyms instead of the message (``pflseg.flare.privacy.public_error``).
    """

    def __init__(self, message: str = "", problems=()):
        super().__init__(message)
        self.problems = list(problems)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset.

    Attributes:
        site: Site name ("" for the dataset as a whole).
        file: The offending file or folder.
        problem: What is wrong.
        fix: What to do about it.
        code: A short name of the kind of problem (what a site may send about it, with a pseudonym).
        case: The case id the problem is about ("" when it is about ``file``).
    """

    site: str
    file: str
    problem: str
    fix: str
    code: str = "data_problem"
    case: str = ""

    def __str__(self) -> str:
        where = f"[{self.site}] " if self.site else ""
        return f"{where}{self.file}: {self.problem}. Fix: {self.fix}"

    def error(self) -> DataError:
        """Returns this problem as a :class:`DataError` ready to raise."""
        return DataError(str(self), [self])


def problems_error(problems: list[Problem], root: str | Path) -> DataError:
    """Builds one :class:`DataError` listing every problem, one per line."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return DataError(f"{len(problems)} problem(s) in dataset {root}:\n{lines}", problems)


def unreadable(site: str, file: str | Path, err: BaseException) -> Problem:
    """A file that cannot be opened or decoded, or (``pflseg.data.files.ImageFormatError``: 4D, NaN / Inf) one
    that reads but cannot be used: then what is wrong with it and its own fix."""
    if all(hasattr(err, a) for a in ("problem", "fix", "code")):
        return Problem(site, str(file), err.problem, err.fix, err.code)
    return Problem(
        site,
        str(file),
        f"cannot read file ({type(err).__name__}: {err})",
        "re-export or re-copy the file (it is truncated or not an image), or remove its datalist entry",
        "unreadable_file",
    )


def bad_label_values(site: str, file: str | Path, values, allowed, raw: bool) -> Problem:
    """Label values outside the expected set (raw values missing from label_map, or classes > C)."""
    shown = ", ".join(str(v) for v in list(values)[:10])
    if raw:
        what = f"mask values {{{shown}}} are not keys of the entry's label_map {sorted(allowed)}"
        fix = "add these values to the datalist entry's label_map or fix the mask"
    else:
        what = f"label values {{{shown}}} are outside the class range 0..{max(allowed)}"
        fix = "fix the mask, add a label_map to the datalist entry, or set the classes in dataset.json"
    return Problem(site, str(file), what, fix, "bad_label_values")


def shape_mismatch(site: str, image: str | Path, label: str | Path, image_shape, label_shape) -> Problem:
    """Image and mask of one entry have different spatial shapes."""
    return Problem(
        site,
        str(label),
        f"mask shape {tuple(label_shape)} differs from image {image} shape {tuple(image_shape)}",
        "pair the mask with its own image, or resample the mask onto the image grid",
        "shape_mismatch",
    )


def spacing_mismatch(site: str, image: str | Path, label: str | Path, image_spacing, label_spacing) -> Problem:
    """Image and mask NIfTI headers disagree on voxel spacing."""
    fmt = lambda s: "(" + ", ".join(f"{v:.4g}" for v in s) + ")"  # noqa: E731
    return Problem(
        site,
        str(label),
        f"mask spacing {fmt(label_spacing)} differs from image {image} spacing {fmt(image_spacing)}",
        "resample the mask onto the image grid or copy the image header (pixdim) into the mask",
        "spacing_mismatch",
    )
