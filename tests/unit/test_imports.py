"""``pflseg.algorithms`` is the math alone (../shared/DESIGN.md): importing it, or any of its modules, loads no
FLARE."""

import pkgutil
import subprocess
import sys

import pflseg.algorithms

MODULES = ["pflseg.algorithms"] + [f"pflseg.algorithms.{m.name}"
                                   for m in pkgutil.iter_modules(pflseg.algorithms.__path__)]

# imports each module in turn, printing those after whose import an nvflare module is loaded
CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    if any(m == "nvflare" or m.startswith("nvflare.") for m in sys.modules):
        print(name)
"""


def loads_nvflare(modules: list[str]) -> list[str]:
    # a fresh interpreter: this test process may have imported nvflare through other tests
    run = subprocess.run([sys.executable, "-c", CHECK, *modules], capture_output=True, text=True, check=True)
    return run.stdout.split()


def test_every_algorithms_module_is_checked():
    assert {"pflseg.algorithms.fedavg", "pflseg.algorithms.routing", "pflseg.algorithms.lcfed"} <= set(MODULES)


def test_importing_algorithms_loads_no_nvflare():
    # one interpreter for all (a torch import each would cost seconds): the first name printed is the culprit
    assert loads_nvflare(MODULES) == []


def test_the_check_sees_nvflare():
    assert loads_nvflare(["pflseg.algorithms.fedavg", "nvflare.fuel.utils"]) == ["nvflare.fuel.utils"]
