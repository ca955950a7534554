"""Shared fixtures for the data tests: a tiny synthetic root and the real-format fixture folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pflseg.data import make_synthetic


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory) -> Path:
    """A small synthetic prostate root: 3 sites (the last one outside), 5/4/3 cases, 32 px, 4 slices."""
    return make_synthetic(tmp_path_factory.mktemp("synth") / "root", n_sites=3, cases=[5, 4, 3], size=32, depth=4)


@pytest.fixture
def clean_root(synth_root, tmp_path) -> Path:
    """A private copy of the synthetic root that a test may damage."""
    return Path(shutil.copytree(synth_root, tmp_path / "root"))
