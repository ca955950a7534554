"""How a site's masks encode their classes, decided from the values the masks hold.

Used by the ``generic`` layout (:mod:`pflseg.data.adapters`). The rules, per site:

- no options: masks holding two values ``{0, v}`` (v > 0, the same v in every mask of the site)
  are binary, v is the foreground (``label_map {"0": 0, "v": 1}``; none when v = 1);
- ``threshold`` T (``--mask-threshold``): value > T is foreground; for lossy (JPEG) masks whose
  values scatter around 0 and 255;
- ``classes`` with C >= 2 names (``--classes``): masks hold the labels 0..C (used as they are), or
  exactly C + 1 distinct values, mapped in sorted order to 0..C (e.g. 0, 85, 170, 255).

Anything else is a :class:`~pflseg.data.errors.Problem` naming the mask file, the values seen
and the option to use. Decisions are pure functions of :class:`MaskValues`, so they are tested
without files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pflseg.data.errors import Problem
from pflseg.data.labels import plain_number


@dataclass(frozen=True)
class MaskValues:
    """What the decision needs to know about one mask file.

    Attributes:
        path: The mask file.
        values: Its distinct raw values, sorted (first channel of a colour mask).
        lossy: True for JPEG files.
        colour_differs: True for a colour mask whose channels are not all equal.
    """

    path: str
    values: tuple
    lossy: bool = False
    colour_differs: bool = False


@dataclass(frozen=True)
class SiteEncoding:
    """How one site's masks map to class indices.

    Attributes:
        label_map: Raw value (str) -> class index for every entry of the site, or None.
        threshold: Raw value > threshold is class 1, or None.
        note: The decision in words, e.g. ``"masks: binary, foreground value 127"``.
    """

    label_map: dict | None
    threshold: float | int | None
    note: str


def format_values(values, limit: int = 8) -> str:
    """Sorted values as runs of consecutive integers: ``[0, 1, 2, 253, 255]`` -> ``"0..2, 253, 255"``.

    At most ``limit`` runs are shown; the rest is summarised as ``"... (N values)"``.
    """
    values = sorted(values)
    runs: list[list] = []
    for v in values:
        if runs and float(v).is_integer() and float(runs[-1][1]).is_integer() and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = [f"{plain_number(a)}" if a == b else f"{plain_number(a)}, {plain_number(b)}" if b == a + 1 else
            f"{plain_number(a)}..{plain_number(b)}" for a, b in runs[:limit]]
    if len(runs) > limit:
        text.append(f"... ({len(values)} values)")
    return ", ".join(text)


def describe_values(values) -> str:
    """Values in words: two far-apart groups as ``"18 values in 0..9 and 240..255"``, else :func:`format_values`."""
    values = sorted(values)
    if not looks_lossy_binary(values):
        return format_values(values)
    k = max(range(len(values) - 1), key=lambda i: values[i + 1] - values[i])
    low, high = values[: k + 1], values[k + 1 :]
    return f"{len(values)} values in {_span(low)} and {_span(high)}"


def _span(group: list) -> str:
    """``"a..b"`` for a sorted group of values, ``"a"`` for one value."""
    return f"{plain_number(group[0])}..{plain_number(group[-1])}" if len(group) > 1 else f"{plain_number(group[0])}"


def suggest_threshold(values) -> int | float:
    """A threshold halfway up the value range: 127 for 8-bit masks (max 255), 0.5 for soft masks in 0..1."""
    top = max(values)
    if all(float(v).is_integer() for v in values):
        return int(top // 2)
    return plain_number(top / 2)


def looks_lossy_binary(values) -> bool:
    """True when the values form two tight groups far apart (binary mask plus compression noise).

    The largest gap between consecutive values must exceed half the value range, and each group
    must span at most an eighth of it; e.g. 0..3 with 250..255, but not 0, 1, 2, 3 or 0, 85, 170, 255.
    """
    values = sorted(values)
    if len(values) < 3:
        return False
    span = values[-1] - values[0]
    gaps = [b - a for a, b in zip(values, values[1:])]
    k = max(range(len(gaps)), key=gaps.__getitem__)
    low, high = values[: k + 1], values[k + 1 :]
    return gaps[k] > span / 2 and low[-1] - low[0] <= span / 8 and high[-1] - high[0] <= span / 8


def site_encoding(
    site: str,
    masks: list[MaskValues],
    classes: list[str] | None = None,
    threshold: float | int | None = None,
) -> SiteEncoding | Problem:
    """Decides how one site's masks encode classes (rules in the module docstring).

    Args:
        site: Site name (for messages).
        masks: Every mask of the site (at least one).
        classes: Class names (``--classes``); None or one name for binary masks.
        threshold: ``--mask-threshold`` value, or None.

    Returns:
        The site's :class:`SiteEncoding`, or the :class:`Problem` that prevents one.
    """
    if not masks:
        raise ValueError(f"site {site!r}: masks is empty")
    n_classes = len(classes) if classes else 1
    folder = os.path.commonpath([m.path for m in masks]) if len(masks) > 1 else masks[0].path
    if threshold is not None:
        if not any(v > threshold for m in masks for v in m.values):
            seen = sorted({v for m in masks for v in m.values})
            return Problem(site, folder, f"no mask value is above --mask-threshold {plain_number(threshold)} "
                           f"(values seen: {format_values(seen)})",
                           f"pass a lower threshold, e.g. --mask-threshold {suggest_threshold(seen)}")
        t = plain_number(threshold)
        return SiteEncoding(None, t, f"masks: value > {t} is foreground (--mask-threshold)")
    for m in masks:
        problem = _file_problem(site, m)
        if problem is not None:
            return problem
    union = sorted({v for m in masks for v in m.values})
    if n_classes == 1:
        return _binary(site, masks, union, folder, classes)
    return _labelled(site, masks, union, classes)


def _file_problem(site: str, m: MaskValues) -> Problem | None:
    """Per-file problems without a threshold: colour masks, non-integer or negative values."""
    if m.colour_differs:
        if m.lossy:
            return Problem(site, m.path, "lossy (JPEG) colour mask whose channels differ",
                           f"pass --mask-threshold {suggest_threshold(m.values)} (values above it are foreground)")
        return Problem(site, m.path, "colour mask with differing channels",
                       "save the mask as a single-channel (grayscale) image with values 0..C")
    odd = [v for v in m.values if not float(v).is_integer()]
    if odd:
        return Problem(site, m.path, f"mask has non-integer values ({format_values(odd)})",
                       f"pass --mask-threshold {suggest_threshold(m.values)} for a soft or probability mask, "
                       "or save the masks with integer labels 0..C")
    if m.values and m.values[0] < 0:
        return Problem(site, m.path, f"mask has negative values ({format_values(m.values)})",
                       "save the masks with labels 0..C")
    return None


def _binary(site, masks, union, folder, classes) -> SiteEncoding | Problem:
    """One class: every mask must hold {0, v} with one v for the whole site."""
    nonzero = [v for v in union if v != 0]
    if union == [0]:
        return Problem(site, folder, "every mask is empty (only the value 0)",
                       "check that this folder holds the site's masks, or remove the site")
    if len(union) == 2 and union[0] == 0:
        v = plain_number(nonzero[0])
        label_map = None if v == 1 else {"0": 0, str(v): 1}
        return SiteEncoding(label_map, None, f"masks: binary, foreground value {v}")
    if len(union) == 1:
        return Problem(site, folder, f"every mask holds only the value {plain_number(union[0])}",
                       "check that this folder holds the site's masks (a binary mask holds 0 and one foreground value)")
    several = [m for m in masks if len(m.values) > 2 or (len(m.values) == 2 and m.values[0] != 0)]
    named = "--classes names one class, but " if classes else ""
    k = len(nonzero)
    names = ",".join(f"class{j}" for j in range(1, k + 1))
    if several:
        m = several[0]
        more = f" ({len(several) - 1} more mask(s) of this site alike)" if len(several) > 1 else ""
        seen = describe_values(m.values)
        if m.lossy:
            return Problem(site, m.path, f"{named}lossy (JPEG) mask with {seen}{more}; a binary mask "
                           "holds 0 and one foreground value",
                           f"pass --mask-threshold {suggest_threshold(m.values)} (values above it are foreground)")
        if looks_lossy_binary(m.values):
            return Problem(site, m.path, f"{named}mask with {seen}{more}: neither binary (0 and one "
                           "foreground value) nor clearly class labels",
                           f"pass --mask-threshold {suggest_threshold(m.values)} if it is a binary mask with noise "
                           f"(values above it are foreground), or --classes with {k} names if the values are labels")
        return Problem(site, m.path, f"{named}mask with {len(m.values)} values {seen}{more}: masks with more "
                       "than two values hold class labels",
                       f"pass --classes with one name per non-zero value ({k} names for the values "
                       f"{format_values(nonzero)} of this site), e.g. --classes {names}")
    with_fg = [(m, [v for v in m.values if v != 0]) for m in masks]
    with_fg = [(m, fg) for m, fg in with_fg if fg]
    a, a_fg = with_fg[0]
    b = next(m for m, fg in with_fg if fg != a_fg)
    return Problem(site, b.path, f"{named}masks of this site disagree on the foreground value: this mask holds "
                   f"{{{format_values(b.values)}}}, {a.path} holds {{{format_values(a.values)}}}",
                   f"re-save the masks with one foreground value, or pass --classes with {k} names if the "
                   f"values are class labels, e.g. --classes {names}")


def _labelled(site, masks, union, classes) -> SiteEncoding | Problem:
    """C >= 2 classes: labels 0..C as they are, or C + 1 distinct values in sorted order."""
    n = len(classes)
    names = ", ".join(f"{k} {name}" for k, name in enumerate(classes, 1))
    if all(0 <= v <= n for v in union):
        return SiteEncoding(None, None, f"masks: labelled 0..{n} (0 background, {names})")
    if len(union) == n + 1 and union[0] == 0:
        label_map = {str(plain_number(v)): k for k, v in enumerate(union)}
        return SiteEncoding(label_map, None, f"masks: labelled, values {format_values(union)} -> 0..{n} "
                            f"(0 background, {names})")
    m = next(m for m in masks if any(v > n for v in m.values))
    fix = (f"save the masks losslessly (PNG or NIfTI) with values 0..{n}" if m.lossy else
           f"save the masks with values 0..{n}, or pass one class name per non-zero value "
           f"({len(union) - 1} name(s) for this site's values {format_values(union)})")
    return Problem(site, m.path, f"mask values {format_values(m.values)} are not the labels 0..{n} of "
                   f"--classes {','.join(classes)}", fix)
