"""Markdown shared by every report: one table renderer, one way to write a paired difference."""

from __future__ import annotations


def markdown_table(head: list, rows: list[list]) -> str:
    """A Markdown table: a header row, the separator, one line per row (cells formatted by the caller)."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def diff_cell(d: dict | None) -> str:
    """A paired difference as ``+0.012 [-0.004, +0.028]``, marked **+** / **−** when its interval excludes 0."""
    if not d:
        return "-"
    mark = {"better": " **+**", "worse": " **−**", "tie": ""}[d["verdict"]]
    return f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]{mark}"
