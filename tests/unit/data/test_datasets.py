"""Tests of the training datasets (2D slices from datalists)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from pflseg.data import DataError, case_of, index_dataset, load_dataset_info, pooled_dataset, site_dataset
from tests.unit.data.helpers import write_png


def _depths(root, site, split):
    entries = json.loads((root / site / "datalist.json").read_text())[split]
    return [nib.load(str(root / site / e["image"])).shape[2] for e in entries]


def test_items_shapes_dtypes_and_binary_labels(synth_root):
    ds = site_dataset(synth_root, "site-2", "training", size=24)
    assert len(ds) == sum(_depths(synth_root, "site-2", "training"))
    item = ds[0]
    assert item["image"].shape == (1, 24, 24) and item["image"].dtype == torch.float32
    assert item["label"].shape == (1, 24, 24) and item["label"].dtype == torch.float32
    assert set(torch.cat([ds[i]["label"].unique() for i in range(len(ds))]).tolist()) == {0.0, 1.0}
    assert isinstance(item["case"], str) and isinstance(item["slice"], int)
    assert case_of(item) == ("site-2", item["case"])


def test_per_image_normalisation(synth_root):
    for item in site_dataset(synth_root, "site-1", "validation", size=32):
        assert abs(item["image"].mean().item()) < 1e-4
        assert abs(item["image"].std().item() - 1) < 0.02


def test_items_keep_the_intensity_that_z_scoring_removed(synth_root):
    """FedSM's selector reads image * std + mean: the resized slice in its file's units (site-1 renders at
    scale ~1000, site-2 at ~300: their z-scored images alone do not say so)."""
    means = {}
    for site in ("site-1", "site-2"):
        item = site_dataset(synth_root, site, "validation", size=32)[0]
        assert item["intensity"].shape == (1, 2) and item["intensity"][0, 1] > 0
        raw = item["image"] * item["intensity"][:, 1, None, None] + item["intensity"][:, 0, None, None]
        assert torch.allclose(raw.mean(), item["intensity"][0, 0], rtol=1e-4)
        assert torch.allclose(raw.std(unbiased=False), item["intensity"][0, 1], rtol=1e-3)
        means[site] = float(item["intensity"][0, 0])
    assert means["site-1"] > means["site-2"]


def test_slices_cover_cases_in_order(synth_root):
    ds = site_dataset(synth_root, "site-1", "testing", cache=False)
    keys = [(ds[i]["case"], ds[i]["slice"]) for i in range(len(ds))]
    assert len(keys) == len(set(keys)) == sum(_depths(synth_root, "site-1", "testing"))
    assert {s for _, s in keys} == set(range(4))
    cached = site_dataset(synth_root, "site-1", "testing", cache=True)
    assert all(torch.equal(cached[i]["image"], ds[i]["image"]) for i in range(len(ds)))


def test_foreground_only(synth_root):
    ds = site_dataset(synth_root, "site-1", "training", foreground_only=True)
    assert 0 < len(ds) <= sum(_depths(synth_root, "site-1", "training"))
    assert all(ds[i]["label"].sum() > 0 for i in range(len(ds)))


def test_pooled_dataset_concatenates(synth_root):
    pooled = pooled_dataset(synth_root, None, "validation", size=16)
    parts = [len(site_dataset(synth_root, s, "validation", size=16)) for s in ("site-1", "site-2", "site-3")]
    assert len(pooled) == sum(parts)
    batch = next(iter(torch.utils.data.DataLoader(pooled, batch_size=4)))
    assert batch["image"].shape == (4, 1, 16, 16) and len(batch["case"]) == 4


def test_fundus_nested_channels(tmp_path):
    from pflseg.data import make_synthetic

    root = make_synthetic(tmp_path / "f", task="fundus", n_sites=3, cases=3, size=32, depth=2)
    item = site_dataset(root, "site-1", "training", size=32)[0]
    disc, cup = item["label"]
    assert item["label"].shape == (2, 32, 32) and cup.sum() > 0
    assert torch.all(cup <= disc)  # nested: cup inside disc


def test_png_rgb_channels_first(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (10, 14, 3)).astype(np.uint8)
    image[..., 2] = 7  # constant channel
    for k in range(3):
        write_png(tmp_path / f"raw/s/images/{k}.png", image)
        write_png(tmp_path / f"raw/s/masks/{k}.png", np.eye(10, 14))
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    assert load_dataset_info(out)["in_channels"] == 3
    item = site_dataset(out, "s", "training", size=10)[0]
    assert item["image"].shape == (3, 10, 10)
    assert torch.allclose(item["image"][2], torch.zeros(10, 10))  # constant channel z-scores to 0
    assert abs(item["image"][0].std().item() - 1) < 0.05


def test_png_keeps_row_column_order(tmp_path):
    mask = np.zeros((8, 8), np.uint8)
    mask[0, :] = 1  # first row
    for k in range(3):
        write_png(tmp_path / f"raw/s/images/{k}.png", np.full((8, 8), k * 10))
        write_png(tmp_path / f"raw/s/masks/{k}.png", mask)
    out = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    label = site_dataset(out, "s", "training", size=8)[0]["label"][0]
    assert label[0].sum() == 8 and label[:, 0].sum() == 1


def test_errors_name_the_problem(synth_root, tmp_path):
    with pytest.raises(DataError, match="site 'site-7' is not in"):
        site_dataset(synth_root, "site-7", "training")
    with pytest.raises(ValueError, match="split"):
        site_dataset(synth_root, "site-1", "train")
    with pytest.raises(DataError, match="dataset.json not found"):
        load_dataset_info(tmp_path)


def test_nifti_is_read_by_nibabel_without_a_pil_failure_first(synth_root, caplog):
    """Before: the reader list was tried last-first, so PIL failed on (and logged) every NIfTI before nibabel read
    it (24 of a demo's 134 log lines). The slices are the same as that list's."""
    import logging

    from monai.data import NibabelReader, PILReader
    from monai.transforms import LoadImage

    from pflseg.data.files import convert_image

    with caplog.at_level(logging.DEBUG, logger="LoadImage"):
        data = site_dataset(synth_root, "site-1", "training", size=32, cache=False)
        item = data[0]
    assert not [r for r in caplog.records if "PILReader" in r.getMessage()]
    path = data._paths(0)[0]
    listed = LoadImage(reader=[NibabelReader(), PILReader(converter=convert_image, reverse_indexing=False)],
                       image_only=True, dtype=np.float32)(str(path))
    assert np.array_equal(np.asarray(listed), data._read(path)[0])
    assert item["image"].shape == (1, 32, 32)
