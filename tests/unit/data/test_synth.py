"""Tests of the synthetic multi-site generator."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from pflseg.data import make_synthetic, site_profiles


def _arrays(root, site, case):
    image = np.asarray(nib.load(str(root / site / "imagesTr" / f"{case}.nii.gz")).dataobj)
    label = np.asarray(nib.load(str(root / site / "labelsTr" / f"{case}.nii.gz")).dataobj)
    return image, label


def test_same_seed_identical_other_seed_differs(tmp_path):
    a = make_synthetic(tmp_path / "a", n_sites=3, cases=3, size=24, depth=3, seed=1)
    b = make_synthetic(tmp_path / "b", n_sites=3, cases=3, size=24, depth=3, seed=1)
    c = make_synthetic(tmp_path / "c", n_sites=3, cases=3, size=24, depth=3, seed=2)
    for site in ("site-1", "site-3"):
        ia, la = _arrays(a, site, "case001")
        ib, lb = _arrays(b, site, "case001")
        ic, _ = _arrays(c, site, "case001")
        assert ia.tobytes() == ib.tobytes() and la.tobytes() == lb.tobytes()
        assert not np.array_equal(ia, ic)
    assert (a / "site-1/datalist.json").read_text() == (b / "site-1/datalist.json").read_text()


def test_dataset_json_and_files(synth_root):
    info = json.loads((synth_root / "dataset.json").read_text())
    assert info == {"name": "synthetic-prostate", "task": "prostate", "classes": ["prostate"],
                    "label_encoding": "nested", "in_channels": 1, "sites": ["site-1", "site-2", "site-3"],
                    "layout": "synthetic"}
    image = nib.load(str(synth_root / "site-2/imagesTr/case000.nii.gz"))
    label = nib.load(str(synth_root / "site-2/labelsTr/case000.nii.gz"))
    n_px = round(32 * site_profiles(3)[1]["px"] / 2) * 2
    assert image.shape == label.shape == (n_px, n_px, 4)
    assert image.get_data_dtype() == np.float32 and label.get_data_dtype() == np.uint8
    assert np.isclose(image.header.get_zooms()[0], 160.0 / n_px)
    assert set(np.unique(np.asarray(label.dataobj))) <= {0, 1}


def test_sites_have_their_own_resolution(synth_root):
    shapes = {s: nib.load(str(synth_root / s / "imagesTr/case000.nii.gz")).shape[0]
              for s in ("site-1", "site-2", "site-3")}
    assert len(set(shapes.values())) == 3


@pytest.mark.parametrize("n_sites,cases", [(3, [5, 4, 3]), (6, None)])
def test_splits_case_level_disjoint_nonempty(tmp_path, synth_root, n_sites, cases):
    root = synth_root if n_sites == 3 else make_synthetic(tmp_path / "r", n_sites=6, size=16, depth=2)
    expected = cases or [12, 10, 10, 8, 6, 10]
    for k, site in enumerate(f"site-{i}" for i in range(1, n_sites + 1)):
        datalist = json.loads((root / site / "datalist.json").read_text())
        split_cases = {s: {e["case"] for e in datalist[s]} for s in ("training", "validation", "testing")}
        assert all(split_cases.values()), (site, split_cases)
        assert not (split_cases["training"] & split_cases["validation"])
        assert not (split_cases["training"] & split_cases["testing"])
        assert not (split_cases["validation"] & split_cases["testing"])
        assert sum(len(c) for c in split_cases.values()) == expected[k]
        assert len(split_cases["training"]) >= len(split_cases["testing"])


def test_fundus_labels_nested(tmp_path):
    root = make_synthetic(tmp_path / "f", task="fundus", n_sites=3, cases=2, size=32, depth=3)
    info = json.loads((root / "dataset.json").read_text())
    assert info["classes"] == ["disc", "cup"] and info["label_encoding"] == "nested"
    _, label = _arrays(root, "site-1", "case000")
    assert set(np.unique(label)) == {0, 1, 2}
    assert (label == 2).sum() < (label >= 1).sum()


def test_sites_differ_in_appearance_and_anatomy(tmp_path):
    root = make_synthetic(tmp_path / "d", n_sites=4, cases=4, size=32, depth=6)
    organ, contrast = {}, {}
    for site in ("site-1", "site-2", "site-3"):
        fractions, ratios = [], []
        for case in range(4):
            image, label = _arrays(root, site, f"case{case:03d}")
            fractions.append((label > 0).mean())
            z = (image - image.mean()) / image.std()
            ratios.append(z[label > 0].mean())
        organ[site], contrast[site] = np.mean(fractions), np.mean(ratios)
    assert organ["site-3"] > 1.5 * organ["site-2"]  # radius .30 vs .18
    assert max(contrast.values()) - min(contrast.values()) > 0.5


def test_outside_site_blends_inside_sites():
    profiles = site_profiles(6, seed=0)
    assert [p["kind"] for p in profiles] == ["inside"] * 5 + ["outside"]
    assert profiles[-1]["blend_of"] == [f"site-{i}" for i in range(1, 6)]
    assert site_profiles(6, seed=0) == profiles and site_profiles(6, seed=1) != profiles
    assert [p["kind"] for p in site_profiles(2)] == ["inside", "inside"]


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="task"):
        make_synthetic(tmp_path, task="liver")
    with pytest.raises(ValueError, match="cases"):
        make_synthetic(tmp_path, n_sites=3, cases=[1, 2])


# ---- presets and knobs ------------------------------------------------------------------------------

from pflseg.data import load_dataset_info, preset_profiles, preset_sites  # noqa: E402
from pflseg.data.synth import LABEL_KNOBS, PRESETS, render_case  # noqa: E402

TINY = {"size": 16, "depth": 2,
        "inside": [{"template": 1, "split": (2, 1, 1)},
                   {"template": 2, "split": (1, 1, 1), "dilate": 2.0, "include_adjacent": True}],
        "outside": ("near_copy", "blend", "extrapolate"), "outside_split": (1, 0, 1), "near_copy_of": "site-2"}


def test_preset_none_output_unchanged(tmp_path):
    # fingerprint of the generator before presets existed (labels exact, image sums to float32 precision)
    import hashlib

    root = make_synthetic(tmp_path / "r", n_sites=3, cases=2, size=16, depth=2, seed=4)
    digest, sums = hashlib.sha256(), []
    for site in ("site-1", "site-2", "site-3"):
        for case in ("case000", "case001"):
            image, label = _arrays(root, site, case)
            digest.update(label.tobytes())
            sums.append(image.astype(np.float64).sum())
    assert digest.hexdigest()[:16] == "3735ade3272169a3"
    np.testing.assert_allclose(sums, [121916.98, 115493.693, 50362.089, 53328.262, 88120.994, 89663.824], rtol=1e-5)
    assert "site_profiles" not in json.loads((root / "dataset.json").read_text())


def test_preset_seed_is_part_of_the_data(tmp_path):
    a, b, c = (make_synthetic(tmp_path / n, preset=TINY, seed=s) for n, s in (("a", 3), ("b", 3), ("c", 4)))
    for site in ("site-1", "site-5"):
        ia, la = _arrays(a, site, "case000")
        ib, lb = _arrays(b, site, "case000")
        ic, lc = _arrays(c, site, "case000")
        assert ia.tobytes() == ib.tobytes() and la.tobytes() == lb.tobytes()
        assert not np.array_equal(ia, ic) and not np.array_equal(la, lc)
    assert preset_profiles("bench", seed=3)[0] != preset_profiles("bench", seed=4)[0]


def test_preset_root_records_sites_splits_and_kinds(tmp_path):
    root = make_synthetic(tmp_path / "r", preset=TINY, seed=0)
    info = load_dataset_info(root)  # validates dataset.json
    profiles = info["site_profiles"]
    assert info["sites"] == [f"site-{i}" for i in range(1, 6)] and info["train_size"] == 16
    assert [profiles[s]["kind"] for s in info["sites"]] == ["inside"] * 2 + ["outside"] * 3
    assert [profiles[s].get("outside_kind") for s in info["sites"][2:]] == ["near_copy", "blend", "extrapolate"]
    assert profiles["site-3"]["copy_of"] == "site-2" and profiles["site-3"]["include_adjacent"] is True
    assert profiles["site-4"]["dilate"] == 0.0 and profiles["site-2"]["dilate"] == 2.0
    for site in info["sites"]:
        datalist = json.loads((root / site / "datalist.json").read_text())
        counts = {k: len(datalist[k]) for k in ("training", "validation", "testing")}
        assert counts == profiles[site]["split"], site
        assert nib.load(str(root / site / "imagesTr/case000.nii.gz")).shape[2] == 2


def test_shipped_presets_counts_without_rendering():
    bench = preset_sites("bench", outside=("near_copy", "blend", "extrapolate"))
    assert bench["size"] == 64 and bench["depth"] == 8
    assert [bench["cases"][s]["training"] for s in bench["inside"]] == [24, 12, 6, 3, 2]
    assert all(bench["test_cases"][s] >= 5 and bench["slices"][s]["testing"] >= 40 for s in bench["inside"])
    assert [bench["kinds"][s] for s in bench["outside"]] == ["near_copy", "blend", "extrapolate"]
    assert all(sum(bench["slices"][s].values()) >= 300 for s in bench["outside"])
    assert preset_sites("bench")["outside"] == ["site-6"] and preset_sites("bench")["kinds"]["site-6"] == "blend"
    demo = preset_sites("demo")
    assert len(demo["inside"]) == 3 and len(demo["outside"]) == 1 and demo["size"] in (48, 64)
    assert all(demo["test_cases"][s] >= 5 and demo["slices"][s]["testing"] >= 40 for s in demo["kinds"])
    # bench inside sites differ in scanner style, label style and size
    inside = [p for p in preset_profiles("bench") if p["kind"] == "inside"]
    assert len({p["template"] for p in inside}) == len({p["radius"] for p in inside}) == 5
    assert len({tuple(p[k] for k in LABEL_KNOBS) for p in inside}) == 5


def _case(profile, **knobs):
    return render_case({**profile, **knobs}, 0, 1, 24, 4)


@pytest.fixture(scope="module")
def bench_inside():
    return [p for p in preset_profiles("bench", seed=0) if p["kind"] == "inside"]


def test_boundary_offset_grows_and_shrinks_the_label_only(bench_inside):
    ref = {**bench_inside[0], **LABEL_KNOBS}
    image, label = _case(ref)
    areas = {}
    for dilate in (-2.0, 2.0):
        im, lab = _case(ref, dilate=dilate)
        assert im.tobytes() == image.tobytes()
        areas[dilate] = (lab > 0).sum()
    assert areas[-2.0] < (label > 0).sum() < areas[2.0]


def test_adjacent_structure_shown_everywhere_labelled_where_included(bench_inside):
    for profile in bench_inside:
        ref = {**profile, **LABEL_KNOBS}
        image, excluded = _case(ref)
        plain, plain_label = _case(ref, adjacent_structure=False)
        change = np.abs(image - plain)  # the adjacent structure's pixels (and what blur spreads of them)
        shown = change > 10 * np.median(change) + 1e-3 * np.abs(plain).max()
        image_incl, included = _case(ref, include_adjacent=True)
        added = (included > 0) & (excluded == 0)
        assert image_incl.tobytes() == image.tobytes() and np.array_equal(plain_label, excluded)
        assert added.sum() > 0 and shown[added].all(), profile["site"]
        _, own = _case(profile)
        assert ((own > 0) & added).any() == profile["include_adjacent"], profile["site"]


def test_polygon_differs_from_smooth(bench_inside):
    ref = {**bench_inside[2], **LABEL_KNOBS}
    image, smooth = _case(ref)
    im, poly = _case(ref, contour="polygon", vertices=6)
    assert im.tobytes() == image.tobytes() and not np.array_equal(poly, smooth)
    assert 0.6 < (poly > 0).sum() / (smooth > 0).sum() < 1.05  # inscribed: mostly inside the smooth contour
    assert ((poly > 0) & ~(smooth > 0)).sum() < 0.1 * (poly > 0).sum()


def test_noisy_site_masks_differ_from_clean(bench_inside):
    noisy = next(p for p in bench_inside if p["noisy"])
    for case in (0, 1):
        image, label = render_case(noisy, 0, case, 24, 4)
        clean_image, clean = render_case({**noisy, "noisy": False}, 0, case, 24, 4)
        assert image.tobytes() == clean_image.tobytes() and not np.array_equal(label, clean)


def test_outside_kinds_and_target_size():
    profiles = preset_profiles("bench", seed=0, outside=("near_copy", "blend", "extrapolate"), near_copy_of="site-3")
    inside, (copy, blend, extra) = profiles[:5], profiles[5:]
    assert copy["copy_of"] == "site-3" and {k: copy[k] for k in LABEL_KNOBS} == {k: inside[2][k] for k in LABEL_KNOBS}
    assert copy["gamma"] != inside[2]["gamma"] and abs(copy["gamma"] / inside[2]["gamma"] - 1) <= 0.05
    assert blend["blend_of"] == [p["site"] for p in inside] and {k: blend[k] for k in LABEL_KNOBS} == LABEL_KNOBS
    for key in ("gamma", "bias"):  # beyond the inside range: above the max / below the min
        assert extra[key] > max(p[key] for p in inside)
    for key in ("noise", "px"):
        assert extra[key] < min(p[key] for p in inside)
    assert extra["organ"] - extra["bg"] < min(p["organ"] - p["bg"] for p in inside)
    assert [p["radius_scale"] for p in inside] == [s.get("radius_scale", 1.0) for s in PRESETS["bench"]["inside"]]


def test_fundus_preset_labels_stay_nested():
    profiles = preset_profiles("demo", seed=0, task="fundus")
    for profile in profiles:
        _, label = render_case({**profile, "dilate": -2.0, "contour": "polygon"}, 0, 0, 24, 2, "fundus", profiles[:3])
        assert set(np.unique(label)) <= {0, 1, 2} and (label == 2).sum() < (label >= 1).sum()


def test_preset_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="n_sites"):
        make_synthetic(tmp_path, preset="bench", n_sites=4)
    with pytest.raises(ValueError, match="outside"):
        make_synthetic(tmp_path, preset=TINY, outside=("mirror",))
    with pytest.raises(ValueError, match="preset"):
        make_synthetic(tmp_path, outside=("blend",))
    with pytest.raises(ValueError, match="near_copy_of"):
        preset_profiles("bench", outside=("near_copy",), near_copy_of="site-9")
