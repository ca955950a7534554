"""Helpers shared by the data tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

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
