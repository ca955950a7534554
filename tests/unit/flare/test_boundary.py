"""Trust at the federation boundary: what a job config, a bundle path or one site's answer can do to the server.

Every attack here comes from one party (the job's submitter, or one site); the server must refuse it, name
the reason, and, for a site's answer, leave that site out of the round while the others complete it.
"""

import json
import logging
import os
import re
import stat

import pytest
import torch
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import ConfigError, check_effective, load_job_config
from pflseg.flare.checks import check_update
from pflseg.flare.methods import METHODS
from pflseg.flare.methods import method as registered
from pflseg.flare.state import RoundStore, load_file, prefixed, save_file, state_dir, unprefixed
from tests.unit.flare.controllers.conftest import TINY, Stub, make, scaled

FACTOR = {"site-1": 1.0, "site-2": 100.0, "site-3": 3.0}


def first_float_key(state: dict) -> str:
    return next(k for k, v in state.items() if v.is_floating_point() and v.abs().sum() > 0)


def int_key(state: dict) -> str:
    return next(k for k, v in state.items() if not v.is_floating_point())


# ---- one site's malformed answer: left out with the reason, the round completes with the others ---------
def _drop_key(params, metrics, meta):
    params.pop(next(iter(params)))


def _extra_key(params, metrics, meta):
    params["global.evil"] = torch.zeros(1)


def _float64(params, metrics, meta):
    key = "global." + first_float_key(unprefixed("global", params))
    params[key] = params[key].double()


def _int_as_float(params, metrics, meta):
    key = "global." + int_key(unprefixed("global", params))
    params[key] = params[key].float()  # an integer buffer sent as float: it would decide the aggregate's dtype


def _int_as_int32(params, metrics, meta):
    key = "global." + int_key(unprefixed("global", params))
    params[key] = params[key].int()


def _oversize_storage(params, metrics, meta):
    key = "global." + first_float_key(unprefixed("global", params))
    big = torch.zeros(params[key].numel() * 1000)
    params[key] = big[: params[key].numel()].view(params[key].shape)  # right shape, 1000x the bytes behind it


def _meta(value):
    def mutate(params, metrics, meta):
        meta["NUM_STEPS_CURRENT_ROUND"] = value
    return mutate


def _no_n_k(params, metrics, meta):
    meta.pop("NUM_STEPS_CURRENT_ROUND")


def _metric(key, value):
    def mutate(params, metrics, meta):
        metrics[key] = value
    return mutate


def _no_val_dice(params, metrics, meta):
    metrics.pop("val_dice")


