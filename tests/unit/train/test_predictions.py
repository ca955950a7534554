"""Prediction files in the input's own size and geometry (issue 26 item 6)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import torch
from PIL import Image
from torch import nn

from pflseg.data import make_synthetic
from pflseg.data.adapters import index_dataset
from pflseg.data.datasets import site_dataset
from pflseg.infer.fedsm import evaluate_super_model
from pflseg.train.predictions import case_sources, write_predictions

#: an oblique affine with anisotropic spacing and an offset: nothing like the identity
AFFINE = np.array([[0.0, -0.9, 0.1, 12.5], [0.8, 0.0, 0.0, -40.0], [0.0, 0.05, 2.5, 7.0], [0.0, 0.0, 0.0, 1.0]])
BLOCK = (slice(8, 20), slice(5, 15))  # the foreground of every slice, in the file's (X, Y) index order


class Positive(nn.Module):
    """Segmentation "model": foreground where the (z-scored) image is > 0."""

    def forward(self, x):
        return torch.where(x[:, :1] > 0, 10.0, -10.0)


class First(nn.Module):
    """Selector: always personalized model 0, confidently."""

    def forward(self, x):
        return torch.tensor([[10.0, -10.0]]).expand(x.shape[0], -1).clone()


def nifti_root(tmp_path):
    """A synthetic root whose site-1 case000 is replaced by a (30, 22, 3) volume with ``AFFINE``: positive inside
    ``BLOCK``, negative elsewhere; its label marks the same block."""
    root = make_synthetic(tmp_path / "root", n_sites=2, cases=[3, 3], size=24, depth=3)
    entry = json.loads((root / "site-1/datalist.json").read_text())["training"][0]
    image = np.full((30, 22, 3), -1.0, np.float32)
    image[BLOCK] = 1.0
    label = (image > 0).astype(np.uint8)
    nib.save(nib.Nifti1Image(image, AFFINE), str(root / "site-1" / entry["image"]))
    nib.save(nib.Nifti1Image(label, AFFINE), str(root / "site-1" / entry["label"]))
    return root, entry


def test_super_model_predictions_of_a_nifti_have_its_shape_affine_and_place(tmp_path):
    """Before: written at the training size (16 x 16 x 3) with an identity affine, useless on the scan."""
    root, entry = nifti_root(tmp_path)
    data = site_dataset(root, "site-1", "training", size=16)
    out = tmp_path / "pred"
    evaluate_super_model(Positive(), [Positive(), Positive()], First(), data, "cpu", gammas=[0.5], save_gamma=0.5,
                         out_dir=out)
    written = nib.load(str(out / f"{entry['case']}.nii.gz"))
    source = nib.load(str(root / "site-1" / entry["image"]))
    assert written.shape == source.shape == (30, 22, 3)
    np.testing.assert_allclose(written.affine, source.affine)
    pred = np.asarray(written.dataobj)
    assert pred.dtype == np.uint8 and set(np.unique(pred)) == {0, 1}
    truth = np.zeros(pred.shape, bool)
    truth[BLOCK] = True
    dice = 2 * (pred.astype(bool) & truth).sum() / (pred.astype(bool).sum() + truth.sum())
    assert dice > 0.85  # the prediction sits where the block is in the scan (not transposed, not shifted)


def test_png_predictions_have_the_input_size(tmp_path):
    """Before: a 17 x 25 PNG got an 8 x 8 prediction."""
    image = np.zeros((17, 25), np.uint8)
    image[4:12, 3:20] = 200
    for k in range(3):
        path = tmp_path / f"raw/s/images/{k}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        (tmp_path / "raw/s/masks").mkdir(parents=True, exist_ok=True)
        Image.fromarray((image > 0).astype(np.uint8)).save(tmp_path / f"raw/s/masks/{k}.png")
    root = index_dataset("generic", tmp_path / "raw", tmp_path / "out")
    data = site_dataset(root, "s", "training", size=8)
    by_case: dict = {}
    for item in data:
        pred = item["image"] > 0
        by_case.setdefault((item["site"], item["case"]), []).append(
            {"slice": item["slice"], "preds": {"m": pred}, "choice": {"r": "m"}})
    names = {case: case[1] for case in by_case}
    write_predictions(by_case, names, "r", tmp_path / "pred", "nested", sources=case_sources(data))
    files = sorted((tmp_path / "pred").iterdir())
    assert [p.suffix for p in files] == [".png"] * len(by_case)
    for path in files:
        with Image.open(path) as im:
            assert im.size == (25, 17)
            assert np.asarray(im)[8, 10] == 1 and np.asarray(im)[0, 0] == 0


def test_without_sources_the_training_size_is_kept():
    """A dataset that is not a SliceDataset names no files: predictions stay at the training size."""
    assert case_sources([{"image": torch.zeros(1, 4, 4)}]) == {}
