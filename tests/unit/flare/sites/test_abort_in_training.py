"""A task aborted while the site trains (``pflseg.flare.executor.SiteExecutor`` with ``pflseg.train.loop.stop_when``):
answered TASK_ABORTED at once, the site's worker stops before its next batch, nothing of the round is written; the
site goes on with its next task as if the aborted one had never begun. A real FedAvg site, no FLARE process."""

import logging
import time

import torch
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

import pflseg.flare.sites.base as site_base
from pflseg.flare.executor import SiteExecutor
from pflseg.flare.state import release
from tests.unit.flare.sites.conftest import Federation
from tests.unit.flare.test_executor import context

# thousands of batches: the whole task would take minutes (batch 4: a deployed site's least, policy.min_batch_size)
LONG = {"train": {"batch_size": 4, "epochs": 1000}}
THREE = {"sites": ["site-1", "site-2", "site-3"]}  # a job with a real job id: a site refuses two sites


def test_an_abort_during_training_stops_the_site_within_a_batch_and_writes_nothing(tiny_root, tmp_path, monkeypatch,
                                                                                    caplog):
    fed = Federation("fedavg", tiny_root, tmp_path / "state", monkeypatch, **LONG)
    abort, batches = Signal(), []
    real_loss = site_base.build_loss

    def counted_loss(name):  # the server's timeout comes during the 3rd training batch
        loss = real_loss(name)

        def compute(logits, label):
            batches.append(1)
            if len(batches) == 3:
                abort.trigger(True)
            return loss(logits, label)
        return compute

    monkeypatch.setattr(site_base, "build_loss", counted_loss)
    ex = SiteExecutor()
    sent = FLModelUtils.to_shareable(fed.message(1, **THREE))
    with caplog.at_level(logging.INFO, logger="pflseg.client"):
        t0 = time.monotonic()
        reply = ex.execute("train", sent, context(job="job-7"), abort)
        answered = time.monotonic() - t0
        assert reply.get_return_code() == ReturnCode.TASK_ABORTED
        while ex._running.is_set() and time.monotonic() - t0 < answered + 2:
            time.sleep(0.01)
        assert not ex._running.is_set()  # the worker stopped soon after, far from the task's end
    assert len(batches) == 3  # the batch it was in ends; the next one is never begun
    assert "task 'train' (round 1) stopped, aborted: training stopped after 3 batch(es), in epoch 1" in caplog.text
    assert fed.store().rounds() == []  # no state of round 1
    root = fed.state / "site-1"
    assert not (root / "site_errors.log").exists()  # no error either: an abort is no failure

    # the site made for the aborted task is kept, and its next round is what a fresh site computes
    site = ex._site
    assert site is not None and site.store.root == fed.store().root
    site.cfg["train"]["epochs"] = 1
    reply = ex.execute("train", FLModelUtils.to_shareable(fed.message(2, **THREE)), context(job="job-7"), Signal())
    assert reply.get_return_code() == ReturnCode.OK and fed.store().rounds() == [2]
    got = FLModelUtils.from_shareable(reply)
    release(fed.store().root)
    monkeypatch.setattr(site_base, "build_loss", real_loss)
    fresh = Federation("fedavg", tiny_root, tmp_path / "fresh", monkeypatch,
                       train={**LONG["train"], "epochs": 1}).site(sites=THREE["sites"])
    expected = fresh.train(fed.message(2, **THREE))
    assert got.params.keys() == expected.params.keys()
    assert all(torch.equal(got.params[k], expected.params[k]) for k in expected.params)
    assert got.metrics["train_loss"] == expected.metrics["train_loss"]
