"""Tests of the dataset checker: one test per kind of bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from pflseg.data import DataError, check_dataset, index_dataset, require_valid, site_dataset
from tests.unit.data.helpers import write_png


def _entry(root: Path, site: str, split: str = "training", k: int = 0) -> dict:
    return json.loads((root / site / "datalist.json").read_text())[split][k]


def _edit_datalist(root: Path, site: str, edit) -> None:
    path = root / site / "datalist.json"
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def _only(problems, site: str, file: Path | str, words: str):
    """Asserts exactly one problem, at this site and file, mentioning words."""
    assert len(problems) == 1, [str(p) for p in problems]
    problem = problems[0]
    assert problem.site == site and str(file) in str(problem) and words in problem.problem, str(problem)
    assert f"[{site}]" in str(problem) and "Fix:" in str(problem) and "\n" not in str(problem)
    return problem


def test_clean_synthetic_has_no_problems(synth_root):
    assert check_dataset(synth_root) == []
    assert require_valid(synth_root)["sites"] == ["site-1", "site-2", "site-3"]


def test_truncated_nifti(clean_root):
    path = clean_root / "site-1" / _entry(clean_root, "site-1")["image"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _only(check_dataset(clean_root), "site-1", path, "cannot read")


def test_garbage_png(tmp_path):
    for k in range(3):
        write_png(tmp_path / f"raw/s/images/{k}.png", np.zeros((6, 6)))
        write_png(tmp_path / f"raw/s/masks/{k}.png", np.eye(6))
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    (tmp_path / "raw/s/images/1.png").write_bytes(b"not a png at all")
    _only(check_dataset(out), "s", tmp_path / "raw/s/images/1.png", "cannot read")


def test_shape_mismatch(clean_root):
    entry = _entry(clean_root, "site-2")
    path = clean_root / "site-2" / entry["label"]
    old = nib.load(str(path))
    nib.save(nib.Nifti1Image(np.zeros((5, 5, 4), np.uint8), old.affine), str(path))
    _only(check_dataset(clean_root), "site-2", path, "shape")


def test_spacing_mismatch(clean_root):
    path = clean_root / "site-1" / _entry(clean_root, "site-1")["label"]
    old = nib.load(str(path))
    nib.save(nib.Nifti1Image(np.asarray(old.dataobj), old.affine @ np.diag([1.01, 1, 1, 1])), str(path))
    _only(check_dataset(clean_root), "site-1", path, "spacing")
    # within tolerance: no problem
    nib.save(nib.Nifti1Image(np.asarray(old.dataobj), old.affine @ np.diag([1.0001, 1, 1, 1])), str(path))
    assert check_dataset(clean_root) == []


def test_missing_mask_file(clean_root):
    path = clean_root / "site-3" / _entry(clean_root, "site-3", "validation")["label"]
    path.unlink()
    _only(check_dataset(clean_root), "site-3", path, "does not exist")


def test_entry_without_mask(clean_root):
    _edit_datalist(clean_root, "site-1", lambda b: b["training"][0].pop("label"))
    _only(check_dataset(clean_root), "site-1", "imagesTr", "no mask")


def test_missing_image_file(clean_root):
    _edit_datalist(clean_root, "site-2", lambda b: b["testing"][0].update(image="imagesTr/gone.nii.gz"))
    _only(check_dataset(clean_root), "site-2", "gone.nii.gz", "does not exist")


def test_empty_site_no_training(clean_root):
    _edit_datalist(clean_root, "site-2", lambda b: b.update(training=[]))
    _only(check_dataset(clean_root), "site-2", clean_root / "site-2/datalist.json", "no training entries")


def test_site_folder_without_datalist(clean_root):
    (clean_root / "site-3/datalist.json").unlink()
    _only(check_dataset(clean_root), "site-3", clean_root / "site-3", "no datalist")


def test_site_listed_without_folder(clean_root):
    info = json.loads((clean_root / "dataset.json").read_text())
    info["sites"].append("site-9")
    (clean_root / "dataset.json").write_text(json.dumps(info))
    _only(check_dataset(clean_root), "site-9", clean_root / "site-9", "no folder")


def _write_bad_label(root, value):
    """Put ``value`` into one voxel of site-1's first training label; return the label's path."""
    path = root / "site-1" / _entry(root, "site-1")["label"]
    old = nib.load(str(path))
    data = np.asarray(old.dataobj).copy()
    data[0, 0, 0] = value
    nib.save(nib.Nifti1Image(data, old.affine), str(path))
    return path


def test_label_out_of_range(clean_root):
    path = _write_bad_label(clean_root, 5)
    problem = _only(check_dataset(clean_root), "site-1", path, "outside the class range 0..1")
    assert "{5}" in problem.problem


def test_raw_value_not_in_label_map(clean_root):
    _edit_datalist(clean_root, "site-2", lambda b: b["training"][0].update(label_map={"0": 0}))
    _only(check_dataset(clean_root), "site-2", "labelsTr", "not keys of the entry's label_map")


def test_case_in_two_splits(clean_root):
    _edit_datalist(clean_root, "site-1", lambda b: b["testing"].append(b["training"][0]))
    _only(check_dataset(clean_root), "site-1", "datalist.json", "is in both training and testing")


def test_wrong_channel_count(clean_root):
    info = json.loads((clean_root / "dataset.json").read_text())
    (clean_root / "dataset.json").write_text(json.dumps(dict(info, in_channels=3)))
    problems = check_dataset(clean_root)
    assert len(problems) == 12 and all("in_channels=3" in p.problem for p in problems)


@pytest.mark.parametrize("content,words", [
    (None, "not found"),
    ("{bad json", "not valid JSON"),
    ('{"name": "x"}', "missing key 'task'"),
])
def test_missing_or_invalid_dataset_json(clean_root, content, words):
    path = clean_root / "dataset.json"
    path.unlink() if content is None else path.write_text(content)
    problems = check_dataset(clean_root)
    assert problems and problems[0].site == "" and str(path) in str(problems[0]) and words in str(problems[0])


def test_bad_dataset_json_values(clean_root):
    info = json.loads((clean_root / "dataset.json").read_text())
    (clean_root / "dataset.json").write_text(json.dumps(dict(info, label_encoding="onehot", extra=1)))
    text = "\n".join(map(str, check_dataset(clean_root)))
    assert "label_encoding 'onehot'" in text and "unknown key(s) ['extra']" in text


def test_require_valid_lists_all_problems(clean_root):
    (clean_root / "site-1" / _entry(clean_root, "site-1")["label"]).unlink()
    path = clean_root / "site-2" / _entry(clean_root, "site-2", "testing")["image"]
    path.write_bytes(gzip.compress(b"garbage"))
    with pytest.raises(DataError) as err:
        require_valid(clean_root)
    text = str(err.value)
    assert text.startswith("2 problem(s) in dataset") and "[site-1]" in text and "[site-2]" in text
    assert str(path) in text


def test_training_stops_with_the_same_message(clean_root):
    _write_bad_label(clean_root, 7)
    (problem,) = check_dataset(clean_root)
    with pytest.raises(DataError) as err:
        site_dataset(clean_root, "site-1", "training")
    assert str(err.value) == str(problem)

    image = clean_root / "site-2" / _entry(clean_root, "site-2")["image"]
    image.write_bytes(image.read_bytes()[:100])
    with pytest.raises(DataError, match=r"\[site-2\] .*cannot read"):
        site_dataset(clean_root, "site-2", "training")


def test_a_data_root_that_is_not_there_or_not_indexed_says_what_to_run(tmp_path):
    (problem,) = check_dataset(tmp_path / "nope")
    assert str(problem) == (f"{tmp_path / 'nope'}: data root not found (no such folder). Fix: pass the folder that "
                            "`pflseg data index` (your images and masks) or `pflseg data synth` (synthetic data) wrote "
                            "(it holds dataset.json)")
    raw = tmp_path / "raw"
    write_png(raw / "HospitalA" / "images" / "a.png", np.zeros((4, 4)))
    write_png(raw / "HospitalA" / "masks" / "a.png", np.zeros((4, 4)))
    (problem,) = check_dataset(raw)
    assert problem.code == "not_indexed" and "raw data, not indexed yet (no dataset.json; site folders HospitalA)" \
        in str(problem)
    assert f"run `pflseg data index --layout generic --root {raw} --out {raw}-index` first" in str(problem)
    (tmp_path / "empty").mkdir()
    (problem,) = check_dataset(tmp_path / "empty")
    assert "dataset.json not found: not a data root" in str(problem)
    for p in (tmp_path / "nope", raw, tmp_path / "empty"):
        assert "make_synthetic" not in str(check_dataset(p)[0])  # no internal names


def test_an_empty_split_reads_the_same_in_check_index_and_at_the_site(tmp_path):
    from pflseg.data.check import empty_split_error

    raw = tmp_path / "raw"
    for site, n in (("big", 3), ("one", 1)):
        for k in range(n):
            write_png(raw / site / "images" / f"c{k}.png", np.arange(16).reshape(4, 4))
            mask = np.zeros((4, 4))
            mask[1:3, 1:3] = 1
            write_png(raw / site / "masks" / f"c{k}.png", mask)
    from pflseg.data import index_report

    report = index_report("generic", raw, tmp_path / "out")
    (one,) = [s for s in report.sites if s.site == "one"]
    problems = {p.problem + ". Fix: " + p.fix for p in check_dataset(tmp_path / "out") if p.site == "one"}
    assert {n[len("warning: "):] for n in one.notes if n.startswith("warning: the")} == problems
    assert len(problems) == 2  # validation and testing, each with its reason
    site_error = str(empty_split_error(tmp_path / "out", "one", "validation"))
    assert any(site_error.endswith(p) for p in problems) and "cannot pick its best model" in site_error
