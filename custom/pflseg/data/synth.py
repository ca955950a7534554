"""Synthetic multi-site segmentation data where personalization matters.

:func:`make_synthetic` writes 3D NIfTI volumes (float32 image, uint8 label) for ``n_sites`` sites
named ``site-1 .. site-N`` (the NVFlare simulator's client names), with ``datalist.json`` per site
and ``dataset.json``, in the layout of :mod:`pflseg.data.datalist`. Everything is drawn from
``numpy.random.default_rng`` streams seeded by ``(seed, site, case)``: the same seed gives
identical arrays.

Sites differ like scanners and populations do. Each site renders the same field of view at its own
in-plane resolution (``px`` x ``size`` pixels, e.g. 48..80 for size 64; the NIfTI affine carries the
matching spacing), and draws its own appearance (tissue intensities, gamma, multiplicative smooth
bias field, noise, blur, texture, intensity scale/offset) and anatomy (organ radius as a fraction
of the field of view, eccentricity, centre). The main trap is the intensity order of organ and
distractor blobs: at sites 1 and 4 the organ is the brightest structure, at sites 2, 3 and 5 the
distractors are brighter, so a model trained at one site segments the wrong blobs at another.

Inside-site templates (cycled when ``n_sites`` > 6; ``seed`` jitters every number by up to 5 %)::

    site  px    bg   organ distr gamma bias noise blur texture scale  offset radius ecc  centre       n_distr
    1     1.00  .35  .70   .50   1.0   .15  .03   0.5  .08     1000   0      .24    1.00 ( .00, .00)  2
    2     0.75  .40  .66   .85   0.6   .45  .07   1.2  .16     300    50     .18    0.65 ( .12,-.06)  3
    3     1.25  .22  .55   .78   1.7   .25  .10   0.0  .05     2      -1     .30    1.35 (-.10, .08)  1
    4     0.875 .50  .92   .30   1.3   .55  .04   0.9  .15     4000   500    .21    0.85 ( .00, .14)  3
    5     1.125 .18  .42   .62   0.8   .10  .06   1.6  .12     1      0      .27    1.15 ( .06,-.12)  2

For ``task="fundus"`` the organ is the optic disc (label 1 = rim) with a nested cup (label 2) and
dark vessels crossing it; the columns ``bg/organ/distr`` are replaced per site by::

    site  bg   disc  cup   lesion vessel cup/disc radius ecc
    1     .30  .65   .90   .55    .50    .40      .30    1.00
    2     .40  .66   .82   .95    .30    .65      .24    0.80
    3     .20  .55   .95   .80    .60    .50      .36    1.20
    4     .40  .85   .95   .35    .40    .30      .28    0.90
    5     .25  .50   .62   .70    .20    .58      .32    1.10

The LAST site (when ``n_sites`` >= 3) is an *outside* site: it has its own resolution (px 0.94),
noise (.05), blur (0.7) and scale/offset (500, 20), and each of its cases blends the appearance and
anatomy of two randomly chosen inside sites with a random weight in [0.25, 0.75]. It resembles the
mix of the other sites and no single one of them.

Default cases per site cycle ``[12, 10, 10, 8, 6]`` for inside sites and 10 for the outside site
(6 sites: 56 cases). Splits are ~60/20/20 at case level with at least one case per split.

Presets (``make_synthetic(out, preset="bench", seed=s)``; :data:`PRESETS`)
----------------------------------------------------------------------------

A preset fixes the size, the slices per case, the sites, their cases per split and independent
per-site knobs; without a preset none of this applies and the output is byte-for-byte the one above.
Every preset site renders an *adjacent structure* (touching the organ, on the upper slices, brighter
than the organ by 0.15 before gamma), and its label follows the site's convention. Knobs and their
levels (each calibrated to a data statistic, never to a method's result; px are at size 64 and scale
with the site's rendered size, so they are the same in mm and after resizing to 64)::

    knob              levels                 where the level comes from
    dilate            -2, -1, 0, +1, +2 px   1 px (2.5 mm) lowers the Dice to the reference label to .75-.89
                                             (small..large organ): the inter-rater Dice of whole-gland
                                             prostate MRI contours (~.8-.9); 2 px (.50-.80) is another
                                             contouring convention (e.g. outside vs inside the capsule)
    contour           smooth | polygon, 6-8 vertices per slice: the clicks of a coarse polygon annotation
                      vertices 6 | 8         (Dice .85-.88 with 6, .90-.93 with 8 to the smooth contour)
    include_adjacent  False | True           the seminal vesicles at the gland's base, inside some
                                             protocols' contours (radiotherapy CTVs) and outside
                                             gland-only ones (Dice ~.90 between the two conventions)
    noisy             False | True           per case: boundary offset uniform in +-2 px, a smooth boundary
                                             perturbation of ~1 px, a shift uniform in +-2 px per axis;
                                             the size of simulated noisy masks in segmentation label-noise
                                             studies (random erosion/dilation and shifts of a few px):
                                             Dice .65-.84 to the clean label
    radius_scale      0.9 .. 1.2             gland volume ~20 vs ~80 mL between cohorts (young vs BPH) is
                                             x1.6 in diameter; on top of the templates' radii (.18-.30 of
                                             the half field of view) the organ spans radius .16-.36
    split (cases)     train 24 / 12 / 6 / 3 / 2,  SAML's sites hold 12-30 cases (x2.5) and FeTS 2022's
                      val 2, test 5 per site      institutions from a handful to hundreds; 24..2 (x12)
                                                  sits between; 5 test cases (40 slices) keep every
                                                  inside site's test Dice from resting on one case

Outside sites (``outside=`` kinds, named ``site-K+1..`` after the K inside sites, each recorded with its
``outside_kind``; 38 cases x 8 slices = 304 slices each, so test-time optimisation gets ~10 batches
of 32 per pass)::

    near_copy     one named inside site (``near_copy_of``, default site-2): its template, knobs and label
                  convention, every number jittered by another +-5 %
    blend         as without a preset: each case mixes two random inside sites (w in [0.25, 0.75]),
                  own resolution/noise/blur (px .94, noise .05, blur 0.7)
    extrapolate   the inside mean anatomy with a style beyond the inside range: gamma and bias x1.15 their
                  max, noise x0.8 and organ-background contrast x0.85 their min, resolution px x0.9 the min

Outside sites other than near_copy label by the *reference convention* (smooth, 0 px, adjacent
excluded): the inside majority's for contour and inclusion in both presets (``outside_labels``
changes it).

Preset "bench" (size 64, 8 slices per case; radius = template x scale, +-5 % with the seed; Dice of
the site's labels to the reference convention, mean of 10 cases at seed 0)::

    site    kind     template  train/val/test  slices (test)  radius  label convention             Dice
    site-1  inside   1         24 / 2 / 5      248 (40)       .24     reference                    1.00
    site-2  inside   2         12 / 2 / 5      152 (40)       .16     +1 px, adjacent included     .67
    site-3  inside   3          6 / 2 / 5      104 (40)       .36     +2 px, polygon (6 vertices)  .89
    site-4  inside   4          3 / 2 / 5       80 (40)       .21     noisy                        .72
    site-5  inside   5          2 / 2 / 5       72 (40)       .30     -2 px, adjacent included     .72
    site-6  outside  blend     24 / 4 / 10     304 (80)       ~.26    reference                    1.00

``outside=("near_copy", "blend", "extrapolate")`` makes site-6 near_copy (of site-2), site-7 blend,
site-8 extrapolate, each 24 / 4 / 10.

Preset "demo" (the bench scaled down: size 48, 8 slices per case, sites 1-3 of the bench with fewer
training cases; every site >= 5 test cases, >= 40 test slices)::

    site    kind     template  train/val/test  slices (test)  label convention
    site-1  inside   1         12 / 2 / 5      152 (40)       reference
    site-2  inside   2          6 / 2 / 5      104 (40)       +1 px, adjacent included
    site-3  inside   3          3 / 2 / 5       80 (40)       +2 px, polygon (6 vertices)
    site-4  outside  blend     10 / 2 / 8      160 (64)       reference

``dataset.json`` of a preset root also holds ``train_size`` (the size) and ``site_profiles``:
``{site: {"kind": "inside" | "outside", "outside_kind", "copy_of" | "blend_of", "template", "split",
"radius_scale", knobs, "n_px", "slices", parameters}}``. :func:`preset_sites` says what a preset makes
without rendering. The seed is part of the data: another seed jitters every template and redraws
every case.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from pflseg.data.datalist import claim_out, split_cases, write_datalist, write_dataset_json
from pflseg.data.files import private_dir
from pflseg.progress import Progress

TASKS = ("prostate", "fundus")
FOV_MM = 160.0
SLICE_MM = 3.0

_APPEARANCE = ("px", "gamma", "bias", "noise", "blur", "texture", "scale", "offset")
_KEYS = ("px", "bg", "organ", "distractor", "gamma", "bias", "noise", "blur", "texture", "scale",
         "offset", "radius", "ecc", "cx", "cy", "n_distractors")
_PROSTATE = [
    (1.00, .35, .70, .50, 1.0, .15, .03, 0.5, .08, 1000.0, 0.0, .24, 1.00, .00, .00, 2),
    (0.75, .40, .66, .85, 0.6, .45, .07, 1.2, .16, 300.0, 50.0, .18, 0.65, .12, -.06, 3),
    (1.25, .22, .55, .78, 1.7, .25, .10, 0.0, .05, 2.0, -1.0, .30, 1.35, -.10, .08, 1),
    (0.875, .50, .92, .30, 1.3, .55, .04, 0.9, .15, 4000.0, 500.0, .21, 0.85, .00, .14, 3),
    (1.125, .18, .42, .62, 0.8, .10, .06, 1.6, .12, 1.0, 0.0, .27, 1.15, .06, -.12, 2),
]
_FUNDUS_KEYS = ("bg", "organ", "inner", "distractor", "vessel", "cdr", "radius", "ecc")
_FUNDUS = [
    (.30, .65, .90, .55, .50, .40, .30, 1.00),
    (.40, .66, .82, .95, .30, .65, .24, 0.80),
    (.20, .55, .95, .80, .60, .50, .36, 1.20),
    (.40, .85, .95, .35, .40, .30, .28, 0.90),
    (.25, .50, .62, .70, .20, .58, .32, 1.10),
]
_OUTSIDE = {"px": 0.94, "noise": 0.05, "blur": 0.7, "scale": 500.0, "offset": 20.0}
_DEFAULT_CASES = (12, 10, 10, 8, 6)
_OUTSIDE_CASES = 10
_NO_JITTER = ("n_distractors", "offset", "cx", "cy")

#: the nominal size at which label offsets are given in pixels (scaled with each site's rendered size)
REFERENCE_SIZE = 64
OUTSIDE_KINDS = ("near_copy", "blend", "extrapolate")
CONTOURS = ("smooth", "polygon")
#: label knobs and their reference values (the reference convention)
LABEL_KNOBS = {"dilate": 0.0, "contour": "smooth", "vertices": 6, "include_adjacent": False, "noisy": False}
#: keys of one inside site in a preset
SITE_KEYS = ("template", "split", "radius_scale", *LABEL_KNOBS)
PRESET_KEYS = ("size", "depth", "inside", "outside", "outside_split", "near_copy_of", "outside_labels")
SPLIT_NAMES = ("training", "validation", "testing")
NOISY_OFFSET_PX = 2.0   # noisy site: per-case boundary offset, uniform in +-2 px at size 64
NOISY_WOBBLE_PX = 1.0   # ... plus a smooth boundary perturbation of ~1 px (std) at size 64
NOISY_SHIFT_PX = 2.0    # ... plus a per-case shift, uniform in +-2 px per axis at size 64
ADJACENT_DELTA = 0.15   # the adjacent structure is this much brighter than the organ (before gamma)
NEAR_COPY_JITTER = 0.05
#: extrapolate outside site: factor x (max | min) of the inside sites (gamma, bias above their max; noise,
#: organ-background contrast and resolution below their min)
EXTRAPOLATE = {"gamma": 1.15, "bias": 1.15, "noise": 0.8, "contrast": 0.85, "px": 0.9}

PRESETS: dict[str, dict] = {
    "bench": {
        "size": 64,
        "depth": 8,
        "inside": (
            {"template": 1, "split": (24, 2, 5), "radius_scale": 1.0},
            {"template": 2, "split": (12, 2, 5), "radius_scale": 0.9, "dilate": 1.0, "include_adjacent": True},
            {"template": 3, "split": (6, 2, 5), "radius_scale": 1.2, "dilate": 2.0, "contour": "polygon",
             "vertices": 6},
            {"template": 4, "split": (3, 2, 5), "radius_scale": 1.0, "noisy": True},
            {"template": 5, "split": (2, 2, 5), "radius_scale": 1.1, "dilate": -2.0, "include_adjacent": True},
        ),
        "outside": ("blend",),
        "outside_split": (24, 4, 10),
        "near_copy_of": "site-2",
        "outside_labels": {},
    },
}
#: the bench scaled down: its first three inside sites with fewer training cases, a smaller outside site, 48 px
PRESETS["demo"] = {**PRESETS["bench"], "size": 48, "outside_split": (10, 2, 8),
                   "inside": tuple({**site, "split": (n_train, 2, 5)}
                                   for site, n_train in zip(PRESETS["bench"]["inside"][:3], (12, 6, 3)))}


def _inside_profiles(n_inside: int, seed: int, task: str) -> list[dict]:
    """The jittered inside templates (site-1 .. site-n_inside), in the order site_profiles draws them."""
    rng = np.random.default_rng([seed, 7919])
    profiles = []
    for i in range(n_inside):
        p = dict(zip(_KEYS, _PROSTATE[i % len(_PROSTATE)]))
        if task == "fundus":
            p.update(zip(_FUNDUS_KEYS, _FUNDUS[i % len(_FUNDUS)]))
        for key in p:
            if key not in _NO_JITTER:
                p[key] = float(p[key] * (1 + 0.05 * rng.uniform(-1, 1)))
        p["angle"] = float(0.4 * (i % 3 - 1))
        profiles.append({"site": f"site-{i + 1}", "kind": "inside", **p})
    return profiles


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {TASKS}")


def _mean_profile(inside: list[dict]) -> dict:
    """The inside sites' mean anatomy and appearance (n_distractors rounded)."""
    keys = [k for k in inside[0] if isinstance(inside[0][k], (int, float)) and not isinstance(inside[0][k], bool)
            and k not in ("radius_scale", "dilate", "vertices", "template")]
    mean = {k: float(np.mean([p[k] for p in inside])) for k in keys}
    mean["n_distractors"] = int(round(mean["n_distractors"]))
    return mean


