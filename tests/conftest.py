import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# one torch thread per pytest worker: tiny tensors gain nothing from more, and 4 workers each spinning two
# threads beside the FLARE simulators oversubscribe the cores (a 3 s test took 270 s that way)
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    for var in ("PFLSEG_DATA", "PFLSEG_DEVICE", "PFLSEG_SITE_CONFIG", "PFLSEG_STATE_DIR", "PFLSEG_BUNDLE_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("PFLSEG_CONFIGS", str(REPO / "app_configs"))
