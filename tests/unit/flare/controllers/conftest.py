"""What every controller test shares: one tiny job config, three sites, a controller whose state ``init_state`` sets
(no FLARE), and FLARE's send replaced by a stub that records each payload and answers as a site would.

The helpers are plain functions and classes, imported by the tests that need them (here and in the guard, boundary,
privacy and fault tests): ``from tests.unit.flare.controllers.conftest import Stub, make``.
"""

from pathlib import Path

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import load_job_config
from pflseg.flare.methods import METHODS
from pflseg.flare.state import RoundStore
from pflseg.flare.wire import GLOBAL, PERSON, STATS, only, prefixed

#: The tiny job every controller test runs: a 2-level UNet of 4 and 8 channels, 2 rounds.
TINY = {"net": {"channels": [4, 8], "strides": [2]}, "rounds": 2}
SITES = ["site-1", "site-2", "site-3"]
#: FedSM's selector with the paper's per-batch steps: weights and Adam moments averaged.
BATCH = {"selector_fit": "softmax", "selector_steps": "batch"}


class Stub:
    """Replaces FLARE's send: records ``(task, site, payload)``, answers with ``reply(site, payload)`` (None: the
    site gives no answer). TensorBoard scalars are recorded in ``scalars``."""

    def __init__(self, controller, reply):
        self.sent, self.scalars = [], []
        controller.send_model = self.send_model
        controller.log_scalars = lambda tag, values, step: self.scalars.append((tag, values, step))
        controller.get_num_standing_tasks = lambda: 0
        self.reply = reply

    def send_model(self, task_name, data, targets, timeout, callback):
        (site,) = targets
        self.sent.append((task_name, site, data))
        answer = self.reply(site, data)
        if answer is not None:
            answer.meta["client_name"] = site
            callback(answer)


def make(method: str, tmp_path: Path, monkeypatch, folder: Path | None = None, **over):
    """The controller of ``method`` on the TINY config with ``over``rides, its state set by ``init_state`` for the
    three SITES, its state folder ``folder`` (default ``<tmp_path>/server``) under the state root ``tmp_path``."""
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    ctrl = METHODS[method].controller(config=load_job_config(method, overrides={**TINY, **over}))
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    ctrl.init_state(ctrl.config, SITES, RoundStore(folder or tmp_path / "server"))
    return ctrl


def scaled(state: dict, factor: float) -> dict:
    """``state`` with every floating tensor times ``factor`` (integer buffers as they are)."""
    return {k: (v * factor if v.is_floating_point() else v) for k, v in state.items()}


def models_of(data) -> dict:
    """What a FedSM site sends back of the models it received (the global and its personalized model)."""
    return only(data.params, GLOBAL, PERSON)


def lda_answer(ctrl, site: str, data, shift: float = 0.0) -> FLModel:
    """A FedSM site's lda answer: features of its 4 images all equal to e_k (+ shift), its class k."""
    ref, k = ctrl.selector_ref, ctrl.sites.index(site)
    d = ref["stats.gram"].shape[0]
    phi = torch.zeros(4, d, dtype=torch.float64)
    phi[:, k] = 1.0 + shift
    phi[:2, -1] += 0.5  # some spread within the site
    stats = {"gram": phi.T @ phi, "sum": torch.zeros_like(ref["stats.sum"]),
             "count": torch.zeros_like(ref["stats.count"])}
    stats["sum"][k], stats["count"][k] = phi.sum(0), 4.0
    return FLModel(params={**models_of(data), **prefixed(STATS, stats)}, metrics={"val_dice": 0.5},
                   meta={"NUM_STEPS_CURRENT_ROUND": 4})
