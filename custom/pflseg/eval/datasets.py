"""What `pflseg data` says about a data set: a synthetic one's sites as made, a real layout's index, every problem.

The work is ``pflseg.data``'s (``make_synthetic``, ``index_report``, ``check_dataset``); these functions choose its
arguments from a command's flags and put its answer in words.
"""

from __future__ import annotations

from pathlib import Path

from pflseg import data

#: the knobs of a synthetic site that ``synth_summary`` names, in this order
KNOBS = ("dilate", "contour", "include_adjacent", "noisy", "radius_scale")


def synth_summary(root: str | Path, task: str, preset: str | None = None, seed: int = 0) -> str:
    """One line for the synthetic data root ``root`` (``task``, its sites, ``preset`` and ``seed``), then one per
    site of a preset: its kind, cases per split, pixels and knobs."""
    info = data.load_dataset_info(root)
    lines = [f"synthetic {task} data set with {len(info['sites'])} sites in {root}"
             + (f" (preset {preset}, seed {seed})" if preset else "")]
    for site, p in (info.get("site_profiles") or {}).items():
        knobs = ", ".join(f"{k}={p[k]}" for k in KNOBS)
        split = "/".join(str(p["split"][k]) for k in ("training", "validation", "testing"))
        lines.append(f"  {site}: {p.get('outside_kind', p['kind'])}, cases train/val/test {split}, {p['n_px']} px, "
                     f"{knobs}")
    return "\n".join(lines)


def synth(out: str | Path, task: str = "prostate", sites: int | None = None, seed: int = 0, size: int | None = None,
          depth: int | None = None, preset: str | None = None, outside: list[str] | None = None,
          near_copy_of: str | None = None) -> str:
    """``pflseg data synth``: make a synthetic multi-site data root (``pflseg.data.make_synthetic``); return its
    ``synth_summary``."""
    root = data.make_synthetic(out, task=task, n_sites=sites, seed=seed, size=size, depth=depth, preset=preset,
                               outside=outside, near_copy_of=near_copy_of, say=print)
    return synth_summary(root, task, preset, seed)


def index(layout: str, root: str | Path, out: str | Path, seed: int = 0, classes: str | None = None,
          mask_threshold: float | None = None) -> str:
    """``pflseg data index``: index ``root`` (``layout``) into the data root ``out``; return what each site holds
    (``pflseg.data.index_report``). ``classes``: comma-separated class names (``--classes A,B``)."""
    names = [c.strip() for c in classes.split(",")] if classes is not None else None
    return str(data.index_report(layout, root, out, seed=seed, classes=names, mask_threshold=mask_threshold))


def check(root: str | Path) -> tuple[str, bool]:
    """``pflseg data check``: every problem of the data root ``root`` (``pflseg.data.check_dataset``), one line each,
    then their count. Returns ``(text, True when there is none)``."""
    problems = data.check_dataset(root, say=print)
    return "\n".join([*map(str, problems), f"{len(problems)} problem(s) in {root}"]), not problems