def site_profiles(n_sites: int = 6, seed: int = 0, task: str = "prostate") -> list[dict]:
    """Per-site generation parameters without a preset (see the module docstring for the table).

    Args:
        n_sites: Number of sites (>= 1). With 3 or more, the last one is the outside site.
        seed: Jitters each continuous parameter by up to +-5 % (deterministic).
        task: "prostate" or "fundus".

    Returns:
        One dict per site with ``site``, ``kind`` ("inside" | "outside") and the parameters; the
        outside site's anatomy/appearance values are the inside mean (for reference only: its cases
        blend two inside sites each) and ``blend_of`` lists the inside sites.
    """
    _check_task(task)
    if n_sites < 1:
        raise ValueError(f"n_sites={n_sites}: need at least 1")
    n_inside = n_sites - 1 if n_sites >= 3 else n_sites
    profiles = _inside_profiles(n_inside, seed, task)
    if n_sites >= 3:
        mean = {k: float(np.mean([p[k] for p in profiles])) for k in profiles[0] if k not in ("site", "kind")}
        mean["n_distractors"] = int(round(mean["n_distractors"]))
        mean.update(_OUTSIDE)
        profiles.append({"site": f"site-{n_sites}", "kind": "outside", **mean,
                         "blend_of": [p["site"] for p in profiles]})
    return profiles


