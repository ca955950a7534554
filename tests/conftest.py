import os
import random
from pathlib import Path

# one OpenMP thread in every process the tests start (FLARE simulator, server and site processes inherit it):
# tiny tensors gain nothing from more, and 4 workers each running FLARE processes of two threads oversubscribe
# the cores. Measured on the 2-core machine, whole suite: 866 s with the default, 672 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# and one torch thread per pytest worker (a 3 s test took 270 s with the default beside the simulators)
torch.set_num_threads(1)
DETERMINISTIC = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

# The order tests run in is shuffled, with a seed printed in the header: a test that passes only after (or before)
# some other test shows up by chance in a later run, and the run that showed it can be replayed. Modules stay whole
# (their module-scoped fixtures are built once), the slow ones first (as in file order: the long FLARE runs start
# while the workers have the most left to overlap them with); a module marked in_file_order keeps its tests' order.
ORDER_SEED = "PFLSEG_TEST_ORDER_SEED"  # an integer replays that order; "off": file order


def _order_seed() -> int | None:
    value = os.environ.get(ORDER_SEED, "").strip()
    if value.lower() == "off":
        return None
    try:
        return int(value) if value else random.SystemRandom().randrange(10**6)
    except ValueError:
        raise pytest.UsageError(f"{ORDER_SEED}={value!r}: an integer, or off for file order") from None


def pytest_configure(config):
    config.addinivalue_line("markers", "in_file_order: the module's tests run in file order (they share state that "
                                       "each changes), never shuffled")
    seed = _order_seed()
    # set for the xdist workers too, which start after this and inherit it: every worker collects the same order
    os.environ[ORDER_SEED] = "off" if seed is None else str(seed)
    config.pflseg_order_seed = seed


def pytest_report_header(config):
    seed = config.pflseg_order_seed
    if seed is None:
        return f"test order: file order ({ORDER_SEED}=off)"
    return f"test order: shuffled, {ORDER_SEED}={seed} (set it to replay this order; off: file order)"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    seed = config.pflseg_order_seed
    if seed is None:
        return
    rng = random.Random(seed)
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    order.sort(key=lambda tests: tests[0].get_closest_marker("slow") is None)  # stable: shuffled within each part
    for tests in order:
        if tests[0].get_closest_marker("in_file_order") is None:
            rng.shuffle(tests)
    items[:] = [item for tests in order for item in tests]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Every test, and every fixture it builds first (module- or session-scoped ones too), starts from the same
    process state whatever ran before it in that worker: python, numpy and torch seeded, one torch thread (a site
    object sets its ``threads`` setting, and the thread count changes float sums, so trained weights), torch's
    deterministic-algorithms switch as the worker started (``seed_everything`` turns it on)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(DETERMINISTIC[0], warn_only=DETERMINISTIC[1])


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
    for var in ("PFLSEG_DATA", "PFLSEG_DEVICE", "PFLSEG_SITE_CONFIG", "PFLSEG_STATE_DIR", "PFLSEG_BUNDLE_ROOTS"):
        monkeypatch.delenv(var, raising=False)
    os.environ.setdefault("PFLSEG_CONFIGS", str(REPO / "app_configs"))
