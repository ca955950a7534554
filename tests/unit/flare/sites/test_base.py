"""The round skeleton every site trains through (``Site.run_round``): seed, previous state, timing, save, reply."""

import time
from pathlib import Path

import pytest
import torch

from pflseg.data.errors import DataError
from pflseg.flare.methods import METHODS
from pflseg.flare.sites.base import Site, Step, trained_metrics
from pflseg.flare.sites.fedsm import FedSMInferenceSite
from pflseg.flare.sites.iopfl import IOPFLRoutingSite

SITE_CLASSES = sorted({m.site for m in METHODS.values()} | {FedSMInferenceSite, IOPFLRoutingSite},
                      key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", SITE_CLASSES, ids=lambda c: c.__name__)
def test_no_site_class_copies_the_skeleton_or_changes_what_track_means(cls):
    for name in ("train", "run_round", "previous", "track", "training_time", "reply"):
        assert getattr(cls, name) is getattr(Site, name), f"{cls.__name__} overrides Site.{name}"


def test_only_the_sites_one_exit_makes_a_reply():
    """Issue 40 item 3: no site class builds a reply (an FLModel) itself; tasks return ``Outgoing``, and
    ``pflseg.flare.outbox.leave`` alone makes what FLARE sends."""
    import pflseg.flare.sites as sites_package
    from pflseg.flare import client, executor, outbox

    folder = Path(sites_package.__file__).parent
    assert [p.name for p in folder.glob("*.py") if "FLModel(" in p.read_text()] == []
    assert "FLModel(" not in Path(client.__file__).read_text() and "FLModel(" not in Path(executor.__file__).read_text()
    assert "FLModel(" in Path(outbox.__file__).read_text()


def test_one_builder_makes_a_training_rounds_metrics_in_one_key_order():
    """Issue 40 item 4: every method's training round reports its metrics through ``trained_metrics`` (the order is
    round_metrics.jsonl's); no other site module spells the loop's entries."""
    import pflseg.flare.sites as sites_package

    stats = {"loss": 0.5, "samples": 8, "steps": 2}
    got = trained_metrics({"val_dice": 0.1, "val_dice_person": 0.2}, stats, {"person_loss": 0.4}, {"test_dice": 0.3})
    assert list(got.items()) == [("val_dice", 0.1), ("val_dice_person", 0.2), ("train_loss", 0.5),
                                 ("person_loss", 0.4), ("n_samples", 8), ("steps", 2), ("test_dice", 0.3)]
    assert list(trained_metrics({"val_dice": 0.1}, stats)) == ["val_dice", "train_loss", "n_samples", "steps"]
    folder = Path(sites_package.__file__).parent
    assert [p.name for p in sorted(folder.glob("*.py")) if '"train_loss"' in p.read_text()] == ["base.py"]


def test_run_round_saves_what_the_step_keeps_and_times_only_its_training(federation):
    fed = federation("fedavg")
    site = fed.site()
    seen = {}

    def step(received, prev, seed):
        seen.update(prev=prev, seed=seed)
        time.sleep(0.05)  # not training
        with site.training_time():
            pass
        return Step({"global.w": received.params["global.w"] + 1}, {"note": 7}, {"val_dice": 0.5}, 3)

    out = site.run_round(fed.message(0, {"global.w": torch.zeros(1)}), step)
    assert seen["prev"] == {} and out.n_samples == 3 and float(out.params["global.w"]) == 1.0
    assert fed.store().load(0) == {"round": 0, "note": 7}
    assert out.metrics["val_dice"] == 0.5 and 0 <= out.metrics["train_seconds"] < 0.05
    out = site.run_round(fed.message(1, {"global.w": torch.zeros(1)}), step)
    assert seen["prev"] == {"round": 0, "note": 7}  # the latest completed state, from disk


def test_a_task_outside_the_rounds_state_reads_and_saves_none(federation):
    fed = federation("fedavg")
    site = fed.site()
    site.train(fed.message(0))
    seen = {}

    def step(received, prev, seed):
        seen["prev"] = prev
        return Step({}, {"note": 1}, {}, None)

    out = site.run_round(fed.message(1), step, state=False)
    assert seen["prev"] == {} and fed.store().rounds() == [0] and out.n_samples is None


@pytest.mark.parametrize("method, keeps", [("fedbn", "its normalisation layers"), ("local", "its model"),
                                           ("iopfl", "P_k"), ("lcfed", "its heads")])
def test_a_site_that_keeps_its_model_at_home_names_it_when_its_state_is_gone(method, keeps, federation):
    over = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}} if method == "lcfed" else {}
    fed = federation(method, resume=True, **over)
    with pytest.raises(RuntimeError, match=f"no state before round 2 in .* \\(it keeps {keeps} there\\)"):
        fed.site().train(fed.message(2, {} if method == "local" else None))


def test_a_job_for_other_classes_than_the_data_is_refused_naming_the_key(federation):
    """The site's check of the job against its data (the simulator run: -m extended in test_simulator.py)."""
    fed = federation("fedavg", net={"out_channels": 2})
    with pytest.raises(DataError, match=r"site site-1: data .* classes .* net\.out_channels=2; use a job config made "
                                        r"for this data"):
        fed.site()
