"""Tests of the dataset adapters, on generated files and on the shared real-format fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from pflseg.data import LAYOUTS, DataError, check_dataset, index_dataset, site_dataset
from tests.unit.data.helpers import fixture_dir, write_png


def _datalists(out: Path) -> dict[str, dict]:
    info = json.loads((out / "dataset.json").read_text())
    return {s: json.loads((out / s / "datalist.json").read_text()) for s in info["sites"]}


def _cases(datalist: dict) -> dict[str, set]:
    return {s: {e["case"] for e in datalist[s]} for s in ("training", "validation", "testing")}


def _write_nii(path: Path, array: np.ndarray, spacing=(1.0, 1.0, 2.0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.diag([*spacing, 1.0])), str(path))
    return path


def _volume(rng, shape=(16, 16, 3)):
    image = rng.random(shape, dtype=np.float32)
    label = np.zeros(shape, np.uint8)
    label[4:10, 4:10] = 1
    return image, label


def test_unknown_layout_and_missing_root(tmp_path):
    with pytest.raises(DataError, match="unknown layout 'nope'.*saml"):
        index_dataset("nope", tmp_path, tmp_path / "out")
    with pytest.raises(DataError, match="not found"):
        index_dataset("saml", tmp_path / "absent", tmp_path / "out")
    with pytest.raises(DataError, match="no sites found"):
        index_dataset("nvflare_prostate", tmp_path, tmp_path / "out")
    assert set(LAYOUTS) == {"saml", "nvflare_prostate", "prostate_slices", "fundus", "generic"}


def test_saml_generated(tmp_path):
    rng = np.random.default_rng(0)
    for site, n in (("BIDMC", 5), ("HK", 3)):
        for k in range(n):
            image, label = _volume(rng)
            suffix = "_segmentation" if k % 2 else "_Segmentation"
            _write_nii(tmp_path / "raw" / site / f"Case{k:02d}.nii.gz", image)
            _write_nii(tmp_path / "raw" / site / f"Case{k:02d}{suffix}.nii.gz", label)
    out = index_dataset("saml", tmp_path / "raw", tmp_path / "out")
    lists = _datalists(out)
    assert list(lists) == ["BIDMC", "HK"]
    for site, n in (("BIDMC", 5), ("HK", 3)):
        cases = _cases(lists[site])
        assert sum(map(len, cases.values())) == n and all(cases.values())
        entry = lists[site]["training"][0]
        assert Path(entry["image"]).is_absolute() and "egmentation" in entry["label"]
    assert check_dataset(out) == []


def test_saml_image_without_mask(tmp_path):
    image, _ = _volume(np.random.default_rng(0))
    _write_nii(tmp_path / "raw/A/Case00.nii.gz", image)
    with pytest.raises(DataError, match=r"Case00\.nii\.gz: no mask Case00_segmentation"):
        index_dataset("saml", tmp_path / "raw", tmp_path / "out")


def test_saml_on_promise12_fixture(tmp_path):
    src = fixture_dir("promise12")
    (tmp_path / "raw/PROMISE").mkdir(parents=True)
    for name in ("Case00.nii.gz", "Case00_segmentation.nii.gz"):
        (tmp_path / "raw/PROMISE" / name).symlink_to(src / name)
    out = index_dataset("saml", tmp_path / "raw", tmp_path / "out")
    lists = _datalists(out)
    assert _cases(lists["PROMISE"]) == {"training": {"Case00"}, "validation": set(), "testing": set()}
    ds = site_dataset(out, "PROMISE", "training", size=32)
    assert len(ds) == 64 and ds[32]["label"].shape == (1, 32, 32)


def test_nvflare_prostate_generated(tmp_path):
    rng = np.random.default_rng(1)
    for site in ("site-a", "site-b"):
        for k in range(4):
            image, label = _volume(rng)
            _write_nii(tmp_path / "raw" / site / "Image" / f"p{k}.nii.gz", image)
            _write_nii(tmp_path / "raw" / site / "Mask" / f"p{k}.nii.gz", label)
    out = index_dataset("nvflare_prostate", tmp_path / "raw", tmp_path / "out", seed=3)
    lists = _datalists(out)
    assert {s: sum(map(len, _cases(d).values())) for s, d in lists.items()} == {"site-a": 4, "site-b": 4}
    again = index_dataset("nvflare_prostate", tmp_path / "raw", tmp_path / "out2", seed=3)
    assert _datalists(again) == lists  # deterministic


def test_nvflare_prostate_missing_mask_folder(tmp_path):
    _write_nii(tmp_path / "raw/s1/Image/p0.nii.gz", np.zeros((4, 4, 2), np.float32))
    with pytest.raises(DataError, match=r"\[s1\] .*Mask: folder not found"):
        index_dataset("nvflare_prostate", tmp_path / "raw", tmp_path / "out")


def _prostate_slices_tree(root: Path) -> None:
    for site in ("A", "B"):
        for part, n_cases in (("train", 4), ("test", 2)):
            for case in range(n_cases):
                for sl in range(3):
                    mask = np.full((12, 12), 255, np.uint8)
                    mask[3:6, 3:6] = 0
                    write_png(root / site / part / "image" / f"{case:02d}_{sl:02d}.png", np.full((12, 12), 9 * sl))
                    write_png(root / site / part / "mask" / f"{case:02d}_{sl:02d}.png", mask)


def test_prostate_slices_generated_keeps_cases_together(tmp_path):
    _prostate_slices_tree(tmp_path / "raw")
    out = index_dataset("prostate_slices", tmp_path / "raw", tmp_path / "out")
    for datalist in _datalists(out).values():
        cases = _cases(datalist)
        assert cases["testing"] == {"test-00", "test-01"}
        assert len(cases["training"]) == 3 and len(cases["validation"]) == 1
        for split in ("training", "validation", "testing"):
            for case in cases[split]:
                slices = sorted(e["slice"] for e in datalist[split] if e["case"] == case)
                assert slices == [0, 1, 2]  # all slices of a case in one split
        assert datalist["training"][0]["label_map"] == {"0": 1, "255": 0}
    sample = site_dataset(out, "A", "testing", size=12)[0]
    assert sample["label"].sum() == 9  # the 3x3 zero region is the prostate


def test_prostate_slices_fixture(tmp_path):
    out = index_dataset("prostate_slices", fixture_dir("ProstateSlice"), tmp_path / "out")
    lists = _datalists(out)
    assert set(lists) == {"BIDMC", "BMC", "HK", "I2CVB", "RUNMC", "UCL"}
    for datalist in lists.values():
        assert len(datalist["training"]) + len(datalist["validation"]) == 2 and len(datalist["testing"]) == 2
    # one training case per site (its slices split apart nowhere): reported, not refused at the site
    assert {p.code for p in check_dataset(out)} == {"empty_split"}
    for item in site_dataset(out, "HK", "testing", size=64):
        assert 0.001 < item["label"].mean() < 0.1  # the gland is small: the map is not inverted


def _fundus_check(out: Path, site: str) -> None:
    ds = site_dataset(out, site, "training", size=800)
    entry = json.loads((out / site / "datalist.json").read_text())["training"][0]
    raw = np.asarray(Image.open(entry["label"]))
    raw = raw[..., 0] if raw.ndim == 3 else raw
    item = ds[0]
    assert item["image"].shape[0] == 3
    assert np.array_equal(item["label"][0].numpy() == 1, raw < 255)  # disc
    assert np.array_equal(item["label"][1].numpy() == 1, raw == 0)  # cup


def test_fundus_generated(tmp_path):
    rng = np.random.default_rng(2)
    for dom in (1, 2):
        for part in ("train", "test"):
            for k in range(3):
                mask = np.full((20, 20), 255, np.uint8)
                mask[4:16, 4:16] = 128
                mask[8:12, 8:12] = 0
                write_png(tmp_path / f"raw/Domain{dom}/{part}/ROIs/mask/img{k}.png", np.stack([mask] * 3, -1))
                write_png(tmp_path / f"raw/Domain{dom}/{part}/ROIs/image/img{k}.png", rng.integers(0, 255, (20, 20, 3)))
    out = index_dataset("fundus", tmp_path / "raw", tmp_path / "out")
    info = json.loads((out / "dataset.json").read_text())
    assert info["in_channels"] == 3 and info["classes"] == ["disc", "cup"] and info["label_encoding"] == "nested"
    lists = _datalists(out)
    assert all(len(d["testing"]) == 3 and len(d["training"]) + len(d["validation"]) == 3 for d in lists.values())
    assert check_dataset(out) == []
    ds = site_dataset(out, "Domain1", "training", size=20)
    assert ds[0]["label"][0].sum() == 144 and ds[0]["label"][1].sum() == 16


def test_fundus_fixture(tmp_path):
    out = index_dataset("fundus", fixture_dir("Fundus"), tmp_path / "out")
    lists = _datalists(out)
    assert list(lists) == ["Domain1", "Domain2", "Domain3", "Domain4"]
    assert all(len(d["testing"]) == 2 for d in lists.values())
    _fundus_check(out, "Domain3")


def test_generic_png_binary_255(tmp_path):
    for site in ("x", "y"):
        for k in range(5):
            mask = np.zeros((10, 10), np.uint8)
            mask[2:5, 2:5] = 255
            write_png(tmp_path / f"raw/{site}/images/im{k}.png", np.full((10, 10), 50))
            write_png(tmp_path / f"raw/{site}/masks/im{k}.png", mask)
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    info = json.loads((out / "dataset.json").read_text())
    assert info["classes"] == ["foreground"] and info["in_channels"] == 1
    lists = _datalists(out)
    assert all(sum(map(len, _cases(d).values())) == 5 and all(_cases(d).values()) for d in lists.values())
    assert lists["x"]["training"][0]["label_map"] == {"0": 0, "255": 1}
    assert site_dataset(out, "x", "training", size=10)[0]["label"].sum() == 9


def test_generic_nifti_labelled_exclusive(tmp_path):
    rng = np.random.default_rng(3)
    for k in range(3):
        label = np.zeros((8, 8, 2), np.uint8)
        label[1:3, 1:3] = 1
        label[5:7, 5:7] = 3
        _write_nii(tmp_path / f"raw/s/images/v{k}.nii.gz", rng.random((8, 8, 2), dtype=np.float32))
        _write_nii(tmp_path / f"raw/s/masks/v{k}.nii.gz", label)
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out", classes=["a", "b", "c"])
    info = json.loads((out / "dataset.json").read_text())
    assert info["label_encoding"] == "exclusive" and info["classes"] == ["a", "b", "c"]
    item = site_dataset(out, "s", "training", size=8)[0]
    assert item["label"].sum((1, 2)).tolist() == [4, 0, 4]
    with pytest.raises(DataError, match="classes"):
        index_dataset("generic", tmp_path / "raw", tmp_path / "out2", classes=["only-one"])


def test_generic_unpaired_files(tmp_path):
    write_png(tmp_path / "raw/s/images/a.png", np.zeros((4, 4)))
    write_png(tmp_path / "raw/s/masks/b.png", np.zeros((4, 4)))
    with pytest.raises(DataError, match=r"(?s)2 unpaired.*a\.png: no mask.*b\.png: no image") as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    assert "[s]" in str(err.value)
