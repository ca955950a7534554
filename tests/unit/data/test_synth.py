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
    shapes = {s: nib.load(str(synth_root / s / "imagesTr/case000.nii.gz")).shape[0] for s in ("site-1", "site-2", "site-3")}
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