BAD_ANSWERS = {
    "missing key": (_drop_key, "missing key"),
    "unexpected key": (_extra_key, "unexpected key 'global.evil'"),
    "float64 tensor": (_float64, "dtype torch.float64, expected torch.float32"),
    "integer buffer as float": (_int_as_float, "dtype torch.float32, expected torch.int64"),
    "integer buffer as int32": (_int_as_int32, "dtype torch.int32, expected torch.int64"),
    "oversize storage": (_oversize_storage, "bytes of storage"),
    "huge n_k": (_meta(10**12), "NUM_STEPS_CURRENT_ROUND=1000000000000 exceeds max_n_samples"),
    "float huge n_k": (_meta(1e12), "NUM_STEPS_CURRENT_ROUND=1000000000000.0 .*positive integer"),
    "negative n_k": (_meta(-5), "NUM_STEPS_CURRENT_ROUND=-5 .*positive integer"),
    "zero n_k": (_meta(0), "NUM_STEPS_CURRENT_ROUND=0 .*positive integer"),
    "NaN n_k": (_meta(float("nan")), "NUM_STEPS_CURRENT_ROUND=nan .*positive integer"),
    "string n_k": (_meta("12"), "NUM_STEPS_CURRENT_ROUND='12' .*positive integer"),
    "bool n_k": (_meta(True), "NUM_STEPS_CURRENT_ROUND=True .*positive integer"),
    "missing n_k": (_no_n_k, "no NUM_STEPS_CURRENT_ROUND"),
    "val_dice 1e6": (_metric("val_dice", 1e6), "val_dice=1000000.0 .*\\[0, 1\\]"),
    "negative val_dice": (_metric("val_dice", -0.1), "val_dice=-0.1 .*\\[0, 1\\]"),
    "NaN val_dice": (_metric("val_dice", float("nan")), "val_dice=nan"),
    "string val_dice": (_metric("val_dice", "0.9"), "val_dice='0.9' .*number"),
    "missing val_dice": (_no_val_dice, "no metric 'val_dice'"),
    "other dice-like metric out of range": (_metric("val_dice_local", 2.0), "val_dice_local=2.0"),
    "infinite train_loss": (_metric("train_loss", float("inf")), "train_loss=inf .*finite"),
    "string compute_seconds": (_metric("compute_seconds", "fast"), "compute_seconds='fast'"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_a_malformed_answer_leaves_the_site_out_and_the_round_completes(case, tmp_path, monkeypatch):
    mutate, reason = BAD_ANSWERS[case]
    ctrl = make("fedavg", tmp_path, monkeypatch)  # min_clients = 2 of 3
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):
        params = prefixed("global", scaled(unprefixed("global", data.params), FACTOR[site]))
        metrics, meta = {"val_dice": 0.5, "train_loss": 0.3, "compute_seconds": 1.0}, {"NUM_STEPS_CURRENT_ROUND": 4}
        if site == "site-2":
            mutate(params, metrics, meta)
        return FLModel(params=params, metrics=metrics, meta=meta)

    Stub(ctrl, reply)
    out = ctrl.round(0)  # no exception: one site's answer cannot end the job
    assert list(ctrl.missing) == ["site-2"]
    assert re.search(reason, ctrl.missing["site-2"]), ctrl.missing["site-2"]
    assert set(out.metrics["val_dice"]) == {"site-1", "site-3"} and ctrl.state.best["score"] <= 1.0
    for key, value in g0.items():  # the mean of site-1 and site-3 only, in the reference's dtype
        assert ctrl.state.global_state[key].dtype == value.dtype and ctrl.state.global_state[key].shape == value.shape
        if value.is_floating_point():
            assert torch.allclose(ctrl.state.global_state[key], value * (1.0 + 3.0) / 2, atol=1e-6), key


def test_malformed_message_bodies_are_refused(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, min_clients=1)
    bodies = {"site-1": dict(params=[1, 2], metrics={"val_dice": 0.5}), "site-2": dict(params={}, metrics="good")}

    def reply(site, data):
        if site == "site-3":
            return FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})
        answer = FLModel(params={}, meta={"NUM_STEPS_CURRENT_ROUND": 1})
        answer.params, answer.metrics = bodies[site]["params"], bodies[site]["metrics"]
        return answer

    Stub(ctrl, reply)
    ctrl.round(0)
    assert "params" in ctrl.missing["site-1"] and "metrics" in ctrl.missing["site-2"] and "site-3" not in ctrl.missing


def test_n_k_may_not_grow_beyond_the_sites_first_accepted_value_and_survives_a_resume(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    n = {"site-1": 4, "site-2": 4, "site-3": 4}
    Stub(ctrl, lambda site,
         data: FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]}))
    ctrl.round(0)
    assert not ctrl.missing and ctrl.state.n_first == {"site-1": 4, "site-2": 4, "site-3": 4}
    ctrl.state.history = [{"round": 0}]
    ctrl.store.save(0, ctrl.checkpoint(0))
    again = make("fedavg", tmp_path, monkeypatch, resume=True)
    assert again.state.n_first == ctrl.state.n_first
    n.update({"site-2": 5, "site-3": 2})  # growing is refused, shrinking is fine
    Stub(again, lambda site,
         data: FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]}))
    again.round(1)
    assert (list(again.missing) == ["site-2"]
            and "NUM_STEPS_CURRENT_ROUND=5 exceeds its first accepted value 4" in again.missing["site-2"])


