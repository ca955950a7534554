"""A run stopped in its last round and resumed equals the uninterrupted run, bit for bit, for every training method
(and the FedSM variants whose server state differs: softmax selectors with Adam moments or gradients, FedSM-extra
resumed inside its selector phase). Transport stubbed: each site answers deterministically from what it was sent, so
any difference is server state the checkpoint lost. Thread-count invariance and the sites' own state on resume are
checked in the simulator (tests/integration/test_simulator.py, test_ditto.py, test_iopfl.py)."""

from types import SimpleNamespace

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedsm import TEMPERATURES
from pflseg.flare.controllers.base import PostTrainingController
from pflseg.flare.methods import METHODS
from tests.unit.flare.controllers.conftest import BATCH, SITES, Stub, lda_answer, make

LC = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}}
#: the config each method's controller needs beyond the tiny job's (its net)
NEEDS = {"lcfed": LC, "fedrep": LC}
#: every training method of the registry, and the FedSM variants with server state of their own
CASES = {**{name: NEEDS.get(name, {}) for name, m in METHODS.items()
            if not issubclass(m.controller, PostTrainingController)},
         "fedsm_batch": {"fedsm": BATCH},
         "fedsm_epoch": {"fedsm": {"selector_fit": "softmax", "selector_steps": "epoch"}},
         "fedsm_extra": {"fedsm": {"extra_rounds": 2}}}  # 4 rounds: stopped in round 4, resumed in the extra phase


def moved(value: torch.Tensor, k: int, r: int) -> torch.Tensor:
    """What site ``k`` 'trains' ``value`` into in round ``r``: a site- and round-specific change (integers + 1)."""
    if not value.is_floating_point():
        return value + 1
    return value * (1.0 + 0.01 * (k + 1)) + 0.001 * (r + 1) * (k + 1)


def answer(ctrl, site: str, data, reference: dict) -> FLModel:
    """A site's deterministic answer to any training task: every key of ``reference`` (what was sent, or the
    reference's own tensor where nothing was: heads, gradients) moved; Adam moments and LDA statistics valid."""
    k, r = SITES.index(site), data.current_round
    params = {}
    for key, ref in reference.items():
        sent = data.params.get(key, ref)
        if key.startswith("moment."):
            name = key.rsplit(".", 1)[1]
            params[key] = sent + 1 if name == "step" else torch.full_like(ref, 0.01 * (k + 1) if name == "exp_avg"
                                                                            else 0.01)
        elif not key.startswith("stats."):
            params[key] = moved(sent, k, r)
    n_k = max(1, 4 - r)  # falling: the first accepted n_k (n_first) stays the largest
    if any(key.startswith("stats.") for key in reference):  # statistics of its 4 images
        n_k = 4
        params.update({key: v for key, v in lda_answer(ctrl, site, data, shift=0.1 * r).params.items()
                       if key.startswith("stats.")})
    # scores that fall: the best models stay those of the first rounds, which a resumed run must remember
    metrics = {"val_dice": 0.3 + 0.1 * k - 0.05 * r, "val_dice_person": 0.4 + 0.05 * k - 0.05 * r,
               "selector_val_acc": 0.9 - 0.1 * r, "selector_val_nll": [1.0 + abs(i - k) for i in
                                                                        range(len(TEMPERATURES))],
               "selector_loss": 1.0 / (r + 1)}
    return FLModel(params=params, metrics=metrics, meta={"NUM_STEPS_CURRENT_ROUND": n_k})


def run(ctrl, start: int, stop: int | None = None) -> None:
    """``ctrl.run_rounds()`` from round ``start`` (setup done by ``make``) to the end, or killed while round ``stop``
    runs (before its checkpoint); the final validate / test phase left out."""
    stub = Stub(ctrl, lambda site, data: None)
    send_each = ctrl.send_each

    def send(task, payloads, reference=None):
        stub.reply = lambda site, data: answer(ctrl, site, data, reference or {})
        if payloads and next(iter(payloads.values())).current_round == stop:
            ctrl.abort_signal.triggered = True
        return send_each(task, payloads, reference)

    ctrl.send_each = send
    ctrl.abort_signal = SimpleNamespace(triggered=False)
    ctrl.setup, ctrl.finish = lambda: start, lambda: None
    ctrl.run_rounds()


def assert_same(a, b, where: str = "checkpoint") -> None:
    """Equal nested data, tensors bit for bit (equal dtype, shape and values); round wall times ignored."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, sorted(set(a) ^ set(b)))
        for key in a:
            if key != "wall_seconds":
                assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def stopped_and_resumed(method: str, tmp_path, monkeypatch, **over) -> tuple:
    """The last round's checkpoint of an uninterrupted run and of a run killed in its last round and resumed."""
    straight = make(method, tmp_path / "straight", monkeypatch, **over)
    last = straight.n_rounds() - 1
    run(straight, 0)
    stopped = make(method, tmp_path / "stopped", monkeypatch, **over)
    run(stopped, 0, stop=last)
    assert stopped.store.latest() == last - 1  # killed before its last round's checkpoint
    resumed = make(method, tmp_path / "stopped", monkeypatch, resume=True, **over)
    assert len(resumed.state.history) == last  # restored: the rounds before the kill
    run(resumed, last)
    return straight, resumed


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_run_equals_the_uninterrupted_run(case, tmp_path, monkeypatch):
    method = case.split("_")[0] if case.startswith("fedsm_") else case
    straight, resumed = stopped_and_resumed(method, tmp_path, monkeypatch, **CASES[case])
    last = straight.n_rounds() - 1
    assert [h["round"] for h in resumed.state.history] == list(range(1, last + 2))
    assert_same(straight.store.load(last), resumed.store.load(last))
    assert not resumed.missing and resumed.state.history[-1]["site_metrics"]  # every site sent answered
    if case == "fedsm_batch":  # the state that a resume must carry is there to carry
        assert resumed.state.moments and resumed.state.best_selector["round"] >= 0

