"""Label maps and channel encodings shared by the checker and the training datasets.

After the entry's optional ``label_map`` (raw mask value -> class index) or ``label_threshold``
(raw value > threshold -> class 1, else 0; for lossy, e.g. JPEG, binary masks), a mask holds class
indices 0..C for C classes. ``nested``: output channel c = (label > c), e.g. fundus disc = label >= 1,
cup = label >= 2. ``exclusive``: channel c = (label == c + 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pflseg.data.errors import Problem, bad_label_values


def label_problem(
    site: str,
    file: str | Path,
    mask: np.ndarray,
    label_map: dict | None,
    n_classes: int,
    threshold: float | None = None,
) -> Problem | None:
    """Checks mask values: raw values must be label_map keys, class values must lie in 0..C.

    Args:
        site: Site name (for the message).
        file: Mask path (for the message).
        mask: Raw mask values, any shape.
        label_map: Raw value (as str) -> class index, or None.
        n_classes: Number of classes C.
        threshold: Raw value > threshold is class 1, else 0 (any raw values are fine); None for none.

    Returns:
        A :class:`Problem`, or None when the values are fine.
    """
    if threshold is not None:
        if label_map is not None:
            return Problem(site, str(file), "the datalist entry has both label_map and label_threshold",
                           "keep one of them in the entry (re-index the data)", "label_map_invalid")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            return Problem(site, str(file), f"label_threshold must be a number, got {threshold!r}",
                           "fix the entry's label_threshold (re-index with --mask-threshold)", "label_map_invalid")
        return None
    values = np.unique(mask)
    if label_map is not None:
        keys = {float(k) for k in label_map}
        bad = [plain_number(v) for v in values if float(v) not in keys]
        if bad:
            return bad_label_values(site, file, bad, [plain_number(float(k)) for k in label_map], raw=True)
        values = np.unique([label_map[k] for k in label_map if float(k) in set(values.tolist())])
    bad = [plain_number(v) for v in values if not (float(v).is_integer() and 0 <= v <= n_classes)]
    if bad:
        return bad_label_values(site, file, bad, range(n_classes + 1), raw=False)
    return None


def map_labels(
    site: str,
    file: str | Path,
    mask: np.ndarray,
    label_map: dict | None,
    n_classes: int,
    threshold: float | None = None,
) -> np.ndarray:
    """Applies the label map (or the threshold) and validates the result.

    Returns:
        int64 array of class indices 0..C, same shape as ``mask``.

    Raises:
        DataError: Values outside the label map or the class range (same text as the checker).
    """
    problem = label_problem(site, file, mask, label_map, n_classes, threshold)
    if problem is not None:
        raise problem.error()
    if threshold is not None:
        return (mask > threshold).astype(np.int64)
    if label_map is None:
        return mask.astype(np.int64)
    out = np.zeros(mask.shape, np.int64)
    for raw, cls in label_map.items():
        out[mask == float(raw)] = int(cls)
    return out


def class_counts(
    values: np.ndarray, counts: np.ndarray, label_map: dict | None, threshold: float | None = None
) -> dict[int, int]:
    """Pixel count per class index, from a mask's raw values and their pixel counts.

    Args:
        values: Unique raw mask values.
        counts: Pixels holding each value.
        label_map: Raw value (as str) -> class index, or None (raw values are the classes).
        threshold: Raw value > threshold is class 1, else 0 (instead of a label map).

    Returns:
        Class index -> pixel count; raw values missing from the label map count as class -1.
    """
    out: dict[int, int] = {}
    lookup = {float(k): int(v) for k, v in label_map.items()} if label_map is not None else None
    for value, count in zip(np.asarray(values).tolist(), np.asarray(counts).tolist()):
        if threshold is not None:
            cls = int(value > threshold)
        elif lookup is not None:
            cls = lookup.get(float(value), -1)
        else:
            cls = int(value) if float(value).is_integer() else -1
        out[cls] = out.get(cls, 0) + int(count)
    return out


def encode_labels(label: np.ndarray, n_classes: int, encoding: str) -> np.ndarray:
    """Class indices (...) -> binary float32 channels (C, ...) by the nested or exclusive rule."""
    if encoding == "nested":
        channels = [label > c for c in range(n_classes)]
    elif encoding == "exclusive":
        channels = [label == c + 1 for c in range(n_classes)]
    else:
        raise ValueError(f"encoding={encoding!r}: expected 'nested' or 'exclusive'")
    return np.stack(channels).astype(np.float32)


def plain_number(v) -> int | float:
    """Prints integral values without a trailing .0."""
    v = float(v)
    return int(v) if v.is_integer() else v