def test_max_n_samples_is_a_config_key(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch, max_n_samples=10)
    n = {"site-1": 10, "site-2": 11, "site-3": 3}
    Stub(ctrl, lambda site,
         data: FLModel(params=data.params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": n[site]}))
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-2"] and "exceeds max_n_samples=10" in ctrl.missing["site-2"]
    with pytest.raises(ConfigError, match="max_n_samples"):
        load_job_config("fedavg", overrides={"max_n_samples": 0})


def test_check_update_requires_the_exact_keys_and_dtypes_of_the_reference():
    ref = {"global.w": torch.zeros(2), "global.n": torch.tensor(0)}
    assert check_update({"global.w": torch.ones(2), "global.n": torch.tensor(3)}, ref) is None
    assert "missing key 'global.n'" in check_update({"global.w": torch.ones(2)}, ref)
    assert "dtype" in check_update({"global.w": torch.ones(2), "global.n": torch.tensor(3.0)}, ref)
    assert "dtype" in check_update({"global.w": torch.ones(2, dtype=torch.float16), "global.n": torch.tensor(3)}, ref)
    assert "layout" in check_update({"global.w": torch.ones(2).to_sparse(), "global.n": torch.tensor(3)}, ref)


def finished(method, tmp_path, monkeypatch, reply, **over):
    ctrl = make(method, tmp_path, monkeypatch, **over)
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()
    panics = []
    ctrl.panic = panics.append
    stub = Stub(ctrl, lambda site, data: reply(stub.sent[-1][0], site, data))
    return ctrl, stub, panics


def test_a_test_answer_without_its_test_dict_leaves_the_site_out_of_the_results(tmp_path, monkeypatch):
    def reply(task, site, data):
        if task == "validate":
            return FLModel(params={}, metrics={"val_dice": 0.4})
        return FLModel(params={}, metrics={"test": {"site": {"dice": 0.6}}} if site != "site-2" else {"dice": 0.9})

    ctrl, stub, panics = finished("fedavg", tmp_path, monkeypatch, reply)
    ctrl.finish()
    assert not panics
    results = json.loads((tmp_path / "server" / "results.json").read_text())
    assert sorted(results["test"]) == ["site-1", "site-3"] and "no metric 'test'" in results["missing"]["site-2"]


def test_a_validate_answer_without_val_dice_does_not_end_the_job(tmp_path, monkeypatch):
    def reply(task, site, data):
        if task == "validate":
            return FLModel(params={}, metrics={"val_dice": 0.4} if site != "site-1" else {"loss": 0.1})
        return FLModel(params={}, metrics={"test": {}})

    ctrl, stub, panics = finished("fedavg", tmp_path, monkeypatch, reply)
    ctrl.finish()
    assert not panics and "val_dice" in ctrl.missing["site-1"]
    assert (tmp_path / "server" / "results.json").is_file()


def test_a_finetune_answer_without_its_metrics_is_left_out(tmp_path, monkeypatch):
    ctrl = make("ft", tmp_path, monkeypatch)
    Stub(ctrl, lambda site,
         data: FLModel(params={}, metrics={"ft_best_epoch": 1, "ft_val_dice": [0.2]} if site != "site-3" else {}))
    entries = ctrl.personalize(2, prefixed("global", ctrl.state.global_state))
    assert sorted(entries["ft"]) == ["site-1", "site-2"] and "ft_best_epoch" in ctrl.missing["site-3"]


def test_fedsm_answer_missing_selector_moments_is_left_out_not_silently_dropped(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch, fedsm={"selector_fit": "softmax", "selector_steps": "batch"})
    moments = {k: torch.ones_like(v) for k, v in ctrl.moment_ref.items()}

    def reply(site, data):
        params = {**data.params, **moments}
        if site == "site-1":
            params.pop(next(k for k in params if k.startswith("moment.")))
        return FLModel(params=params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(0)
    assert list(ctrl.missing) == ["site-1"] and "missing key 'moment." in ctrl.missing["site-1"]
    assert set(ctrl.state.moments) == {k[len("moment."):] for k in ctrl.moment_ref}


def test_fedsm_lda_statistics_that_do_not_count_the_sites_images_are_left_out(tmp_path, monkeypatch):
    from tests.unit.flare.controllers.conftest import lda_answer

    ctrl = make("fedsm", tmp_path, monkeypatch, min_clients=1)  # selector_fit: lda

    def reply(site, data):
        answer = lda_answer(ctrl, site, data)  # 4 images
        if site == "site-1":
            answer.meta["NUM_STEPS_CURRENT_ROUND"] = 400  # claims 100x the weight its statistics count
        if site == "site-2":
            answer.params["stats.gram"][0, 0] = -1.0
        return answer

    Stub(ctrl, reply)
    ctrl.round(0)
    assert sorted(ctrl.missing) == ["site-1", "site-2"] and list(ctrl.state.lda_stats) == ["site-3"]
    assert "summing to n_k = 400" in ctrl.missing["site-1"] and "Gram" in ctrl.missing["site-2"]


def test_fedsm_selector_round_with_a_non_numeric_loss_is_left_out(tmp_path, monkeypatch):
    ctrl = make("fedsm", tmp_path, monkeypatch,
                fedsm={"extra_rounds": 1, "selector_fit": "softmax", "selector_steps": "batch"},
                rounds=1)

    def reply(site, data):
        params = {**prefixed("select", unprefixed("select", data.params)),
                  **{k: torch.ones_like(v) for k, v in ctrl.moment_ref.items()}}
        return FLModel(params=params, metrics={"selector_loss": 0.2 if site != "site-2" else "low"},
                       meta={"NUM_STEPS_CURRENT_ROUND": 1})

    Stub(ctrl, reply)
    ctrl.round(1)
    assert list(ctrl.missing) == ["site-2"] and "selector_loss" in ctrl.missing["site-2"]


# ---- the job's name and bundle paths: never outside the state root ------------------------------------
@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "..", ".", "", "a b", "x\\..\\y"])
def test_job_name_must_be_one_plain_folder_name(name):
    cfg = load_job_config("fedavg")
    cfg["name"] = name
    with pytest.raises(ConfigError, match=r"name=.*\[A-Za-z0-9_-\]\+"):
        check_effective(cfg)
    with pytest.raises(ConfigError, match=r"\[A-Za-z0-9_-\]\+"):
        load_job_config(name)


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "..", ""])
def test_state_dir_stays_under_its_root(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="not inside"):
        state_dir("server", name)
    monkeypatch.delenv("PFLSEG_STATE_DIR")
    with pytest.raises(ValueError, match="not inside"):
        state_dir("site-1", name, configured=str(tmp_path))
    assert state_dir("site-1", "fedavg", configured=str(tmp_path)) == tmp_path / "fedavg"


