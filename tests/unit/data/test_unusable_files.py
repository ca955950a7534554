"""Files that read but cannot be used, caught at index and check time naming the file (issue 26): NaN / Inf
values, 4D images, truncated PNGs, empty validation / test splits; a site checks only its own data; an outside
site without masks; a data root is never written over another one."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from pflseg.data import DataError, check_dataset, index_dataset, index_report, make_synthetic, require_valid


def _first_image(root: Path, site: str, key: str = "image") -> Path:
    entry = json.loads((root / site / "datalist.json").read_text())["training"][0]
    return root / site / entry[key]


def _rewrite_nifti(path: Path, edit) -> None:
    img = nib.load(str(path))
    nib.save(nib.Nifti1Image(edit(np.asarray(img.dataobj)), img.affine), str(path))


def _tree(root: Path, sites: dict[str, int], side: int = 48, masks: bool = True) -> None:
    rng = np.random.default_rng(0)
    for site, n in sites.items():
        for k in range(n):
            (root / site / "images").mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 255, (side, side), dtype=np.uint8)
            Image.fromarray(pixels).save(root / site / "images" / f"c{k}.png")
            if masks:
                (root / site / "masks").mkdir(parents=True, exist_ok=True)
                mask = np.zeros((side, side), np.uint8)
                mask[4:12, 4:12] = 255
                Image.fromarray(mask).save(root / site / "masks" / f"c{k}.png")


def test_nan_voxels_are_named_at_check_time_not_blamed_on_the_learning_rate(clean_root):
    path = _first_image(clean_root, "site-1")
    _rewrite_nifti(path, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a.astype(np.float32)))
    (problem,) = check_dataset(clean_root)
    assert problem.site == "site-1" and problem.file == str(path) and problem.code == "non_finite_values"
    assert "1 of" in problem.problem and "NaN or Inf" in problem.problem and "lr" not in str(problem)


def test_a_4d_image_is_named_as_4d_not_as_a_shape_mismatch(clean_root):
    path = _first_image(clean_root, "site-1")
    _rewrite_nifti(path, lambda a: np.stack([a, a], axis=-1))
    (problem,) = check_dataset(clean_root)
    assert problem.file == str(path) and problem.code == "image_dimensions" and "4D image" in problem.problem


def test_a_4d_mask_is_named_not_a_reshape_error(clean_root):
    path = _first_image(clean_root, "site-2", "label")
    _rewrite_nifti(path, lambda a: np.stack([a, a], axis=-1))
    (problem,) = check_dataset(clean_root)
    assert problem.site == "site-2" and problem.file == str(path) and "4D image" in problem.problem


def test_nan_and_4d_niftis_are_refused_at_index_time(tmp_path):
    for site, data in (("nan", np.full((8, 8, 2), np.nan, np.float32)), ("four", np.zeros((8, 8, 2, 3), np.float32))):
        for k in range(3):
            folder = tmp_path / "raw" / site
            (folder / "images").mkdir(parents=True, exist_ok=True)
            (folder / "masks").mkdir(parents=True, exist_ok=True)
            image = data if k == 1 else np.zeros((8, 8, 2), np.float32)
            nib.save(nib.Nifti1Image(image, np.eye(4)), str(folder / "images" / f"c{k}.nii.gz"))
            mask = np.zeros((8, 8, 2), np.uint8)
            mask[2:4, 2:4] = 1
            nib.save(nib.Nifti1Image(mask, np.eye(4)), str(folder / "masks" / f"c{k}.nii.gz"))
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    text = str(err.value)
    assert f"[nan] {tmp_path / 'raw/nan/images/c1.nii.gz'}: 128 of 128 values are NaN or Inf" in text
    assert f"[four] {tmp_path / 'raw/four/images/c1.nii.gz'}: 4D image of shape (8, 8, 2, 3)" in text


def test_a_truncated_png_is_refused_at_index_time(tmp_path):
    _tree(tmp_path / "raw", {"a": 3})
    png = tmp_path / "raw/a/images/c1.png"
    png.write_bytes(png.read_bytes()[: png.stat().st_size * 2 // 3])  # the header still reads
    with pytest.raises(DataError, match=rf"\[a\] {png}: cannot read file"):
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")


def test_empty_validation_or_test_splits_are_named_at_index_and_check_time(tmp_path):
    _tree(tmp_path / "raw", {"big": 5, "small": 2})
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    small = next(s for s in report.sites if s.site == "small")
    assert any("split is empty (2 case(s) in all)" in note and note.startswith("warning") for note in small.notes)
    problems = check_dataset(tmp_path / "out")
    assert {(p.site, p.code) for p in problems} == {("small", "empty_split")}
    assert all(p.file == str(tmp_path / "out/small/datalist.json") for p in problems)
    require_valid(tmp_path / "out")  # not refused at a site: an outside site only adapts; training names it


def test_each_site_checks_only_its_own_data(clean_root):
    path = _first_image(clean_root, "site-2")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match="site-2"):
        require_valid(clean_root)
    assert require_valid(clean_root, ["site-1"])["sites"] == ["site-1", "site-2", "site-3"]
    with pytest.raises(DataError, match="site-2"):
        require_valid(clean_root, ["site-1", "site-2"])


def test_the_simulated_site_a_is_not_refused_for_site_bs_bad_file(clean_root, monkeypatch):
    from pflseg.flare.settings import resolve_data, site_settings

    path = _first_image(clean_root, "site-2")
    path.write_bytes(path.read_bytes()[:100])
    monkeypatch.setenv("PFLSEG_DATA", str(clean_root))
    data_cfg = {"synth_task": "prostate", "synth_sites": 3, "synth_seed": 0, "size": 32, "foreground_only": False}
    assert resolve_data("site-1", site_settings("site-1"), data_cfg)[1] == "site-1"
    with pytest.raises(DataError, match=str(path)):
        resolve_data("site-2", site_settings("site-2"), data_cfg)


def test_an_outside_site_with_images_and_no_masks_can_be_indexed(tmp_path):
    _tree(tmp_path / "raw", {"inside": 4})
    _tree(tmp_path / "raw", {"outside": 3}, masks=False)
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    datalist = json.loads((tmp_path / "out/outside/datalist.json").read_text())
    assert datalist["training"] == [] and datalist["validation"] == [] and len(datalist["testing"]) == 3
    assert all("label" not in e for e in datalist["testing"])
    assert "no masks" in str(report) and check_dataset(tmp_path / "out") == []


def test_index_and_synth_refuse_to_overwrite_another_data_root(tmp_path):
    _tree(tmp_path / "one", {"a": 3})
    _tree(tmp_path / "two", {"b": 3})
    out = index_dataset("generic", tmp_path / "one", tmp_path / "out")
    index_dataset("generic", tmp_path / "one", out, seed=1)  # the same data again: rewritten
    before = (out / "dataset.json").read_text()
    with pytest.raises(DataError, match=rf"{out}: holds another data root \(name 'one', layout 'generic'\).*--out"):
        index_dataset("generic", tmp_path / "two", out)
    with pytest.raises(DataError, match="holds another data root"):
        make_synthetic(out, n_sites=2, cases=3, size=16, depth=2)
    assert (out / "dataset.json").read_text() == before
    synth = make_synthetic(tmp_path / "synth", n_sites=2, cases=3, size=16, depth=2)
    make_synthetic(synth, n_sites=2, cases=3, size=16, depth=2, seed=1)  # an earlier synthetic root: rewritten
    with pytest.raises(DataError, match="holds another data root"):
        index_dataset("generic", tmp_path / "one", synth)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    with pytest.raises(DataError, match=r"not empty and not a data root .*thesis\.tex"):
        make_synthetic(tmp_path / "mine", n_sites=2, cases=3, size=16, depth=2)
