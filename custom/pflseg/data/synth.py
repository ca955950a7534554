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
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from pflseg.data.datalist import split_cases, write_dataset_json, write_datalist

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


def site_profiles(n_sites: int = 6, seed: int = 0, task: str = "prostate") -> list[dict]:
    """Per-site generation parameters (see the module docstring for the table).

    Args:
        n_sites: Number of sites (>= 1). With 3 or more, the last one is the outside site.
        seed: Jitters each continuous parameter by up to +-5 % (deterministic).
        task: "prostate" or "fundus".

    Returns:
        One dict per site with ``site``, ``kind`` ("inside" | "outside") and the parameters; the
        outside site's anatomy/appearance values are the inside mean (for reference only: its cases
        blend two inside sites each) and ``blend_of`` lists the inside sites.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r}: expected one of {TASKS}")
    if n_sites < 1:
        raise ValueError(f"n_sites={n_sites}: need at least 1")
    n_inside = n_sites - 1 if n_sites >= 3 else n_sites
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
    if n_sites >= 3:
        mean = {k: float(np.mean([p[k] for p in profiles])) for k in profiles[0] if k not in ("site", "kind")}
        mean["n_distractors"] = int(round(mean["n_distractors"]))
        mean.update(_OUTSIDE)
        profiles.append({"site": f"site-{n_sites}", "kind": "outside", **mean,
                         "blend_of": [p["site"] for p in profiles]})
    return profiles


def make_synthetic(
    out: str | Path,
    task: str = "prostate",
    n_sites: int = 6,
    seed: int = 0,
    cases: int | list[int] | None = None,
    size: int = 64,
    depth: int = 12,
) -> Path:
    """Writes a synthetic multi-site data root.

    Args:
        out: Output folder (created; existing files with the same names are overwritten).
        task: "prostate" (one class) or "fundus" (disc and cup, nested).
        n_sites: Number of sites; the last is an outside site when n_sites >= 3.
        seed: Random seed; the same seed gives identical arrays.
        cases: Cases per site (one int for all, or a list of n_sites); default cycles
            [12, 10, 10, 8, 6] for inside sites and 10 for the outside site.
        size: Nominal in-plane size in pixels; each site renders ``round(size * px)`` pixels.
        depth: Slices per volume (last axis).

    Returns:
        The data root ``out``.
    """
    profiles = site_profiles(n_sites, seed, task)
    counts = _case_counts(profiles, cases)
    if size < 8 or depth < 1:
        raise ValueError(f"size={size}, depth={depth}: need size >= 8 and depth >= 1")
    out = Path(out)
    inside = [p for p in profiles if p["kind"] == "inside"]
    import nibabel as nib

    for profile, n_cases in zip(profiles, counts):
        site = profile["site"]
        site_dir = out / site
        (site_dir / "imagesTr").mkdir(parents=True, exist_ok=True)
        (site_dir / "labelsTr").mkdir(parents=True, exist_ok=True)
        n_px = max(8, int(round(size * profile["px"] / 2)) * 2)
        spacing = FOV_MM / n_px
        affine = np.diag([spacing, spacing, SLICE_MM, 1.0])
        names = [f"case{c:03d}" for c in range(n_cases)]
        for c, name in enumerate(names):
            rng = np.random.default_rng([seed, zlib.crc32(site.encode()), c])
            p = _blend(profile, inside, rng) if profile["kind"] == "outside" else profile
            image, label = _render(p, rng, n_px, depth, task)
            nib.save(nib.Nifti1Image(image, affine), str(site_dir / "imagesTr" / f"{name}.nii.gz"))
            nib.save(nib.Nifti1Image(label, affine), str(site_dir / "labelsTr" / f"{name}.nii.gz"))
        split = split_cases(names, seed, site, 0.2, 0.2)
        entries: dict[str, list[dict]] = {}
        for name in names:
            entry = {"image": f"imagesTr/{name}.nii.gz", "label": f"labelsTr/{name}.nii.gz", "case": name}
            entries.setdefault(split[name], []).append(entry)
        write_datalist(site_dir, site, entries)
    write_dataset_json(
        out,
        name=f"synthetic-{task}",
        task=task,
        classes=["prostate"] if task == "prostate" else ["disc", "cup"],
        label_encoding="nested",
        in_channels=1,
        sites=[p["site"] for p in profiles],
        layout="synthetic",
    )
    return out


def _case_counts(profiles: list[dict], cases: int | list[int] | None) -> list[int]:
    """Cases per site from the ``cases`` argument (see :func:`make_synthetic`)."""
    if cases is None:
        return [_OUTSIDE_CASES if p["kind"] == "outside" else _DEFAULT_CASES[i % len(_DEFAULT_CASES)]
                for i, p in enumerate(profiles)]
    counts = [int(cases)] * len(profiles) if isinstance(cases, int) else [int(c) for c in cases]
    if len(counts) != len(profiles) or min(counts) < 1:
        raise ValueError(f"cases={cases!r}: need one positive count per site ({len(profiles)} sites)")
    return counts


def _blend(outside: dict, inside: list[dict], rng: np.random.Generator) -> dict:
    """Outside-site case parameters: two random inside sites mixed with weight w in [0.25, 0.75]."""
    i, j = rng.choice(len(inside), size=2, replace=len(inside) < 2)
    w = rng.uniform(0.25, 0.75)
    p = {k: w * inside[i][k] + (1 - w) * inside[j][k] for k in inside[0]
         if isinstance(inside[0][k], float)}
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


def _render(p: dict, rng: np.random.Generator, n_px: int, depth: int, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Renders one case: float32 image and uint8 label, both (n_px, n_px, depth)."""
    lin = ((np.arange(n_px) + 0.5) / n_px * 2 - 1).astype(np.float32)
    zs = ((np.arange(depth) + 0.5) / depth * 2 - 1).astype(np.float32)
    grid = (lin[:, None, None], lin[None, :, None], zs[None, None, :])
    fundus = task == "fundus"
    jit = lambda v, s=0.05: v * (1 + rng.uniform(-s, s))  # noqa: E731  per-case intensity jitter

    radius = p["radius"] * rng.uniform(0.85, 1.15)
    ecc = p["ecc"] * rng.uniform(0.9, 1.1)
    centre = (p["cx"] + rng.normal(0, 0.04), p["cy"] + rng.normal(0, 0.04), rng.normal(0, 0.08))
    angle = p["angle"] + rng.uniform(-0.3, 0.3)
    radii = (radius * np.sqrt(ecc), radius / np.sqrt(ecc), 4.0 if fundus else 0.75)
    wobble = 0.12 * _field(rng, grid, 4, 1.5)
    organ = _ellipsoid(grid, centre, radii, angle, wobble) < 1
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

    label = organ.astype(np.uint8)
    image[organ] = (jit(p["organ"]) * (1 + 0.5 * p["texture"] * _field(rng, grid, 4, 4.0)))[organ]
    if fundus:
        off = rng.normal(0, 0.15, 2) * radius * (1 - p["cdr"])
        cup_r = radius * p["cdr"] * rng.uniform(0.9, 1.1)
        cup = (_ellipsoid(grid, (centre[0] + off[0], centre[1] + off[1], centre[2]),
                          (cup_r * np.sqrt(ecc), cup_r / np.sqrt(ecc), 4.0), angle, 0.5 * wobble) < 1) & organ
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
    return image.astype(np.float32), label


def _blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """In-plane Gaussian blur (sigma in pixels) through the FFT; sigma <= 0.1 returns the input."""
    if sigma <= 0.1:
        return image
    fx = np.fft.fftfreq(image.shape[0])[:, None, None]
    fy = np.fft.rfftfreq(image.shape[1])[None, :, None]
    gain = np.exp(-2 * (np.pi * sigma) ** 2 * (fx**2 + fy**2))
    return np.fft.irfft2(np.fft.rfft2(image, axes=(0, 1)) * gain, s=image.shape[:2], axes=(0, 1)).astype(np.float32)
