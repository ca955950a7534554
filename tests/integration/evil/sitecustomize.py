"""Test-only: makes the site named in $PFLSEG_TEST_EVIL_SITE answer every training task with every float 1e30,
n_k 1e6 and validation Dice 1.0 (issue 23's attack). Loaded by every Python process of a simulator run whose
PYTHONPATH starts with this folder (tests/integration/test_malicious.py); does nothing without the variable."""

import importlib.abc
import importlib.util
import os
import sys

EVIL = os.environ.get("PFLSEG_TEST_EVIL_SITE")


def _patch(module):
    import torch

    real = module.answer

    def answer(name, task, msg, site, job_id=None):
        out, site = real(name, task, msg, site, job_id)
        if name == EVIL and task == "train" and out.params and not out.meta.get("pflseg_error"):
            out.params = {k: (torch.full_like(v, 1e30) if v.is_floating_point() else v) for k, v in out.params.items()}
            out.meta["NUM_STEPS_CURRENT_ROUND"] = 1_000_000
            out.metrics = {**(out.metrics or {}), "val_dice": 1.0}
        return out, site

    module.answer = answer


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pflseg.flare.client":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if EVIL:
    sys.meta_path.insert(0, _AfterImport())
