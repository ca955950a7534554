"""Faults handled without a federation: a dead site is asked again each round and left out again (it is
re-admitted when it answers: tests/unit/flare/controllers/test_base.py), corrupt checkpoints stop a resume with a
clear error, every torch.load in the package uses weights_only."""

import re
from pathlib import Path

import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.controllers.base import RoundError
from pflseg.flare.state import StateError
from tests.unit.flare.controllers.conftest import Stub, make

PACKAGE = Path(__file__).resolve().parents[3] / "custom" / "pflseg"


def test_a_site_that_stopped_answering_is_asked_again_and_left_out_again(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, rounds=3)
    stub = Stub(ctrl, lambda site, data: None if site == "site-3" else
                FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    ctrl.round(0)
    out = ctrl.round(1)
    sent = [(task, site) for task, site, _ in stub.sent]
    assert sent.count(("train", "site-3")) == 2 and sent.count(("train", "site-1")) == 2
    assert (ctrl.missing["site-3"].startswith("no result")
            and set(out.metrics["val_dice"]) == {"site-1", "site-2"})


def test_min_clients_counts_the_dead_site(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, min_clients=3)
    Stub(ctrl, lambda site, data: None if site == "site-3" else
         FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    with pytest.raises(RoundError, match="min_clients=3"):
        ctrl.round(0)


def test_resume_from_a_corrupt_server_checkpoint_is_refused(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    ctrl.store.save(0, ctrl.checkpoint(0))
    path = ctrl.store.path(0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a partial write / damaged disk
    ctrl.cfg["resume"] = True
    with pytest.raises(StateError, match=re.escape(str(path))):
        ctrl.restore()


def test_every_torch_load_uses_weights_only():
    calls = [(p, line) for p in PACKAGE.rglob("*.py") for line in p.read_text().splitlines() if "torch.load(" in line]
    assert calls, "expected torch.load calls in the package"
    assert all("weights_only=True" in line for _, line in calls), [f"{p}: {line}" for p, line in calls]