def _resolve_preset(preset: str | dict, outside: tuple[str, ...] | list[str] | None = None) -> dict:
    """The preset's dict (a name in PRESETS or a dict of the same form), checked, with ``outside`` kinds
    (default the preset's) in its "outside"."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r}: expected one of {sorted(PRESETS)} or a dict like PRESETS['bench']")
        spec = PRESETS[preset]
    elif isinstance(preset, dict):
        spec = preset
    else:
        raise ValueError(f"preset={preset!r}: expected a name in {sorted(PRESETS)} or a dict")
    unknown = sorted(set(spec) - set(PRESET_KEYS))
    if unknown or "inside" not in spec or not spec["inside"]:
        raise ValueError(f"preset: unknown key(s) {unknown} or no 'inside' sites; known keys are {PRESET_KEYS}")
    for i, site in enumerate(spec["inside"]):
        bad = sorted(set(site) - set(SITE_KEYS))
        if bad or "template" not in site or "split" not in site:
            raise ValueError(f"preset inside site {i + 1}: unknown key(s) {bad} or no 'template'/'split'; "
                             f"known keys are {SITE_KEYS}")
        if site.get("contour", "smooth") not in CONTOURS:
            raise ValueError(f"preset inside site {i + 1}: contour={site['contour']!r}, expected one of {CONTOURS}")
    bad = sorted(set(spec.get("outside_labels", {})) - set(LABEL_KNOBS))
    if bad:
        raise ValueError(f"preset outside_labels: unknown key(s) {bad}; known keys are {tuple(LABEL_KNOBS)}")
    kinds = tuple(spec.get("outside", ()) if outside is None else outside)
    bad = [k for k in kinds if k not in OUTSIDE_KINDS]
    if bad:
        raise ValueError(f"outside={kinds!r}: unknown kind(s) {bad}; expected some of {OUTSIDE_KINDS}")
    return {**spec, "outside": kinds}


def _split_counts(split) -> dict[str, int]:
    counts = [int(n) for n in split]
    if len(counts) != 3 or min(counts) < 0 or counts[0] < 1:
        raise ValueError(f"split={tuple(split)!r}: expected (n_train >= 1, n_val >= 0, n_test >= 0)")
    return dict(zip(SPLIT_NAMES, counts))


def preset_profiles(
    preset: str | dict,
    seed: int = 0,
    task: str = "prostate",
    outside: tuple[str, ...] | list[str] | None = None,
    near_copy_of: str | None = None,
) -> list[dict]:
    """Per-site generation parameters of a preset (nothing rendered).

    Args:
        preset: A name in :data:`PRESETS` or a dict of the same form.
        seed: The data seed: jitters every template number by up to +-5 % (and the near copy's by
            another +-5 %).
        task: "prostate" or "fundus".
        outside: Outside-site kinds (from :data:`OUTSIDE_KINDS`, repeats allowed); default the preset's.
        near_copy_of: The inside site a ``near_copy`` outside site copies; default the preset's.

    Returns:
        One dict per site (inside sites ``site-1..site-K``, then the outside sites ``site-K+1..``) with
        ``site``, ``kind`` ("inside" | "outside"), ``outside_kind`` (outside sites), ``split``
        ({"training", "validation", "testing"}: cases), the label knobs (:data:`LABEL_KNOBS`),
        ``radius_scale`` and the appearance/anatomy parameters (``radius`` already scaled), plus
        ``copy_of`` (near_copy) or ``blend_of`` (blend).
    """
    _check_task(task)
    spec = _resolve_preset(preset, outside)
    kinds = spec["outside"]
    templates = _inside_profiles(max(int(s["template"]) for s in spec["inside"]), seed, task)
    profiles = []
    for i, site in enumerate(spec["inside"]):
        p = {**templates[int(site["template"]) - 1], "site": f"site-{i + 1}", "template": int(site["template"])}
        p["radius_scale"] = float(site.get("radius_scale", 1.0))
        p["radius"] = p["radius"] * p["radius_scale"]
        p.update({k: site.get(k, v) for k, v in LABEL_KNOBS.items()})
        p["dilate"] = float(p["dilate"])
        p["split"] = _split_counts(site["split"])
        p["adjacent_structure"] = True
        profiles.append(p)
    inside = list(profiles)
    names = [p["site"] for p in inside]
    copy_of = near_copy_of or spec.get("near_copy_of") or names[0]
    if "near_copy" in kinds and copy_of not in names:
        raise ValueError(f"near_copy_of={copy_of!r}: expected one of the inside sites {names}")
    labels = {**LABEL_KNOBS, **spec.get("outside_labels", {})}
    split = _split_counts(spec.get("outside_split", (24, 4, 10)))
    jitter = np.random.default_rng([seed, 7919, 3])
    mean = _mean_profile(inside)
    for j, kind in enumerate(kinds):
        base = {"site": f"site-{len(inside) + j + 1}", "kind": "outside", "outside_kind": kind}
        if kind == "near_copy":
            src = next(p for p in inside if p["site"] == copy_of)
            p = {**src, **base, "copy_of": copy_of}
            for key in _KEYS:
                if key not in _NO_JITTER:
                    p[key] = float(p[key] * (1 + NEAR_COPY_JITTER * jitter.uniform(-1, 1)))
        elif kind == "blend":
            p = {**base, **mean, **_OUTSIDE, **labels, "blend_of": names}
        else:  # extrapolate: beyond the inside sites' range in gamma, bias, noise, contrast and resolution
            p = {**base, **mean, **labels}
            for key in ("gamma", "bias"):
                p[key] = EXTRAPOLATE[key] * max(q[key] for q in inside)
            for key in ("noise", "px"):
                p[key] = EXTRAPOLATE[key] * min(q[key] for q in inside)
            p["organ"] = p["bg"] + EXTRAPOLATE["contrast"] * min(q["organ"] - q["bg"] for q in inside)
        p.update({"split": dict(split), "adjacent_structure": True})
        p.setdefault("radius_scale", 1.0)
        profiles.append(p)
    return profiles


def preset_sites(
    preset: str | dict,
    outside: tuple[str, ...] | list[str] | None = None,
    near_copy_of: str | None = None,
    size: int | None = None,
    depth: int | None = None,
) -> dict:
    """What a preset makes, without rendering: the sites, their kinds and cases per split.

    Args:
        preset, outside, near_copy_of: As for :func:`make_synthetic`.
        size, depth: Override the preset's (as make_synthetic's arguments do).

    Returns:
        {"size", "depth", "inside": [site, ...], "outside": [site, ...], "kinds": {site: "inside" |
        outside kind}, "cases": {site: {split: n}}, "test_cases": {site: n}, "slices": {site: {split: n}}}.
    """
    spec = _resolve_preset(preset)
    size, depth = int(size or spec.get("size", 64)), int(depth or spec.get("depth", 8))
    profiles = preset_profiles(preset, 0, "prostate", outside, near_copy_of)
    return {
        "size": size,
        "depth": depth,
        "inside": [p["site"] for p in profiles if p["kind"] == "inside"],
        "outside": [p["site"] for p in profiles if p["kind"] == "outside"],
        "kinds": {p["site"]: p.get("outside_kind", "inside") for p in profiles},
        "cases": {p["site"]: dict(p["split"]) for p in profiles},
        "test_cases": {p["site"]: p["split"]["testing"] for p in profiles},
        "slices": {p["site"]: {k: n * depth for k, n in p["split"].items()} for p in profiles},
    }


def make_synthetic(
    out: str | Path,
    task: str = "prostate",
    n_sites: int | None = None,
    seed: int = 0,
    cases: int | list[int] | None = None,
    size: int | None = None,
    depth: int | None = None,
    preset: str | dict | None = None,
    outside: tuple[str, ...] | list[str] | None = None,
    near_copy_of: str | None = None,
    say=None,
) -> Path:
    """Writes a synthetic multi-site data root.

    Without ``preset`` the sites are the templates of the module docstring (``n_sites``, ``cases``,
    splits ~60/20/20); the output is the same as before presets existed. With ``preset`` the preset
    sets the sites, their knobs, cases per split, size and depth; ``size``, ``depth``, ``task``,
    ``seed``, ``outside`` and ``near_copy_of`` given here win over the preset's, while ``n_sites``
    and ``cases`` conflict with it (ValueError; pass a dict preset instead).

    Args:
        out: Output folder (created): new, empty, or an earlier synthetic root of this task (rewritten);
            another data root or other files there are refused (DataError), never overwritten.
        task: "prostate" (one class) or "fundus" (disc and cup, nested).
        n_sites: Number of sites without a preset (default 6); the last is an outside site when >= 3.
        seed: Data seed (template jitter and every per-case stream); the same seed gives identical arrays.
        cases: Cases per site without a preset (one int for all, or a list of n_sites); default
            cycles [12, 10, 10, 8, 6] for inside sites and 10 for the outside site.
        size: Nominal in-plane size in pixels (default 64); each site renders ``round(size * px)``.
        depth: Slices per volume (last axis; default 12, a preset's 8).
        preset: A name in :data:`PRESETS` ("bench", "demo") or a dict of the same form.
        outside: With a preset: the outside sites' kinds, e.g. ("near_copy", "blend", "extrapolate").
        near_copy_of: With a preset: the inside site a near_copy outside site copies.
        say: Where progress lines go every 10 s while cases are rendered (``pflseg.progress``; default the
            ``pflseg.progress`` logger: FLARE's log at a site).

    Returns:
        The data root ``out``. With a preset, dataset.json also records ``train_size`` (= size) and
        ``site_profiles`` ({site: {"kind", "outside_kind", "split", knobs, parameters}}).
    """
    _check_task(task)
    if preset is None:
        if outside is not None or near_copy_of is not None:
            raise ValueError("outside / near_copy_of: need a preset (e.g. preset='bench')")
        profiles = site_profiles(6 if n_sites is None else n_sites, seed, task)
        counts = _case_counts(profiles, cases)
        size, depth = 64 if size is None else size, 12 if depth is None else depth
    else:
        for name, value in (("n_sites", n_sites), ("cases", cases)):
            if value is not None:
                raise ValueError(f"{name}={value!r}: the preset sets the sites and their cases; leave {name} out "
                                 "(CLI: --sites) or pass a dict preset, e.g. dict(PRESETS['bench'], inside=...)")
        spec = _resolve_preset(preset)
        profiles = preset_profiles(preset, seed, task, outside, near_copy_of)
        counts = [sum(p["split"].values()) for p in profiles]
        size = int(spec.get("size", 64)) if size is None else size
        depth = int(spec.get("depth", 8)) if depth is None else depth
    if size < 8 or depth < 1:
        raise ValueError(f"size={size}, depth={depth}: need size >= 8 and depth >= 1")
    out = Path(out)
    claim_out(out, name=f"synthetic-{task}", layout="synthetic", writes=[p["site"] for p in profiles])
    inside = [p for p in profiles if p["kind"] == "inside"]
    import nibabel as nib

    progress = Progress(f"synthetic {task} data in {out}", total=sum(counts), unit="cases", say=say)
    for profile, n_cases in zip(profiles, counts):
        site = profile["site"]
        site_dir = out / site
        private_dir(site_dir / "imagesTr")
        private_dir(site_dir / "labelsTr")
        n_px = _n_px(size, profile["px"])
        spacing = FOV_MM / n_px
        affine = np.diag([spacing, spacing, SLICE_MM, 1.0])
        names = [f"case{c:03d}" for c in range(n_cases)]
        for c, name in enumerate(names):
            image, label = render_case(profile, seed, c, size, depth, task, inside)
            nib.save(nib.Nifti1Image(image, affine), str(site_dir / "imagesTr" / f"{name}.nii.gz"))
            nib.save(nib.Nifti1Image(label, affine), str(site_dir / "labelsTr" / f"{name}.nii.gz"))
            progress.step()
        if preset is None:
            split = split_cases(names, seed, site, 0.2, 0.2)
        else:
            split = _fixed_split(names, seed, site, profile["split"]["validation"], profile["split"]["testing"])
        entries: dict[str, list[dict]] = {}
        for name in names:
            entry = {"image": f"imagesTr/{name}.nii.gz", "label": f"labelsTr/{name}.nii.gz", "case": name}
            entries.setdefault(split[name], []).append(entry)
        write_datalist(site_dir, site, entries)
    extra = {}
    if preset is not None:
        extra["train_size"] = size
        extra["site_profiles"] = {p["site"]: _record(p, size, depth) for p in profiles}
    write_dataset_json(
        out,
        name=f"synthetic-{task}",
        task=task,
        classes=["prostate"] if task == "prostate" else ["disc", "cup"],
        label_encoding="nested",
        in_channels=1,
        sites=[p["site"] for p in profiles],
        layout="synthetic",
        **extra,
    )
    progress.done()
    return out


def _record(profile: dict, size: int, depth: int) -> dict:
    """A site's entry in dataset.json's ``site_profiles``: kind first, then knobs, split and parameters."""
    head = ("kind", "outside_kind", "copy_of", "blend_of", "template", "split", "radius_scale", *LABEL_KNOBS)
    body = {k: profile[k] for k in head if k in profile}
    body["n_px"] = _n_px(size, profile["px"])
    body["slices"] = {k: n * depth for k, n in profile["split"].items()}
    body.update({k: v for k, v in profile.items() if k not in body and k != "site"})
    return body


def _n_px(size: int, px: float) -> int:
    """Rendered in-plane pixels of a site with relative resolution ``px`` (even, >= 8)."""
    return max(8, int(round(size * px / 2)) * 2)


def _fixed_split(names: list[str], seed: int, site: str, n_val: int, n_test: int) -> dict[str, str]:
    """Case -> split with fixed counts: ``n_test`` testing, ``n_val`` validation, the rest training."""
    if n_val + n_test >= len(names):
        raise ValueError(f"[{site}] {len(names)} cases: need more than n_val + n_test = {n_val + n_test}")
    rng = np.random.default_rng([seed, zlib.crc32(site.encode())])
    order = [names[i] for i in rng.permutation(len(names))]
    split = {c: "testing" for c in order[:n_test]}
    split.update({c: "validation" for c in order[n_test:n_test + n_val]})
    split.update({c: "training" for c in order[n_test + n_val:]})
    return split


def _case_counts(profiles: list[dict], cases: int | list[int] | None) -> list[int]:
    """Cases per site from the ``cases`` argument (see :func:`make_synthetic`)."""
    if cases is None:
        return [_OUTSIDE_CASES if p["kind"] == "outside" else _DEFAULT_CASES[i % len(_DEFAULT_CASES)]
                for i, p in enumerate(profiles)]
    counts = [int(cases)] * len(profiles) if isinstance(cases, int) else [int(c) for c in cases]
    if len(counts) != len(profiles) or min(counts) < 1:
        raise ValueError(f"cases={cases!r}: need one positive count per site ({len(profiles)} sites)")
    return counts


def render_case(
    profile: dict,
    seed: int,
    case: int,
    size: int,
    depth: int,
    task: str = "prostate",
    inside: list[dict] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Renders case number ``case`` of a site, as :func:`make_synthetic` writes it.

    The image comes from the stream ``(seed, site, case)`` (and ``(seed, site, case, 1)`` for the
    adjacent structure); the label knobs draw from ``(seed, site, case, 2)`` only, so a profile that
    differs in label knobs alone gives the same image.

    Args:
        profile: One dict of :func:`site_profiles` or :func:`preset_profiles`.
        seed: Data seed.
        case: Case index at the site.
        size: Nominal size; the site renders ``round(size * px)`` pixels.
        depth: Slices.
        task: "prostate" or "fundus".
        inside: The inside sites' profiles (needed by a blend outside site).

    Returns:
        float32 image and uint8 label, both (n_px, n_px, depth).
    """
    site = profile["site"]
    n_px = _n_px(size, profile["px"])
    rng = np.random.default_rng([seed, zlib.crc32(site.encode()), case])
    styled = "contour" in profile
    p = profile
    if profile["kind"] == "outside" and profile.get("outside_kind", "blend") == "blend":
        p = _blend(profile, inside or [], rng)
        if styled:
            p.update({k: profile[k] for k in (*LABEL_KNOBS, "adjacent_structure")})
    if not styled:
        image, label, _ = _render(p, rng, n_px, depth, task)
        return image, label
    extra = np.random.default_rng([seed, zlib.crc32(site.encode()), case, 1])
    image, _, fields = _render(p, rng, n_px, depth, task, extra)
    label = _style_label(p, fields, np.random.default_rng([seed, zlib.crc32(site.encode()), case, 2]), n_px)
    return image, label


def _blend(outside: dict, inside: list[dict], rng: np.random.Generator) -> dict:
    """Outside-site case parameters: two random inside sites mixed with weight w in [0.25, 0.75]."""
    if not inside:
        raise ValueError(f"{outside['site']}: a blend outside site needs the inside sites' profiles")
    i, j = rng.choice(len(inside), size=2, replace=len(inside) < 2)
    w = rng.uniform(0.25, 0.75)
    p = {k: w * inside[i][k] + (1 - w) * inside[j][k] for k in inside[0]
         if isinstance(inside[0][k], float) and k not in ("radius_scale", "dilate")}
    p["n_distractors"] = int(rng.choice([inside[i]["n_distractors"], inside[j]["n_distractors"]]))
    p.update({k: outside[k] for k in _APPEARANCE if k in ("px", "noise", "blur", "scale", "offset")})
    return p


def _field(rng: np.random.Generator, grid: tuple, n_waves: int, freq: float) -> np.ndarray:
    """Smooth random field (sum of random plane waves), roughly unit variance, shape of the grid."""
    x, y, z = grid
    out = np.zeros(np.broadcast_shapes(x.shape, y.shape, z.shape), np.float32)
    for _ in range(n_waves):
        fx, fy, fz = rng.normal(0.0, freq, 3)
        phase = rng.uniform(0, 2 * np.pi)
        # cos(a + b + c) from separable complex exponentials: cheap on a 3D grid.
        wave = np.exp(1j * (np.pi * fx * x + phase)) * np.exp(1j * np.pi * fy * y) * np.exp(1j * np.pi * 0.3 * fz * z)
        out += wave.real.astype(np.float32)
    return out * np.float32(np.sqrt(2.0 / n_waves))


def _ellipsoid(grid, centre, radii, angle, wobble) -> np.ndarray:
    """Normalised ellipsoid distance (< 1 inside), rotated in-plane and deformed by ``wobble``."""
    x, y, z = grid
    u = (x - centre[0]) * np.cos(angle) + (y - centre[1]) * np.sin(angle)
    v = -(x - centre[0]) * np.sin(angle) + (y - centre[1]) * np.cos(angle)
    return np.sqrt((u / radii[0]) ** 2 + (v / radii[1]) ** 2 + ((z - centre[2]) / radii[2]) ** 2) + wobble


def _grid(n_px: int, depth: int) -> tuple:
    lin = ((np.arange(n_px) + 0.5) / n_px * 2 - 1).astype(np.float32)
    zs = ((np.arange(depth) + 0.5) / depth * 2 - 1).astype(np.float32)
    return lin[:, None, None], lin[None, :, None], zs[None, None, :]


def _signed(d: np.ndarray) -> np.ndarray:
    """In-plane signed distance in pixels (< 0 inside) to the level set ``d == 1`` (first order)."""
    g = np.hypot(np.gradient(d, axis=0), np.gradient(d, axis=1))
    return ((d - 1) / np.maximum(g, 1e-6)).astype(np.float32)


def _render(p: dict, rng: np.random.Generator, n_px: int, depth: int, task: str,
            extra: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray, dict | None]:
    """Renders one case: float32 image, uint8 label (n_px, n_px, depth), and with ``extra`` the label geometry.

    With ``extra`` (presets) an adjacent structure is drawn (when ``p["adjacent_structure"]``) from the
    ``extra`` stream, and the third value holds in-plane signed distances (pixels): "organ", "adjacent",
    and "cup" for fundus. Without it the draws and arrays are those of the generator before presets.
    """
    grid = _grid(n_px, depth)
    fundus = task == "fundus"
    jit = lambda v, s=0.05: v * (1 + rng.uniform(-s, s))  # noqa: E731  per-case intensity jitter

    radius = p["radius"] * rng.uniform(0.85, 1.15)
    ecc = p["ecc"] * rng.uniform(0.9, 1.1)
    centre = (p["cx"] + rng.normal(0, 0.04), p["cy"] + rng.normal(0, 0.04), rng.normal(0, 0.08))
    angle = p["angle"] + rng.uniform(-0.3, 0.3)
    radii = (radius * np.sqrt(ecc), radius / np.sqrt(ecc), 4.0 if fundus else 0.75)
    wobble = 0.12 * _field(rng, grid, 4, 1.5)
    organ_d = _ellipsoid(grid, centre, radii, angle, wobble)
    organ = organ_d < 1
    texture = _field(rng, grid, 6, 6.0)

    if fundus:
        image = np.full(organ.shape, jit(p["bg"]), np.float32) * (1 + p["texture"] * texture)
    else:
        body = _ellipsoid(grid, (0, 0, 0), (0.92, 0.8, 50.0), 0.0, 0.05 * wobble) < 1
        image = np.where(body, jit(p["bg"]) * (1 + p["texture"] * texture), 0.05).astype(np.float32)

    for _ in range(int(p["n_distractors"])):  # blobs of the wrong brightness, away from the organ
        r = radius * rng.uniform(0.35, 0.6) if fundus else radius * rng.uniform(0.5, 0.9)
        for _try in range(20):
            c = rng.uniform(-0.7, 0.7, 2)
            if np.hypot(c[0] - centre[0], c[1] - centre[1]) > radius * 1.3 + r:
                break
        blob = _ellipsoid(grid, (c[0], c[1], rng.normal(0, 0.2)), (r, r * rng.uniform(0.7, 1.3), 0.6),
                          rng.uniform(0, np.pi), 0.5 * wobble) < 1
        image[blob] = (jit(p["distractor"]) * (1 + p["texture"] * texture))[blob]

    fields = None if extra is None else {"organ": _signed(organ_d)}
    if extra is not None and p.get("adjacent_structure"):
        # touching the organ on one side (like the seminal vesicles at the gland's base: upper slices),
        # brighter than the organ; labelled only where the site's convention includes it
        theta = angle + np.pi / 2 + extra.uniform(-0.4, 0.4)
        alpha = theta - angle  # the organ's extent towards theta, then the adjacent's half width 0.4 r, overlapping
        reach = 1 / np.hypot(np.cos(alpha) / radii[0], np.sin(alpha) / radii[1])
        dist = reach + 0.4 * radius * extra.uniform(0.4, 0.8)
        adj_c = (centre[0] + dist * np.cos(theta), centre[1] + dist * np.sin(theta), centre[2] + 0.3)
        adj_d = _ellipsoid(grid, adj_c, (radius * 0.8, radius * 0.4, 0.5 if not fundus else 4.0), theta + np.pi / 2,
                           0.5 * wobble)
        adjacent = adj_d < 1
        value = (p["organ"] + ADJACENT_DELTA) * (1 + extra.uniform(-0.05, 0.05))
        image[adjacent] = (value * (1 + p["texture"] * texture))[adjacent]
        fields["adjacent"] = _signed(adj_d)

    label = organ.astype(np.uint8)
    image[organ] = (jit(p["organ"]) * (1 + 0.5 * p["texture"] * _field(rng, grid, 4, 4.0)))[organ]
    if fundus:
        off = rng.normal(0, 0.15, 2) * radius * (1 - p["cdr"])
        cup_r = radius * p["cdr"] * rng.uniform(0.9, 1.1)
        cup_d = _ellipsoid(grid, (centre[0] + off[0], centre[1] + off[1], centre[2]),
                           (cup_r * np.sqrt(ecc), cup_r / np.sqrt(ecc), 4.0), angle, 0.5 * wobble)
        cup = (cup_d < 1) & organ
        if fields is not None:
            fields["cup"] = np.maximum(_signed(cup_d), fields["organ"])
        label[cup] = 2
        image[cup] = jit(p["inner"])
        for _ in range(int(rng.integers(3, 6))):  # dark vessels crossing the disc
            theta = rng.uniform(0, np.pi)
            dist = np.abs(-(grid[0] - centre[0]) * np.sin(theta) + (grid[1] - centre[1]) * np.cos(theta)
                          + 0.05 * wobble)
            image = np.where(dist < rng.uniform(0.01, 0.03), image * (1 - p["vessel"]), image)

    image = _blur(image, p["blur"])
    image = image * np.exp(p["bias"] * _field(rng, grid, 3, 0.8))
    image = np.clip(image, 0, None) ** p["gamma"]
    image = np.abs(image + p["noise"] * rng.standard_normal(image.shape, dtype=np.float32))
    image = image * p["scale"] + p["offset"]
    return image.astype(np.float32), label, fields


def _style_label(p: dict, fields: dict, rng: np.random.Generator, n_px: int) -> np.ndarray:
    """The site's label convention applied to the case's geometry: uint8 (n_px, n_px, depth), nested classes.

    Order: inclusion (organ or organ + adjacent structure), boundary offset (``dilate`` px at size 64,
    scaled to ``n_px``; plus the noisy site's per-case offset and smooth perturbation), polygon contour,
    then the noisy site's per-case shift.
    """
    scale = n_px / REFERENCE_SIZE
    outer = fields["organ"]
    if p["include_adjacent"] and "adjacent" in fields:
        outer = np.minimum(outer, fields["adjacent"])
    classes = [outer] + ([np.maximum(fields["cup"], outer)] if "cup" in fields else [])
    offset = np.float32(p["dilate"] * scale)
    shift = (0, 0)
    if p["noisy"]:
        depth = outer.shape[2]
        wobble = _field(rng, _grid(n_px, depth), 4, 2.0)
        offset = offset + scale * (NOISY_OFFSET_PX * rng.uniform(-1, 1) + NOISY_WOBBLE_PX * wobble)
        shift = tuple(int(v) for v in np.rint(NOISY_SHIFT_PX * scale * rng.uniform(-1, 1, 2)))
    masks = [s < offset for s in classes]
    if p["contour"] == "polygon":
        masks = [_polygon(m, int(p["vertices"]), rng) for m in masks]
    if shift != (0, 0):
        masks = [_shift(m, shift) for m in masks]
    label = masks[0].astype(np.uint8)
    for m in masks[1:]:
        label += (m & masks[0]).astype(np.uint8)
    return label


def _polygon(mask: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Each slice's mask redrawn as a polygon of ``n`` vertices on its boundary (a coarse manual contour).

    The vertices sit where rays from the slice's centroid at equally spaced angles (random phase per
    slice) leave the mask; the polygon is filled by pixel centre. Slices with < 3 pixels stay as they are.
    """
    nx, ny, nz = mask.shape
    out = mask.copy()
    steps = np.arange(0.0, float(np.hypot(nx, ny)), 0.25)
    xs = np.arange(nx, dtype=np.float64)[:, None]
    ys = np.arange(ny, dtype=np.float64)[None, :]
    for z in range(nz):
        m = mask[..., z]
        if m.sum() < 3:
            continue
        ix, iy = np.nonzero(m)
        cx, cy = ix.mean(), iy.mean()
        theta = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.arange(n) / n
        qx = np.rint(cx + np.cos(theta)[:, None] * steps).astype(int)
        qy = np.rint(cy + np.sin(theta)[:, None] * steps).astype(int)
        ok = (qx >= 0) & (qx < nx) & (qy >= 0) & (qy < ny)
        hit = np.zeros(ok.shape, bool)
        hit[ok] = m[qx[ok], qy[ok]]
        first_out = np.where(hit.all(axis=1), len(steps), np.argmin(hit, axis=1))
        r = steps[np.maximum(first_out - 1, 0)]
        vx, vy = r * np.cos(theta), r * np.sin(theta)
        px, py = xs - cx, ys - cy
        phi = np.arctan2(py, px)
        j = np.floor(((phi - theta[0]) % (2 * np.pi)) / (2 * np.pi / n)).astype(int) % n
        k = (j + 1) % n
        dx, dy = vx[k] - vx[j], vy[k] - vy[j]
        num = vx[j] * dy - vy[j] * dx
        den = np.cos(phi) * dy - np.sin(phi) * dx
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(np.abs(den) > 1e-9, num / den, 0.0)
        out[..., z] = np.hypot(px, py) <= t
    return out


def _shift(mask: np.ndarray, shift: tuple[int, int]) -> np.ndarray:
    """In-plane shift by whole pixels, zero-filled."""
    out = np.zeros_like(mask)
    (dx, dy), (nx, ny) = shift, mask.shape[:2]
    out[max(dx, 0):nx + min(dx, 0), max(dy, 0):ny + min(dy, 0)] = mask[max(-dx, 0):nx - max(dx, 0),
                                                                       max(-dy, 0):ny - max(dy, 0)]
    return out


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """In-plane Gaussian blur (sigma in pixels) through the FFT; sigma <= 0.1 returns the input."""
    if sigma <= 0.1:
        return image
    fx = np.fft.fftfreq(image.shape[0])[:, None, None]
    fy = np.fft.rfftfreq(image.shape[1])[None, :, None]
    gain = np.exp(-2 * (np.pi * sigma) ** 2 * (fx**2 + fy**2))
    return np.fft.irfft2(np.fft.rfft2(image, axes=(0, 1)) * gain, s=image.shape[:2], axes=(0, 1)).astype(np.float32)
