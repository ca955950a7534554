"""Test-only: makes the site named in $PFLSEG_TEST_EVIL_SITE lie in its answer to every training task. Loaded by
every Python process of a simulator run whose PYTHONPATH starts with this folder (tests/integration/test_malicious.py,
tests/integration/attack_dice.py); does nothing without the variable.

$PFLSEG_TEST_EVIL_ATTACK says how (``ATTACKS``):

``1e30`` (the default)  every float 1e30, n_k 1e6, validation Dice 1.0 (issue 23's attack)
``scaled``              its true update u = trained - received, per float key the site received with the same shape,
                        sent as 99 u (issue 39 F1; for GRACE F6, an update aligned with its own)
``flipped``             -99 u (F1, sign-flipped)
``fixed``               99 ||u|| e, e one unit direction, the same in every round, seed and site (F1, fixed direction)
``dropout``             a control, not a lie: its first training answer honest, every later one with its n_k
                        declared 99x (update and metrics honest), so the server refuses it from round 2 on: an honest
                        site that leaves after round 1, the liar's path without the lie (answers counted in the
                        site's process: a restarted site would start honest again)

(99: $PFLSEG_TEST_EVIL_FACTOR, if set.)

The three issue-39 attacks also declare n_k (meta ``NUM_STEPS_CURRENT_ROUND``) 99x its honest value and leave the
metrics honest; integer buffers pass unchanged. The site's reply is taken as it leaves (full weights by default;
with ``privacy.update.send: diff`` the reply is u itself and the lie is sent as a difference too).
"""

import importlib.abc
import importlib.util
import os
import sys

EVIL = os.environ.get("PFLSEG_TEST_EVIL_SITE")
ATTACK = os.environ.get("PFLSEG_TEST_EVIL_ATTACK", "1e30")
ATTACKS = ("1e30", "scaled", "flipped", "fixed", "dropout")
#: the update's factor ($PFLSEG_TEST_EVIL_FACTOR, default 99: below 99 the lie stays further inside the server's
#: 100x norm bound) and the declared n_k's (always 99)
FACTOR = float(os.environ.get("PFLSEG_TEST_EVIL_FACTOR", "99"))
N_K_FACTOR = 99.0


def lie(kind: str, sent: dict, received: dict, diff: bool = False) -> dict:
    """What the lying site sends instead of ``sent`` (its honest reply's params) under attack ``kind`` (not "1e30"),
    given ``received`` (the params of the task it answers); ``diff``: ``sent`` holds updates, not weights."""
    import torch

    keys = sorted(k for k, v in sent.items() if v.is_floating_point() and torch.is_tensor(received.get(k))
                  and received[k].shape == v.shape)
    base = {k: (torch.zeros_like(received[k], dtype=torch.float64) if diff else received[k].double()) for k in keys}
    update = {k: sent[k].double() - base[k] for k in keys}
    if kind == "scaled":
        bad = {k: FACTOR * u for k, u in update.items()}
    elif kind == "flipped":
        bad = {k: -FACTOR * u for k, u in update.items()}
    elif kind == "fixed":
        norm = float(torch.sqrt(sum((u ** 2).sum() for u in update.values()))) if keys else 0.0
        gen = torch.Generator().manual_seed(1000)  # the same direction every round, seed and site
        e = {k: torch.randn(update[k].shape, generator=gen, dtype=torch.float64) for k in keys}
        e_norm = float(torch.sqrt(sum((v ** 2).sum() for v in e.values()))) if keys else 1.0
        bad = {k: FACTOR * norm * v / e_norm for k, v in e.items()}
    else:
        raise ValueError(f"PFLSEG_TEST_EVIL_ATTACK={kind!r}: not one of {ATTACKS}")
    return {**sent, **{k: (base[k] + bad[k]).to(sent[k].dtype) for k in keys}}


def _patch(module):
    import torch
    from nvflare.app_common.abstract.fl_model import ParamsType

    if ATTACK not in ATTACKS:
        raise ValueError(f"PFLSEG_TEST_EVIL_ATTACK={ATTACK!r}: not one of {ATTACKS}")
    real = module.answer
    answered = []

    def answer(name, task, msg, site, job_id=None):
        out, site = real(name, task, msg, site, job_id)
        if name == EVIL and task == "train" and out.params and not out.meta.get("pflseg_error"):
            answered.append(task)
            if ATTACK == "dropout":
                if len(answered) > 1:
                    out.meta["NUM_STEPS_CURRENT_ROUND"] = int(N_K_FACTOR * out.meta["NUM_STEPS_CURRENT_ROUND"])
            elif ATTACK == "1e30":
                out.params = {k: (torch.full_like(v, 1e30) if v.is_floating_point() else v)
                              for k, v in out.params.items()}
                out.meta["NUM_STEPS_CURRENT_ROUND"] = 1_000_000
                out.metrics = {**(out.metrics or {}), "val_dice": 1.0}
            else:
                out.params = lie(ATTACK, out.params, msg.params or {}, out.params_type == ParamsType.DIFF)
                out.meta["NUM_STEPS_CURRENT_ROUND"] = int(N_K_FACTOR * out.meta["NUM_STEPS_CURRENT_ROUND"])
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
