"""Pure checks of what a site sends the server, FLARE-free (the controllers call them on every answer, before
anything uses it; ``pflseg.flare.controllers.base``): an update against the reference the task sent
(``check_update``), the metrics a task needs (``check_metrics``, value kinds ``KINDS``), and whether a checkpoint's
model fits the configured one (``state_mismatch``)."""

from __future__ import annotations

import json
import math
import numbers

import torch


def check_update(params: dict, reference: dict) -> str | None:
    """Why a site's update cannot be used, or None if it is fine.

    ``reference`` maps every key a site must send (flat, prefixed: "global.x", "person.x", ...) to a tensor
    of the expected shape and dtype. The update must have exactly these keys; every value a dense CPU tensor
    of the reference's shape and dtype (so no site decides the dtype of an aggregate), holding no more bytes
    than that shape needs, floating values finite.
    """
    for key in params:
        if key not in reference:
            return f"unexpected key '{key}'"
    missing = [key for key in reference if key not in params]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"missing key '{missing[0]}'{more}"
    for key, value in params.items():
        ref = reference[key]
        if not torch.is_tensor(value):
            return f"'{key}' is {type(value).__name__}, not a tensor"
        if value.layout != torch.strided or value.device != ref.device:
            return f"'{key}' has layout {value.layout} on {value.device}, expected {ref.layout} on {ref.device}"
        if tuple(value.shape) != tuple(ref.shape):
            return f"'{key}' has shape {tuple(value.shape)}, expected {tuple(ref.shape)}"
        if value.dtype != ref.dtype:
            return f"'{key}' has dtype {value.dtype}, expected {ref.dtype}"
        needed, held = ref.numel() * ref.element_size(), value.untyped_storage().nbytes()
        if held > needed:
            return f"'{key}' holds {held} bytes of storage, its shape needs {needed}"
        if value.is_floating_point() and not torch.isfinite(value).all():
            return f"'{key}' contains NaN or Inf"
    return None


def state_mismatch(saved: dict, fresh: dict) -> str:
    """How a checkpoint's model ``saved`` differs from the model the config builds (``fresh``): keys missing or
    extra and shapes that differ (a few named), or "" when they fit."""
    lines = [f"{k}: {tuple(saved[k].shape)} in the checkpoint, {tuple(fresh[k].shape)} now"
             for k in fresh if k in saved and tuple(saved[k].shape) != tuple(fresh[k].shape)]
    lines += [f"{k}: not in the checkpoint" for k in fresh if k not in saved]
    lines += [f"{k}: in the checkpoint only" for k in saved if k not in fresh]
    return "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")


def is_number(value) -> bool:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def is_finite(value) -> bool:
    """A number that is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(float(value))
    except (OverflowError, TypeError, ValueError):
        return False


def dice_like(key: str) -> bool:
    return key.startswith(("val_dice", "test_dice"))


#: Kinds of the values in a site's answer: name -> (check, what the value must be).
KINDS = {
    "dice": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "number": (lambda v: is_number(v) and is_finite(v), "a finite number"),
    "seconds": (lambda v: is_number(v) and is_finite(v) and v >= 0, "a finite number >= 0"),
    "count": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "dict": (lambda v: isinstance(v, dict) and _json_ok(v), "a dict of JSON data"),
    "list": (lambda v: isinstance(v, list) and _json_ok(v), "a list of JSON data"),
    "fractions": (lambda v: isinstance(v, list) and len(v) > 0 and all(is_number(x) and 0 <= x <= 1 for x in v),
                  "a non-empty list of numbers in [0, 1]"),
}


def _json_ok(value) -> bool:
    try:
        json.dumps(value, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def check_metrics(metrics: dict, required: dict[str, str]) -> str | None:
    """Why ``metrics`` cannot be used, or None: every ``required`` metric present and of its kind; every
    Dice-like metric (``val_dice*``, ``test_dice*``) a number in [0, 1]; every other number finite;
    ``compute_seconds`` (added by the client script) a finite number >= 0."""
    for key, kind in required.items():
        if key not in metrics:
            return f"no metric '{key}' ({KINDS[kind][1]})"
    for key, value in metrics.items():
        if not isinstance(key, str):
            return f"metric name {key!r} is not a string"
        kind = required.get(key) or ("dice" if dice_like(key) else "seconds" if key == "compute_seconds"
                                     else "number" if is_number(value) else None)
        if kind and not KINDS[kind][0](value):
            return f"metric {key}={value!r} is not {KINDS[kind][1]}"
    return None
