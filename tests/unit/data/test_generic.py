"""Tests of the generic layout (`pflseg data index --layout generic`) on files generated in tmp_path.

Each test writes a small multi-site folder with PIL, indexes it and asserts the exact datalist, the
exact dataset.json or the exact error message; data sets that index are also loaded by the training
dataset and pass the checker.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pflseg.cli import main
from pflseg.data import DataError, check_dataset, index_dataset, index_report, site_dataset
from pflseg.data.datalist import suggested_train_size
from pflseg.data.files import read_array
from pflseg.data.labels import label_problem, map_labels
from pflseg.data.masks import (
    MaskValues,
    SiteEncoding,
    describe_values,
    format_values,
    looks_lossy_binary,
    site_encoding,
)

H, W = 8, 12


def _save(path: Path, image: Image.Image | np.ndarray, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(path, **kwargs)
    return path


def _mask(value: int = 1) -> np.ndarray:
    """(H, W) uint8: a 3 x 4 block of ``value`` (12 of 96 pixels) on 0."""
    mask = np.zeros((H, W), np.uint8)
    mask[2:5, 3:7] = value
    return mask


def _gray(k: int = 0) -> np.ndarray:
    return (np.arange(H * W).reshape(H, W) * 2 + k).astype(np.uint8)


def _tree(root: Path, sites: dict[str, int], mask=lambda k: _mask(1), image=_gray, ext: str = "png") -> None:
    """<root>/<site>/{images,masks}/caseNN.<ext> with n cases per site; mask(k) and image(k) make case k."""
    for site, n in sites.items():
        for k in range(n):
            _save(root / site / "images" / f"case{k:02d}.png", image(k))
            _save(root / site / "masks" / f"case{k:02d}.{ext}", mask(k))


def _info(out: Path) -> dict:
    return json.loads((out / "dataset.json").read_text())


def _datalist(out: Path, site: str) -> dict:
    return json.loads((out / site / "datalist.json").read_text())


def _entries(datalist: dict) -> list[dict]:
    return sorted((e for s in ("training", "validation", "testing") for e in datalist[s]), key=lambda e: e["case"])


def _error(excinfo) -> str:
    return str(excinfo.value)


# ---- binary masks {0, v} ---------------------------------------------------------------------------


@pytest.mark.parametrize("value, label_map", [(127, {"0": 0, "127": 1}), (1, None), (255, {"0": 0, "255": 1})])
def test_two_valued_masks_are_binary(tmp_path, value, label_map):
    _tree(tmp_path / "raw", {"Hospital A": 3}, mask=lambda k: _mask(value))
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    out = report.out
    raw = tmp_path / "raw" / "Hospital A"
    expected = [{"image": str(raw / f"images/case{k:02d}.png"), "label": str(raw / f"masks/case{k:02d}.png"),
                 "case": f"case{k:02d}", **({"label_map": label_map} if label_map else {})} for k in range(3)]
    assert _entries(_datalist(out, "Hospital A")) == expected
    assert _info(out) == {"name": "raw", "task": "segmentation", "classes": ["foreground"], "label_encoding": "nested",
                          "in_channels": 1, "sites": ["Hospital A"], "layout": "generic", "train_size": 8}
    assert report.sites[0].notes == [f"masks: binary, foreground value {value}"]
    assert site_dataset(out, "Hospital A", "training", size=W)[0]["label"].shape == (1, W, W)
    assert site_dataset(out, "Hospital A", "testing", size=H)[0]["label"].sum() == 9  # 3 x 4 block, width 12 -> 8
    assert check_dataset(out) == []


def test_sites_decide_their_foreground_value_separately(tmp_path):
    _tree(tmp_path / "raw", {"North": 3}, mask=lambda k: _mask(255))
    _tree(tmp_path / "raw", {"South": 3}, mask=lambda k: _mask(1))
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    assert [s.notes for s in report.sites] == [["masks: binary, foreground value 255"],
                                              ["masks: binary, foreground value 1"]]
    assert [s.foreground for s in report.sites] == [12 / 96, 12 / 96]


def test_report_text(tmp_path):
    _tree(tmp_path / "raw", {"Hospital A": 5}, mask=lambda k: _mask(127))
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    assert str(report) == (
        f"indexed {tmp_path / 'raw'} (layout generic) into {tmp_path / 'out'}\n"
        "dataset.json: classes foreground (nested), in_channels 1, train_size 8\n"
        "[Hospital A] cases: training 3, validation 1, testing 1 | foreground 12.50 % | size 8x12 (HxW) | "
        "channels 1 (gray)\n"
        "    masks: binary, foreground value 127"
    )


def test_masks_that_disagree_on_the_foreground_value(tmp_path):
    _tree(tmp_path / "raw", {"s": 2}, mask=lambda k: _mask(1 + k))
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    masks = tmp_path / "raw/s/masks"
    assert _error(err) == (
        f"1 problem(s) in dataset {tmp_path / 'raw'}:\n"
        f"  - [s] {masks / 'case01.png'}: masks of this site disagree on the foreground value: this mask holds "
        f"{{0, 2}}, {masks / 'case00.png'} holds {{0, 1}}. Fix: re-save the masks with one foreground value, or pass "
        "--classes with 2 names if the values are class labels, e.g. --classes class1,class2"
    )


def test_empty_masks_are_an_error(tmp_path):
    _tree(tmp_path / "raw", {"s": 2}, mask=lambda k: _mask(0))
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    assert _error(err).endswith(f"[s] {tmp_path / 'raw/s/masks'}: every mask is empty (only the value 0). Fix: check "
                                "that this folder holds the site's masks, or remove the site")


# ---- lossy (JPEG) masks ------------------------------------------------------------------------------


def _jpeg_tree(root: Path, colour: bool = False) -> None:
    rng = np.random.default_rng(0)

    def noisy(k):
        mask = np.zeros((32, 32), np.uint8)
        mask[8:20, 6:26] = 255
        noise = rng.integers(-3, 4, mask.shape)
        mask = np.clip(mask.astype(int) + noise, 0, 255).astype(np.uint8)
        return np.stack([mask] * 3, -1) if colour else mask

    _tree(root, {"Clinic": 3}, mask=noisy, image=lambda k: np.full((32, 32, 3), 40 * k, np.uint8), ext="jpg")


def test_jpeg_masks_without_threshold_name_the_flag(tmp_path):
    _jpeg_tree(tmp_path / "raw")
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    path = tmp_path / "raw/Clinic/masks/case00.jpg"
    values = sorted(set(np.asarray(Image.open(path)).ravel().tolist()))
    low, high = [v for v in values if v < 128], [v for v in values if v >= 128]
    assert low[-1] < 30 and high[0] > 225  # JPEG noise around 0 and 255
    assert _error(err) == (
        f"1 problem(s) in dataset {tmp_path / 'raw'}:\n"
        f"  - [Clinic] {path}: lossy (JPEG) mask with {len(values)} values in {low[0]}..{low[-1]} and "
        f"{high[0]}..{high[-1]} (2 more mask(s) of this site alike); a binary mask holds 0 and one foreground "
        "value. Fix: pass --mask-threshold 127 (values above it are foreground)"
    )


@pytest.mark.parametrize("colour", [False, True])
def test_jpeg_masks_with_threshold(tmp_path, colour):
    _jpeg_tree(tmp_path / "raw", colour=colour)
    report = index_report("generic", tmp_path / "raw", tmp_path / "out", mask_threshold=127)
    entries = _entries(_datalist(report.out, "Clinic"))
    assert [(e["case"], e["label_threshold"], "label_map" in e) for e in entries] == [
        ("case00", 127, False), ("case01", 127, False), ("case02", 127, False)]
    assert report.sites[0].notes == ["masks: value > 127 is foreground (--mask-threshold)"]
    assert report.sites[0].foreground == 240 / 1024
    assert _info(report.out)["in_channels"] == 3 and _info(report.out)["train_size"] == 32
    label = site_dataset(report.out, "Clinic", "training", size=32)[0]["label"][0]
    expected = torch.zeros(32, 32)
    expected[8:20, 6:26] = 1
    assert torch.equal(label, expected)
    assert check_dataset(report.out) == []


def test_threshold_above_every_value(tmp_path):
    _tree(tmp_path / "raw", {"s": 2})
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out", mask_threshold=127)
    assert _error(err).endswith(f"[s] {tmp_path / 'raw/s/masks'}: no mask value is above --mask-threshold 127 "
                                "(values seen: 0, 1). Fix: pass a lower threshold, e.g. --mask-threshold 0")


def test_threshold_with_several_classes(tmp_path):
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path, tmp_path / "out", mask_threshold=127, classes=["a", "b"])
    assert _error(err) == ("--mask-threshold makes every mask binary (one class), but --classes names 2 classes "
                           "(a,b). Fix: pass one class name, or drop --mask-threshold for labelled masks")


# ---- labelled masks 0..C -----------------------------------------------------------------------------


def _labels(scale: int = 1):
    def mask(k):
        m = np.zeros((H, W), np.uint8)
        m[0:2, :] = 1 * scale
        m[2:3, :] = 2 * scale
        m[3:6, 0:4] = 3 * scale
        return m

    return mask


def test_labelled_masks_need_classes(tmp_path):
    _tree(tmp_path / "raw", {"s": 3}, mask=_labels())
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    assert _error(err) == (
        f"1 problem(s) in dataset {tmp_path / 'raw'}:\n"
        f"  - [s] {tmp_path / 'raw/s/masks/case00.png'}: mask with 4 values 0..3 (2 more mask(s) of this site alike): "
        "masks with more than two values hold class labels. Fix: pass --classes with one name per non-zero value "
        "(3 names for the values 1..3 of this site), e.g. --classes class1,class2,class3"
    )


@pytest.mark.parametrize("scale, label_map", [(1, None), (85, {"0": 0, "85": 1, "170": 2, "255": 3})])
def test_labelled_masks_with_classes(tmp_path, scale, label_map):
    _tree(tmp_path / "raw", {"s": 3}, mask=_labels(scale))
    report = index_report("generic", tmp_path / "raw", tmp_path / "out", classes=["a", "b", "c"])
    info = _info(report.out)
    assert (info["classes"], info["label_encoding"]) == (["a", "b", "c"], "exclusive")
    assert [e.get("label_map") for e in _entries(_datalist(report.out, "s"))] == [label_map] * 3
    note = ("masks: labelled 0..3 (0 background, 1 a, 2 b, 3 c)" if scale == 1 else
            "masks: labelled, values 0, 85, 170, 255 -> 0..3 (0 background, 1 a, 2 b, 3 c)")
    assert report.sites[0].notes == [note]
    assert report.sites[0].class_fractions == [24 / 96, 12 / 96, 12 / 96]
    assert "| foreground 50.00 % (a 25.00 %, b 12.50 %, c 12.50 %) |" in str(report)
    item = site_dataset(report.out, "s", "training", size=W)[0]
    assert item["label"].shape == (3, W, W)
    assert check_dataset(report.out) == []


def test_labels_outside_the_classes(tmp_path):
    _tree(tmp_path / "raw", {"s": 3}, mask=_labels())
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out", classes=["a", "b"])
    assert _error(err).endswith(
        f"[s] {tmp_path / 'raw/s/masks/case00.png'}: mask values 0..3 are not the labels 0..2 of --classes a,b. "
        "Fix: save the masks with values 0..2, or pass one class name per non-zero value (3 name(s) for this site's "
        "values 0..3)")


def test_one_class_name_names_binary_masks(tmp_path):
    _tree(tmp_path / "raw", {"s": 3}, mask=lambda k: _mask(255))
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out", classes=["polyp"])
    assert (_info(out)["classes"], _info(out)["label_encoding"]) == (["polyp"], "nested")


# ---- images ------------------------------------------------------------------------------------------


def _rgba(k):
    rgba = np.zeros((H, W, 4), np.uint8)
    rgba[..., 0] = _gray(k)
    rgba[..., 1] = 50
    rgba[..., 2] = 255 - _gray(k)
    rgba[..., 3] = 128  # alpha, dropped
    return rgba


def _uint16(k):
    return (np.arange(H * W).reshape(H, W) * 600 + k).astype(np.uint16)


def _palette(k, gray=False):
    img = Image.fromarray((np.arange(H * W).reshape(H, W) % 3).astype(np.uint8), mode="L").convert("P")
    img.putpalette([0, 0, 0, 90, 90, 90, 200, 200, 200] if gray else [255, 0, 0, 0, 255, 0, 0, 0, 255])
    return img


def _rgb(k):
    return np.stack([_gray(k), _gray(k + 1), _gray(k + 2)], -1)


_INDEX = np.arange(H * W).reshape(H, W) % 3  # the palette images' indices
_GRAYS = np.array([0, 90, 200], np.uint8)


@pytest.mark.parametrize("image, expected, channels, mode", [
    (_rgb, _rgb(0), 3, "RGB"),
    (_rgba, _rgba(0)[..., :3], 3, "RGBA, alpha channel dropped"),
    (_uint16, _uint16(0), 1, "16-bit gray"),
    (_palette, np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255]], np.uint8)[_INDEX], 3, "palette, converted to RGB"),
    (lambda k: _palette(k, gray=True), _GRAYS[_INDEX], 1, "palette, converted to gray"),
])
def test_image_kinds(tmp_path, image, expected, channels, mode):
    _tree(tmp_path / "raw", {"s": 3}, image=image)
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    assert _info(report.out)["in_channels"] == channels
    assert (report.sites[0].channels, report.sites[0].modes) == ([channels], [mode])
    assert f"| channels {channels} ({mode})" in str(report)
    pixels, _ = read_array(tmp_path / "raw/s/images/case00.png")  # what the checker reads
    assert pixels.dtype == expected.dtype and np.array_equal(pixels, expected)
    item = site_dataset(report.out, "s", "training", size=W)[0]  # what training reads
    assert item["image"].shape == (channels, W, W) and item["image"].std() > 0.5
    assert check_dataset(report.out) == []


def test_palette_mask_keeps_its_indices(tmp_path):
    def palette_mask(k):
        img = Image.fromarray(_mask(1), mode="L").convert("P")
        img.putpalette([0, 0, 0, 255, 255, 0])  # index 1 drawn yellow
        return img

    _tree(tmp_path / "raw", {"s": 3}, mask=palette_mask)
    mask, _ = read_array(tmp_path / "raw/s/masks/case00.png", mask=True)
    assert np.array_equal(mask, _mask(1))  # indices, not the yellow it is drawn in
    report = index_report("generic", tmp_path / "raw", tmp_path / "out")
    assert report.sites[0].notes == ["masks: binary, foreground value 1"]
    assert site_dataset(report.out, "s", "training", size=W)[0]["label"].shape == (1, W, W)
    assert check_dataset(report.out) == []


def test_images_with_different_channel_counts(tmp_path):
    _tree(tmp_path / "raw", {"a": 2})
    _tree(tmp_path / "raw", {"b": 2}, image=_rgba)
    with pytest.raises(DataError) as err:
        index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    raw = tmp_path / "raw"
    assert _error(err) == (
        f"images have different channel counts (1 channel(s): 2 image(s), e.g. [a] {raw / 'a/images/case00.png'}; "
        f"3 channel(s): 2 image(s), e.g. [b] {raw / 'b/images/case00.png'}). Fix: convert the images to one kind "
        "(all grayscale or all RGB) before indexing")


@pytest.mark.parametrize("sides, size", [([8], 8), ([40, 48, 300], 32), ([384] * 3, 256), ([800, 900], 256),
                                         ([200, 180, 150], 128), ([3], 4)])
def test_suggested_train_size(sides, size):
    assert suggested_train_size(sides) == size


# ---- layout ------------------------------------------------------------------------------------------


def test_published_split_keeps_test_and_names_cases_by_part(tmp_path):
    raw = tmp_path / "raw"
    for site in ("Hôpital Nord", "St. Mary's"):
        for part, n in (("train", 4), ("test", 2)):
            for k in range(n):
                _save(raw / site / part / "images" / f"case{k:02d}.png", _gray(k))
                _save(raw / site / part / "masks" / f"case{k:02d}.png", _mask(255))
    out = index_dataset("generic", raw, tmp_path / "out")
    assert _info(out)["sites"] == ["Hôpital Nord", "St. Mary's"]
    for site in ("Hôpital Nord", "St. Mary's"):
        datalist = _datalist(out, site)

        def entry(part, k):
            return {"image": str(raw / site / part / "images" / f"case{k:02d}.png"),
                    "label": str(raw / site / part / "masks" / f"case{k:02d}.png"),
                    "case": f"{part}/case{k:02d}", "label_map": {"0": 0, "255": 1}}

        assert datalist["testing"] == [entry("test", 0), entry("test", 1)]
        assert len(datalist["validation"]) == 1
        assert sorted(datalist["training"] + datalist["validation"], key=lambda e: e["case"]) == [
            entry("train", k) for k in range(4)]
    assert check_dataset(out) == []


def test_unpaired_files_are_named(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"s": 2})
    _save(raw / "s/images/extra.png", _gray())
    _save(raw / "s/masks/orphan.png", _mask())
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        "2 unpaired file(s):\n"
        f"  - [s] {raw / 's/images/extra.png'}: no mask named extra.* in {raw / 's/masks'}\n"
        f"  - [s] {raw / 's/masks/orphan.png'}: no image named orphan.* in {raw / 's/images'}\n"
        "Fix: add the missing files or move the unpaired ones out of the data folder")


def test_unpaired_files_in_the_published_split(tmp_path):
    raw = tmp_path / "raw"
    _save(raw / "s/train/images/a.png", _gray())
    _save(raw / "s/train/masks/a.png", _mask())
    _save(raw / "s/test/images/a.png", _gray())
    (raw / "s/test/masks").mkdir()
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        "1 unpaired file(s):\n"
        f"  - [s] {raw / 's/test/images/a.png'}: no mask named a.* in {raw / 's/test/masks'}\n"
        "Fix: add the missing files or move the unpaired ones out of the data folder")


def test_layout_errors(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"both": 2, "dup": 2})
    _save(raw / "both/train/images/a.png", _gray())
    _save(raw / "dup/images/case00.jpg", _gray())
    (raw / "docs").mkdir()
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        f"1 file(s) with the name of another file in {raw / 'dup/images'}:\n"
        f"  - [dup] {raw / 'dup/images/case00.png'}: same name as case00.jpg\n"
        "Fix: keep one file per name (move the others out of the data folder)")
    (raw / "dup/images/case00.jpg").unlink()
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        f"1 problem(s) in dataset {raw}:\n"
        f"  - [both] {raw / 'both'}: holds both images/, masks/ and train/. Fix: keep either <site>/images + "
        "<site>/masks, or <site>/train and <site>/test each with images + masks")


def test_other_folders_are_reported_not_indexed(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"s": 3})
    (raw / "docs").mkdir()
    report = index_report("generic", raw, raw / "index")
    report = index_report("generic", raw, raw / "index")  # again: the output folder is not a site
    assert _info(raw / "index")["sites"] == ["s"]
    assert report.ignored == [f"{raw / 'docs'}: not a site folder (no images/, masks/, train/ or test/ inside)"]
    assert str(report).endswith(f"\nignored 1 file(s) or folder(s) under {raw} (not indexed):\n  - {raw / 'docs'}: not "
                                "a site folder (no images/, masks/, train/ or test/ inside)")


def test_files_a_site_does_not_read_are_counted_and_named(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"s": 3, "t": 3})
    _save(raw / "s/images/more/case09.png", _gray())  # a sub-folder of images/: not read
    (raw / "s/images/notes.txt").write_text("x")
    (raw / "s/README.md").write_text("x")
    (raw / "t/masks/old").mkdir()  # a sub-folder of masks/: not read
    (raw / "readme.txt").write_text("x")
    (raw / "s/images/.DS_Store").write_text("x")  # hidden: not listed
    report = index_report("generic", raw, tmp_path / "out")
    assert report.ignored == [
        f"{raw / 'readme.txt'}: a file beside the site folders, not read",
        f"{raw / 's/README.md'}: not read (a site folder holds images/ and masks/ only)",
        f"{raw / 's/images/more'}: a sub-folder of images/ (only files directly in images/ are read)",
        f"{raw / 's/images/notes.txt'}: not an image file (PNG, JPEG or NIfTI)",
        f"{raw / 't/masks/old'}: a sub-folder of masks/ (only files directly in masks/ are read)",
    ]
    assert f"ignored 5 file(s) or folder(s) under {raw} (not indexed):" in str(report)
    assert _info(tmp_path / "out")["sites"] == ["s", "t"]


def test_shape_mismatch_is_found_at_indexing(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"s": 2})
    _save(raw / "s/masks/case01.png", np.zeros((H, W + 1), np.uint8))
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        f"1 problem(s) in dataset {raw}:\n"
        f"  - [s] {raw / 's/masks/case01.png'}: mask shape (8, 13) differs from image {raw / 's/images/case01.png'} "
        "shape (8, 12). Fix: pair the mask with its own image, or resample the mask onto the image grid")


def test_every_bad_mask_is_reported_in_one_pass(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"a": 3, "b": 3})
    (raw / "a/masks/case01.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    _save(raw / "b/masks/case02.png", np.zeros((H, W + 1), np.uint8))
    _save(raw / "b/images/extra.png", _gray())
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    text = _error(err)
    assert text.startswith(f"2 problem(s) in dataset {raw}:\n  - [a] {raw / 'a/masks/case01.png'}: cannot read file")
    assert f"  - [b] {raw / 'b/masks/case02.png'}: mask shape (8, 13) differs" in text
    assert text.endswith(f"1 unpaired file(s):\n  - [b] {raw / 'b/images/extra.png'}: no mask named extra.* in "
                         f"{raw / 'b/masks'}\nFix: add the missing files or move the unpaired ones out of the data "
                         "folder")
    assert [p.code for p in err.value.problems] == ["unreadable_file", "shape_mismatch"]


def test_options_of_other_layouts(tmp_path):
    with pytest.raises(DataError, match=r"apply to --layout generic; layout 'fundus' knows its masks"):
        index_dataset("fundus", tmp_path, tmp_path / "out", mask_threshold=127)


# ---- command line ------------------------------------------------------------------------------------


def test_cli_index(tmp_path, capsys):
    _jpeg_tree(tmp_path / "raw")
    args = ["data", "index", "--layout", "generic", "--root", str(tmp_path / "raw"), "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "Fix: pass --mask-threshold 127" in capsys.readouterr().err
    assert main(args + ["--mask-threshold", "127", "--classes", "lesion"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[1:] == [
        "dataset.json: classes lesion (nested), in_channels 3, train_size 32",
        "[Clinic] cases: training 1, validation 1, testing 1 | foreground 23.44 % | size 32x32 (HxW) | "
        "channels 3 (RGB)",
        "    masks: value > 127 is foreground (--mask-threshold)",
    ]


# ---- decisions without files -------------------------------------------------------------------------


def test_format_and_describe_values():
    assert format_values([0, 1, 2, 253, 255]) == "0..2, 253, 255"
    assert format_values(range(0, 40, 2), limit=3) == "0, 2, 4, ... (20 values)"
    assert describe_values([0, 1, 2, 254, 255]) == "5 values in 0..2 and 254..255"
    assert describe_values([0, 85, 170, 255]) == "0, 85, 170, 255"


@pytest.mark.parametrize("values, lossy", [((0, 1, 2, 253, 254, 255), True), ((0, 1, 2, 3), False),
                                           ((0, 85, 170, 255), False), ((0, 255), False), ((0, 40, 255), False)])
def test_looks_lossy_binary(values, lossy):
    assert looks_lossy_binary(values) is lossy


@pytest.mark.parametrize("values, classes, threshold, expected", [
    ([(0, 9)], None, None, SiteEncoding({"0": 0, "9": 1}, None, "masks: binary, foreground value 9")),
    ([(0, 1), (0,)], None, None, SiteEncoding(None, None, "masks: binary, foreground value 1")),
    ([(0, 1, 250)], None, 100, SiteEncoding(None, 100, "masks: value > 100 is foreground (--mask-threshold)")),
    ([(0, 2), (0, 1)], ["a", "b"], None, SiteEncoding(None, None, "masks: labelled 0..2 (0 background, 1 a, 2 b)")),
    ([(0.0, 0.25, 0.9)], None, 0.5, SiteEncoding(None, 0.5, "masks: value > 0.5 is foreground (--mask-threshold)")),
])
def test_site_encoding(values, classes, threshold, expected):
    masks = [MaskValues(f"/m{k}.png", v) for k, v in enumerate(values)]
    assert site_encoding("s", masks, classes, threshold) == expected


@pytest.mark.parametrize("mask, problem, fix", [
    (MaskValues("/m.png", (0, 255), colour_differs=True), "colour mask with differing channels",
     "save the mask as a single-channel (grayscale) image with values 0..C"),
    (MaskValues("/m.nii.gz", (0.0, 0.5, 1.0)), "mask has non-integer values (0.5)",
     "pass --mask-threshold 0.5 for a soft or probability mask, or save the masks with integer labels 0..C"),
    (MaskValues("/m.png", (0, 1, 255)), "mask with 3 values in 0..1 and 255: neither binary (0 and one foreground "
     "value) nor clearly class labels",
     "pass --mask-threshold 127 if it is a binary mask with noise (values above it are foreground), or --classes "
     "with 2 names if the values are labels"),
    (MaskValues("/m.png", (255,)), "every mask holds only the value 255",
     "check that this folder holds the site's masks (a binary mask holds 0 and one foreground value)"),
])
def test_site_encoding_problems(mask, problem, fix):
    result = site_encoding("s", [mask])
    assert (result.site, result.file, result.problem, result.fix) == ("s", mask.path, problem, fix)


def test_site_without_files(tmp_path):
    raw = tmp_path / "raw"
    _tree(raw, {"s": 3})
    (raw / "empty/images").mkdir(parents=True)
    (raw / "empty/masks").mkdir()
    with pytest.raises(DataError) as err:
        index_dataset("generic", raw, tmp_path / "out")
    assert _error(err) == (
        f"1 problem(s) in dataset {raw}:\n"
        f"  - [empty] {raw / 'empty'}: no image files in its images/ and masks/ folders. Fix: add the site's images "
        "and masks (PNG, JPEG or NIfTI), or remove the site folder")


def test_threshold_entries():
    mask = np.array([[0, 3], [200, 255]], np.uint8)
    assert map_labels("s", "/m.jpg", mask, None, 1, threshold=127).tolist() == [[0, 0], [1, 1]]
    assert str(label_problem("s", "/m.jpg", mask, {"0": 0}, 1, threshold=127)) == (
        "[s] /m.jpg: the datalist entry has both label_map and label_threshold. Fix: keep one of them in the entry "
        "(re-index the data)")


def test_train_size_is_validated(tmp_path):
    _tree(tmp_path / "raw", {"s": 3})
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    (out / "dataset.json").write_text(json.dumps(dict(_info(out), train_size=2)))
    assert [p.problem for p in check_dataset(out)] == ["'train_size' must be an integer >= 4, got 2"]
