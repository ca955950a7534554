"""Shared fixtures for the data tests: a tiny synthetic root and the real-format fixture folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pflseg.data import make_synthetic

FIXTURES = Path(__file__).resolve().parents[3].parent / "shared/data/fixtures"


def fixture_dir(name: str) -> Path:
    """A folder of the shared real-format fixtures; skips the test when it is absent."""
    path = FIXTURES / name
    if not path.is_dir():
        pytest.skip(f"shared fixtures not found at {path}")
    return path


def write_png(path: Path, array: np.ndarray) -> Path:
    """Writes a uint8 array (H, W) or (H, W, 3) as PNG, creating folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, np.uint8)).save(path)
    return path


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory) -> Path:
    """A small synthetic prostate root: 3 sites (the last one outside), 5/4/3 cases, 32 px, 4 slices."""
    return make_synthetic(tmp_path_factory.mktemp("synth") / "root", n_sites=3, cases=[5, 4, 3], size=32, depth=4)


@pytest.fixture
def clean_root(synth_root, tmp_path) -> Path:
    """A private copy of the synthetic root that a test may damage."""
    return Path(shutil.copytree(synth_root, tmp_path / "root"))
