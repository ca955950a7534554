"""Faults at a site, with no FLARE: a round it missed, a truncated state file, a full disk, a second job of the
same name. The site answers through the client script's ``answer``, as FLARE calls it."""

import errno
import logging
import os

import pytest
import torch

from pflseg.algorithms.fedbn import norm_keys
from pflseg.algorithms.iopfl import update_person
from pflseg.flare.client import answer
from pflseg.flare.state import owner, release, unprefixed


def own_model(fed, r, site="site-1"):
    return unprefixed("model", fed.store(site).load(r))


def equal(a: dict, b: dict, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


# ---- a site left out of round r - 1 continues from round r - 2 ---------------------------------------------
@pytest.mark.parametrize("method", ["fedbn", "local", "iopfl"])
def test_a_site_that_missed_a_round_continues_from_its_latest_completed_state(method, federation, caplog):
    fed = federation(method)
    site = fed.site()
    msg = (lambda r: fed.message(r, {} if r else None)) if method == "local" else fed.message
    site.train(msg(0))
    site.train(msg(1))
    fed.store().path(1).unlink()  # round 1's file is gone (e.g. the site timed out before writing it)
    site = fed.site()  # a fresh worker, as FLARE's next task may get
    with caplog.at_level(logging.INFO, logger="pflseg.client"):
        if method == "iopfl":
            p0 = unprefixed("person", fed.store().load(0))
            out = site.train(msg(2))
            expected = update_person("ema", p0, unprefixed("global", out.params), fed.initial, None,
                                     fed.cfg["iopfl"]["tau"])
            p2 = unprefixed("person", fed.store().load(2))
            assert all(torch.allclose(p2[k], expected[k], atol=1e-6) for k in expected
                       if expected[k].is_floating_point())
        else:
            keys = norm_keys(site.net) if method == "fedbn" else list(own_model(fed, 0))
            model = site.model_for_round(msg(2).params, site.previous(2))
            assert equal(model.state_dict(), own_model(fed, 0), keys)  # round 0's own layers
            site.train(msg(2))
    assert fed.store().rounds() == [0, 2]
    assert "round 2 continues from the site's state of round 0" in caplog.text


# ---- a site left out of every round so far (it timed out in round 0) joins later, as in round 0 -------------
@pytest.mark.parametrize("method", ["fedbn", "local", "iopfl", "lcfed"])
def test_a_site_that_never_completed_a_round_joins_later_as_in_round_0(method, federation, caplog):
    over = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}} if method == "lcfed" else {}
    fed = federation(method, **over)
    msg = fed.message(3, {} if method == "local" else None)
    with caplog.at_level(logging.WARNING, logger="pflseg.client"):
        out, _ = answer("site-1", "train", msg, None)
    assert "pflseg_error" not in out.meta and out.metrics["val_dice"] >= 0
    assert fed.store().rounds() == [3]
    assert "round 3 is its first completed round in this job" in caplog.text
    # a resumed job needs the site's state: still an error naming the folder
    fed2 = federation(method, resume=True, **over)
    out, _ = answer("site-2", "train", fed2.message(3, {} if method == "local" else None), None)
    assert "no state before round 3" in out.meta["pflseg_error"]


# ---- a truncated state file: StateError naming it; the round before it is used -----------------------------
def test_a_truncated_round_file_falls_back_to_the_round_before_with_a_log_line(federation, caplog):
    fed = federation("fedbn")
    out, site = answer("site-1", "train", fed.message(0), None)
    out, site = answer("site-1", "train", fed.message(1), site)
    path = fed.store().path(1)
    path.write_bytes(path.read_bytes()[:200])  # truncated after the rename (a crash of the storage, a bad copy)
    norm = norm_keys(site.net)
    with caplog.at_level(logging.WARNING, logger="pflseg.client"):
        model = site.model_for_round(fed.message(2).params, site.previous(2))
        assert equal(model.state_dict(), own_model(fed, 0), norm)
        out, site = answer("site-1", "train", fed.message(2), site)
    assert "pflseg_error" not in out.meta and out.metrics["val_dice"] >= 0
    assert "state file <state>/fedbn/round_0001.pt is corrupt" in caplog.text  # FLARE's log: no absolute path
    assert "falling back to the round before it" in caplog.text and str(path) not in caplog.text


def test_a_truncated_only_round_file_is_an_error_reply_naming_it(federation):
    fed = federation("fedbn")
    out, site = answer("site-1", "train", fed.message(0), None)
    path = fed.store().path(0)
    path.write_bytes(path.read_bytes()[:200])
    out, site = answer("site-1", "train", fed.message(1), site)
    assert "state file <state>/fedbn/round_0000.pt is corrupt" in out.meta["pflseg_error"]


# ---- a full disk: an error reply naming the folder; the site is usable next round ---------------------------
@pytest.mark.parametrize("broken", ["save", "replace"])
def test_a_full_disk_is_an_error_reply_naming_the_folder_and_the_site_goes_on(broken, federation, monkeypatch, caplog):
    fed = federation("fedbn")
    out, site = answer("site-1", "train", fed.message(0), None)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch if broken == "save" else os, broken, full)
        out, site = answer("site-1", "train", fed.message(1), site)
    error = out.meta["pflseg_error"]
    assert (error.startswith("site site-1: could not write ")
            and "into state folder <state>/fedbn: No space left" in error)
    assert "ENOSPC" in error and str(fed.state) not in error
    assert not list(fed.store().root.glob("*.tmp")) and fed.store().rounds() == [0]
    with caplog.at_level(logging.INFO, logger="pflseg.client"):
        out, site = answer("site-1", "train", fed.message(2), site)  # space again: round 2 from round 0's state
    assert "pflseg_error" not in out.meta and fed.store().rounds() == [0, 2]
    assert "round 2 continues from the site's state of round 0" in caplog.text


# ---- the site claims its state folder for the FLARE job's id ------------------------------------------------
def test_a_site_claims_its_state_folder_for_the_job_id(federation):
    fed = federation("fedavg")
    folder = fed.store().root
    three = {"sites": ["site-1", "site-2", "site-3"]}  # a deployed job (a real job id): a site refuses K = 2
    try:
        out, site = answer("site-1", "train", fed.message(0, **three), None, job_id="job-a")
        assert "pflseg_error" not in out.meta and owner(folder) == "job-a"
        out, _ = answer("site-1", "train", fed.message(0, **three), None, job_id="job-b")  # the same name, at once
        error = out.meta["pflseg_error"]
        assert "state folder <state>/fedavg is in use by job job-a" in error and "another name" in error
        release(folder)  # job-a ends
        out, site = answer("site-1", "train", fed.message(0, **three), None, job_id="job-b")
        assert "pflseg_error" not in out.meta and owner(folder) == "job-b"
        moved = folder.with_name("fedavg.job-a")
        assert (moved / "round_0000.pt").is_file() and (moved / "best.pt").is_file()  # job-a's state, kept
    finally:
        release(folder)