def test_a_job_named_to_escape_the_state_root_deletes_nothing(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    save_file(victim / "round_0000.pt", {"round": 0})
    save_file(victim / "best.pt", {"round": 0})
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    cfg = load_job_config("fedavg", overrides=TINY)
    cfg["name"] = "../../victim"  # state/server/../../victim == victim
    ctrl = METHODS["fedavg"].controller(config=cfg)
    ctrl.sample_clients = lambda: ["site-1", "site-2"]
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    assert ctrl.setup() is None
    assert len(panics) == 1 and "../../victim" in panics[0] and "A-Za-z0-9" in panics[0]
    assert (victim / "round_0000.pt").is_file() and (victim / "best.pt").is_file()


def post_training(method, key, bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "state"))
    cfg = load_job_config(method, overrides={**TINY, key: {"bundle": str(bundle)}})
    ctrl = METHODS[method].controller(config=cfg)
    ctrl.sample_clients = lambda: ["site-1", "site-2", "site-3"]
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.info = ctrl.warning = ctrl.error = lambda msg: None
    panics = []
    ctrl.panic = panics.append
    stub = Stub(ctrl, lambda site, data: FLModel(params={}, metrics={"route": {}, "infer": {}}))
    ctrl.run()
    return stub, panics


def iopfl_bundle(folder):
    state = {"w": torch.ones(2)}
    save_file(folder / "bundle.pt", {"sites": ["site-1", "site-2"], **prefixed("global", state),
                                     **prefixed("person.site-1", state), **prefixed("person.site-2", state)})


def fedsm_bundle(folder):
    RoundStore(folder).save(0, {"round": 0, **prefixed("global", {"w": torch.ones(2)}),
                                **prefixed("person.site-1", {"w": torch.ones(2)}),
                                **prefixed("select", {"w": torch.ones(2)})})


BUNDLES = [("iopfl_route", "iopfl", iopfl_bundle), ("fedsm_infer", "fedsm", fedsm_bundle)]


