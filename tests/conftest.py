import os
from pathlib import Path

# one OpenMP thread in every process the tests start (FLARE simulator, server and site processes inherit it):
# tiny tensors gain nothing from more, and 4 workers each running FLARE processes of two threads oversubscribe
# the cores. Measured on the 2-core machine, whole suite: 866 s with the default, 672 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# and one torch thread per pytest worker (a 3 s test took 270 s with the default beside the simulators)
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
