"""What indexing found: every file's header and mask values, and a per-site summary to print.

:func:`scan_record` reads one datalist record (the image header and the whole mask);
:func:`summarize_site` turns a site's scans into a :class:`SiteSummary` (cases per split,
foreground fraction, image sizes and channels); :class:`IndexReport` is what
``pflseg data index`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pflseg.data.datalist import SPLITS
from pflseg.data.errors import Problem, unreadable
from pflseg.data.files import image_header, is_lossy, is_nifti, mask_plane, read_array, spatial_shape
from pflseg.data.labels import class_counts
from pflseg.data.masks import MaskValues


@dataclass(frozen=True)
class FileScan:
    """One image/mask pair as read at indexing time.

    Attributes:
        image_shape: Spatial shape of the image ((H, W) for 2D files).
        channels: Image channels after conversion (alpha dropped, palette converted).
        mode: The image kind in words, e.g. "RGBA, alpha channel dropped".
        mask: The mask's distinct values (for :func:`pflseg.data.masks.site_encoding`).
        counts: Pixels holding each of ``mask.values``.
        mask_shape: Spatial shape of the mask.
    """

    image_shape: tuple
    channels: int
    mode: str
    mask: MaskValues
    counts: tuple
    mask_shape: tuple


def scan_record(site: str, record: dict) -> tuple[FileScan | None, list[Problem]]:
    """Reads a record's image header and its whole mask.

    Returns:
        ``(scan, [])``, or ``(None, problems)`` naming the unreadable image and/or mask.
    """
    problems = []
    try:
        image_shape, channels, mode = image_header(record["image"])
    except Exception as err:  # noqa: BLE001 - any reader failure is a data problem
        problems.append(unreadable(site, record["image"], err))
    path = record["label"]
    try:
        mask, _ = read_array(path, mask=True)
    except Exception as err:  # noqa: BLE001
        problems.append(unreadable(site, path, err))
    if problems:
        return None, problems
    nifti = is_nifti(path)
    colour_differs = bool(not nifti and mask.ndim == 3 and not (mask == mask[..., :1]).all())
    values, counts = np.unique(mask_plane(mask, nifti), return_counts=True)
    return FileScan(
        image_shape=tuple(image_shape),
        channels=channels,
        mode=mode,
        mask=MaskValues(str(path), tuple(v.item() for v in values), is_lossy(path), colour_differs),
        counts=tuple(int(c) for c in counts),
        mask_shape=spatial_shape(mask, nifti),
    ), []


def short_side(shape: tuple) -> int:
    """The smaller in-plane side of a spatial shape (the first two axes)."""
    return int(min(shape[:2]))


@dataclass
class SiteSummary:
    """One site as indexed.

    Attributes:
        site: Site name.
        cases: Split -> number of cases.
        files: Split -> number of image files (differs from cases where a case has several slices).
        foreground: Fraction of mask pixels in any class (None without masks).
        classes: Class names.
        class_fractions: Per class, the fraction of mask pixels in that output channel.
        sizes: Distinct image shapes, sorted.
        channels: Image channels (after conversion).
        modes: The image kinds in words.
        notes: How the masks were read, and warnings.
    """

    site: str
    cases: dict
    files: dict
    foreground: float | None
    classes: list
    class_fractions: list
    sizes: list
    channels: list
    modes: list
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        cases = ", ".join(
            f"{s} {self.cases[s]}" + (f" ({self.files[s]} images)" if self.files[s] != self.cases[s] else "")
            for s in SPLITS
        )
        fg = "no masks" if self.foreground is None else f"foreground {100 * self.foreground:.2f} %"
        if len(self.class_fractions) > 1:
            fg += " (" + ", ".join(f"{c} {100 * f:.2f} %" for c, f in zip(self.classes, self.class_fractions)) + ")"
        shape = lambda s: "x".join(map(str, s))  # noqa: E731
        size = shape(self.sizes[0]) if len(self.sizes) == 1 else (
            f"{len(self.sizes)} sizes, {shape(self.sizes[0])} to {shape(self.sizes[-1])}")
        if all(len(s) == 2 for s in self.sizes):
            size += " (HxW)"
        channels = "/".join(map(str, self.channels))
        lines = [f"[{self.site}] cases: {cases} | {fg} | size {size} | channels {channels} ({'; '.join(self.modes)})"]
        return "\n".join(lines + [f"    {n}" for n in self.notes])


def summarize_site(
    site: str, entries: dict[str, list[dict]], scans: dict[str, FileScan], classes: list[str], encoding: str
) -> SiteSummary:
    """Summarises one site's datalist.

    Args:
        site: Site name.
        entries: Split -> datalist entries (with ``label_map`` / ``label_threshold`` as written).
        scans: Image path -> its :class:`FileScan`.
        classes: Class names (C of them).
        encoding: "nested" or "exclusive" (how class indices become output channels).
    """
    n_classes = len(classes)
    totals: dict[int, int] = {}
    for split in SPLITS:
        for e in entries.get(split, []):
            scan = scans[e["image"]]
            counts = class_counts(scan.mask.values, scan.counts, e.get("label_map"), e.get("label_threshold"))
            for cls, n in counts.items():
                totals[cls] = totals.get(cls, 0) + n
    pixels = sum(totals.values())
    foreground = sum(n for c, n in totals.items() if c > 0) / pixels if pixels else None
    if encoding == "nested":
        per_class = [sum(n for c, n in totals.items() if c > k) for k in range(n_classes)]
    else:
        per_class = [totals.get(k + 1, 0) for k in range(n_classes)]
    all_scans = [scans[e["image"]] for split in SPLITS for e in entries.get(split, [])]
    notes = []
    if foreground is not None and foreground > 0.5:
        notes.append(f"warning: the foreground covers {100 * foreground:.1f} % of the mask pixels; check that the "
                     "masks are not inverted (object drawn as 0 on a non-zero background)")
    return SiteSummary(
        site=site,
        cases={s: len({e["case"] for e in entries.get(s, [])}) for s in SPLITS},
        files={s: len({e["image"] for e in entries.get(s, [])}) for s in SPLITS},
        foreground=foreground,
        classes=list(classes),
        class_fractions=[n / pixels for n in per_class] if pixels else [],
        sizes=sorted({s.image_shape for s in all_scans}),
        channels=sorted({s.channels for s in all_scans}),
        modes=sorted({s.mode for s in all_scans}),
        notes=notes,
    )


@dataclass
class IndexReport:
    """The result of indexing a data set; ``str()`` is what ``pflseg data index`` prints.

    Attributes:
        root: The original data folder.
        out: The data root written (dataset.json + per-site datalists).
        layout: The layout indexed.
        info: The dataset.json contents written.
        sites: One :class:`SiteSummary` per site, in dataset.json order.
        ignored: Files and folders under ``root`` that were not indexed, each with the reason.
    """

    root: Path
    out: Path
    layout: str
    info: dict
    sites: list
    ignored: list = field(default_factory=list)

    def __str__(self) -> str:
        info = self.info
        lines = [
            f"indexed {self.root} (layout {self.layout}) into {self.out}",
            f"dataset.json: classes {', '.join(info['classes'])} ({info['label_encoding']}), "
            f"in_channels {info['in_channels']}, train_size {info.get('train_size', '-')}",
        ]
        lines += [str(s) for s in self.sites]
        if self.ignored:
            lines.append(f"ignored {len(self.ignored)} file(s) or folder(s) under {self.root} (not indexed):")
            lines += [f"  - {reason}" for reason in self.ignored]
        return "\n".join(lines)