@pytest.mark.parametrize("method, key, make_bundle", BUNDLES)
@pytest.mark.parametrize("where", ["outside", "dotdot", "root itself"])
def test_a_bundle_outside_the_servers_state_root_is_refused(method, key, make_bundle, where, tmp_path, monkeypatch):
    root = tmp_path / "state" / "server"
    root.mkdir(parents=True)  # an existing state root: ".." in the bundle path walks out of it
    folder = {"outside": tmp_path / "elsewhere", "dotdot": tmp_path / "elsewhere", "root itself": root}[where]
    make_bundle(folder)
    given = {"outside": folder, "dotdot": root / ".." / ".." / "elsewhere", "root itself": root}[where]
    stub, panics = post_training(method, key, given, tmp_path, monkeypatch)
    assert not stub.sent and len(panics) == 1
    assert f"{key}.bundle={str(given)!r}" in panics[0] and f"inside the server's state root {root}" in panics[0]


@pytest.mark.parametrize("method, key, make_bundle", BUNDLES)
def test_a_bundle_inside_the_servers_state_root_is_used(method, key, make_bundle, tmp_path, monkeypatch):
    make_bundle(tmp_path / "state" / "server" / "trained")
    stub, panics = post_training(method, key, tmp_path / "state" / "server" / "trained", tmp_path, monkeypatch)
    assert not panics and stub.sent


@pytest.mark.parametrize("method, key, make_bundle", BUNDLES)
def test_the_operator_can_allow_more_bundle_roots(method, key, make_bundle, tmp_path, monkeypatch):
    make_bundle(tmp_path / "runs" / "train" / "state" / "server" / "trained")
    monkeypatch.setenv("PFLSEG_BUNDLE_ROOTS", str(tmp_path / "runs"))  # the server's own environment, never the job
    stub, panics = post_training(method, key, tmp_path / "runs" / "train" / "state" / "server" / "trained", tmp_path,
                                 monkeypatch)
    assert not panics and stub.sent


# ---- config values that size memory ---------------------------------------------------------------
@pytest.mark.parametrize("override, key, cap", [
    ({"data": {"size": 4096}}, "data.size", 1024),
    ({"data": {"synth_sites": 1000}}, "data.synth_sites", 64),
    ({"train": {"epochs": 10**6}}, "train.epochs", 1000),
    ({"train": {"batch_size": 10**5}}, "train.batch_size", 1024),
    ({"train": {"eval_batch_size": 10**5}}, "train.eval_batch_size", 1024),
    ({"rounds": 10**7}, "rounds", 10000),
    ({"net": {"channels": [16, 10**6]}}, "net.channels", 1024),
    ({"iopfl": {"epochs": 10**5}}, "iopfl.epochs", 1000),
    ({"ft": {"epochs": 10**5}}, "ft.epochs", 1000),
    ({"fedsm": {"extra_rounds": 10**6}}, "fedsm.extra_rounds", 10000),
])
def test_config_values_that_size_memory_are_capped(override, key, cap):
    job = key.split(".")[0] if key.split(".")[0] in METHODS else "fedavg"  # a method's own key: its job's check
    with pytest.raises(ConfigError, match=rf"{key}=.* exceeds the cap {cap}"):
        registered(load_job_config(job, overrides=override))


# ---- state files: durable, no stale temporaries ---------------------------------------------------
def test_save_file_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    kinds, real = [], os.fsync

    def fsync(fd):
        kinds.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_file(tmp_path / "s" / "round_0000.pt", {"w": torch.ones(2)})
    assert kinds == ["file", "dir"]
    assert torch.equal(load_file(tmp_path / "s" / "round_0000.pt")["w"], torch.ones(2))


def test_stale_tmp_files_are_removed_when_a_store_is_opened_or_cleared(tmp_path):
    for name in ("round_0003.pt.tmp", "best.pt.tmp", "results.json.tmp"):
        (tmp_path / name).write_bytes(b"half")
    save_file(tmp_path / "round_0002.pt", {"round": 2})
    store = RoundStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_0002.pt"]
    (tmp_path / "round_0004.pt.tmp").write_bytes(b"half")
    store.clear()
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_store_leaves_tmp_files(tmp_path):
    (tmp_path / "round_0003.pt.tmp").write_bytes(b"half")
    RoundStore(tmp_path, clean=False)
    assert (tmp_path / "round_0003.pt.tmp").is_file()


