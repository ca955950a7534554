"""Markdown shared by every report and every layer that writes one (``pflseg.eval``, the cross-site matrix of
``pflseg.flare.controllers.cross_site``, ``pflseg submit``'s metrics): one table renderer, one way to write a paired
difference. Plain string work, no imports: every layer may use it."""

from __future__ import annotations


def markdown_table(head: list, rows: list[list]) -> str:
    """A Markdown table: a header row, the separator, one line per row (cells formatted by the caller)."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def number_cell(value: float | None, digits: int = 2, signed: bool = False) -> str:
    """A number with ``digits`` decimals (``signed``: with its sign, ``+0.012``), ``-`` for a missing value."""
    return "-" if value is None else format(value, f"{'+' if signed else ''}.{digits}f")


def diff_cell(d: dict | None) -> str:
    """A paired difference as ``+0.012 [-0.004, +0.028]`` (with 2+ seeds ``; over 3 seeds [-0.02, +0.04]``, the
    interval that respects the nesting), marked **+** / **−** when the verdict's interval excludes 0."""
    if not d:
        return "-"
    mark = {"better": " **+**", "worse": " **−**", "tie": ""}[d["verdict"]]
    seeds = d.get("seeds")
    nested = f"; over {seeds['n']} seeds [{seeds['lo']:+.3f}, {seeds['hi']:+.3f}]" if seeds else ""
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]{nested}{mark}"