# ---- the site side: any exception in a task handler is an error reply ------------------------------
class FakeSite:
    def __init__(self, exc):
        self.exc = exc
        self.cfg, self.sites = check_effective(load_job_config("fedavg")), ["site-1", "site-2", "site-3"]

    def tasks(self):
        def handler(msg):
            raise self.exc
        return {"train": handler}


@pytest.mark.parametrize("exc", [KeyError("val_dice"), TypeError("bad operand"), ZeroDivisionError("division by zero"),
                                 AssertionError("shape"), IndexError("list index out of range")])
def test_any_exception_in_a_task_becomes_an_error_reply(exc, caplog, tmp_path, monkeypatch):
    from pflseg.flare.client import answer

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    site = FakeSite(exc)
    with caplog.at_level(logging.ERROR, logger="pflseg.client"):
        out, kept = answer("site-1", "train", FLModel(params={}, meta={}), site)
    assert kept is site
    error = out.meta["pflseg_error"]
    assert error.startswith(f"site site-1: task 'train' failed: {type(exc).__name__} (detail in the site's <state>/")
    assert str(exc) not in error or not str(exc)  # an unforeseen message may hold anything: only its type leaves
    local = (tmp_path / "site-1" / "site_errors.log").read_text()
    assert "Traceback" in local and str(exc) in local  # the traceback is in the site-local log


def test_an_actionable_error_is_an_error_reply_naming_the_site(caplog, tmp_path, monkeypatch):
    from pflseg.config import ConfigError
    from pflseg.flare.client import answer

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    site = FakeSite(ConfigError("train.lr must be > 0"))  # pflseg's own words leave
    with caplog.at_level(logging.ERROR, logger="pflseg.client"):
        out, kept = answer("site-1", "train", FLModel(params={}, meta={}), site)
    assert kept is site and out.meta["pflseg_error"] == (
        "site site-1: train.lr must be > 0 (detail in the site's <state>/site_errors.log)")
    assert "train.lr must be > 0" in caplog.text
    # the same words raised by anyone else (a library, this test's own code): its type only
    out, _ = answer("site-1", "train", FLModel(params={}, meta={}), FakeSite(ValueError("train.lr must be > 0")))
    assert out.meta["pflseg_error"] == (
        "site site-1: task 'train' failed: ValueError (detail in the site's <state>/site_errors.log)")


def test_a_job_config_with_a_bad_name_is_an_error_reply_at_the_site(tmp_path, monkeypatch):
    from pflseg.flare.client import answer

    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))

    cfg = load_job_config("fedavg")
    cfg["name"] = "../../etc"
    out, kept = answer("site-1", "train", FLModel(params={}, meta={"pflseg": cfg, "sites": ["site-1"]}), None)
    assert kept is None and "A-Za-z0-9" in out.meta["pflseg_error"]


def test_a_local_simulation_lets_post_training_jobs_read_sibling_workspaces(tmp_path, monkeypatch):
    """`pflseg run fedsm_infer --workspace runs/infer --set fedsm.bundle=runs/fedsm/state/server/fedsm` (README)."""
    from pflseg.deploy import simulator

    class Started(Exception):
        pass

    seen = {}

    def popen(cmd, env, **kwargs):
        seen.update(env)
        raise Started

    monkeypatch.setattr(simulator.subprocess, "Popen", popen)
    monkeypatch.delenv("PFLSEG_BUNDLE_ROOTS", raising=False)
    (tmp_path / "jobs" / "fedsm_infer").mkdir(parents=True)
    with pytest.raises(Started):
        simulator.run_simulator(tmp_path / "jobs" / "fedsm_infer", tmp_path / "runs" / "infer", n_sites=2,
                                progress=lambda m: None)
    assert seen["PFLSEG_BUNDLE_ROOTS"] == str(tmp_path / "runs")
    monkeypatch.setenv("PFLSEG_BUNDLE_ROOTS", "/srv/bundles")  # an operator's own setting wins
    with pytest.raises(Started):
        simulator.run_simulator(tmp_path / "jobs" / "fedsm_infer", tmp_path / "runs" / "infer", n_sites=2,
                                progress=lambda m: None)
    assert seen["PFLSEG_BUNDLE_ROOTS"] == "/srv/bundles"
