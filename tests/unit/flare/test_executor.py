"""The site executor (``pflseg.flare.executor.SiteExecutor``): a Shareable in, the Shareable of ``client.answer``'s
reply out; error replies; the abort signal; tracking as FLARE analytics events; BYOC's ``job_client.SiteExecutor``."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsData, AnalyticsDataType, LogWriterName
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from pflseg.flare import client
from pflseg.flare.executor import SiteExecutor
from tests.unit.flare.test_boundary import FakeSite


class Engine:
    def new_context(self):
        return FLContext()

    def fire_event(self, event_type, fl_ctx):  # FLARE's log_error tells the engine
        pass


def context(site="site-1", job="job-7"):
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, Engine(), private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, job, private=True, sticky=False)
    return ctx


def task(r=3, **meta):
    return FLModelUtils.to_shareable(FLModel(params={"global.w": torch.arange(4.0)}, current_round=r,
                                             meta={"pflseg": {"name": "x"}, **meta}))


@pytest.fixture
def events(monkeypatch):
    """The analytics events the executor fires: (event type, AnalyticsData)."""
    fired = []

    def fire_event(self, event_type, fl_ctx):
        fired.append((event_type, AnalyticsData.from_dxo(from_shareable(fl_ctx.get_prop(FLContextKey.EVENT_DATA)))))

    monkeypatch.setattr(SiteExecutor, "fire_event", fire_event)
    return fired


def test_the_reply_is_what_answer_gives_and_the_site_is_kept(monkeypatch, events):
    calls = []

    def answer(name, task_name, msg, site, job_id):
        calls.append((name, task_name, msg, site, job_id))
        out = FLModel(params={"global.w": msg.params["global.w"] * 2}, metrics={"val_dice": 0.5, "n": 7,
                                                                                "test": {"a": 1}},
                      meta={"NUM_STEPS_CURRENT_ROUND": 12})
        return out, f"site after {len(calls)} tasks"

    monkeypatch.setattr(client, "answer", answer)
    ex = SiteExecutor()
    sent = task(r=3)
    reply = ex.execute("train", sent, context(), Signal())
    assert reply.get_return_code() == ReturnCode.OK
    got = FLModelUtils.from_shareable(reply)
    assert torch.equal(got.params["global.w"], torch.arange(4.0) * 2)
    assert got.metrics["val_dice"] == 0.5 and got.meta["NUM_STEPS_CURRENT_ROUND"] == 12
    assert reply.get_header(AppConstants.CURRENT_ROUND) == 3
    name, task_name, msg, site, job_id = calls[0]
    assert (name, task_name, site, job_id) == ("site-1", "train", None, "job-7")  # the job id claims the state folder
    assert msg.current_round == 3 and msg.meta["pflseg"] == {"name": "x"}
    assert msg.meta["job_id"] == "job-7" and msg.meta["site_name"] == "site-1"  # as the Client API's receive() gives
    # the same metric names and steps as the Client API script's SummaryWriter, numbers only
    assert [(t, d.tag, d.value, d.step, d.data_type, d.sender) for t, d in events] == [
        (ANALYTIC_EVENT_TYPE, "val_dice", 0.5, 3, AnalyticsDataType.SCALAR, LogWriterName.TORCH_TB),
        (ANALYTIC_EVENT_TYPE, "n", 7, 3, AnalyticsDataType.SCALAR, LogWriterName.TORCH_TB)]
    assert client.scalars(FLModelUtils.from_shareable(reply)) == [("val_dice", 0.5), ("n", 7)]
    ex.execute("validate", task(r=4), context(), Signal())
    assert calls[1][3] == "site after 1 tasks"  # the site object lives between tasks


def test_a_failing_task_is_the_error_reply_answer_gives(tmp_path, monkeypatch, events):
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    site = FakeSite(ValueError("train.lr must be > 0"))
    ex = SiteExecutor()
    ex._site = site
    reply = ex.execute("train", task(), context(), Signal())
    direct, _ = client.answer("site-1", "train", FLModel(params={}, meta={}), site, "job-7")
    assert reply.get_return_code() == ReturnCode.OK  # an error reply, never a dead site: the server leaves it out
    got = FLModelUtils.from_shareable(reply)
    assert got.meta["pflseg_error"] == direct.meta["pflseg_error"]
    assert got.meta["pflseg_error"].startswith("site site-1: ") and got.meta["site"] == "site-1"
    assert got.meta["pflseg_error"].endswith("(detail in the site's <state>/site_errors.log)")
    assert got.params == {} and events == []


def test_a_failure_after_the_answer_is_the_exits_error_reply(tmp_path, monkeypatch):
    """FLARE's own part of a task (the analytics events, the Shareable) failing: an error reply by the exit's
    error-text rule (code and pseudonym), not FLARE's traceback, and nothing of the file's name."""
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(client, "answer", lambda *a: (FLModel(params={}, metrics={"val_dice": 0.5}), None))

    def track(self, out, step, fl_ctx):
        raise OSError(28, "No space left on device", "/data/Smith_John_MRN4711_1960-01-01.png")

    monkeypatch.setattr(SiteExecutor, "_track", track)
    reply = SiteExecutor().execute("train", task(), context(), Signal())
    error = FLModelUtils.from_shareable(reply).meta["pflseg_error"]
    assert reply.get_return_code() == ReturnCode.OK and "Smith" not in error
    assert error.startswith("site site-1: task 'train' failed: OSError (ENOSPC) [file-"), error
    assert "Smith_John" in (tmp_path / "site-1" / "site_errors.log").read_text()


def test_an_exception_that_is_no_error_is_an_execution_exception(monkeypatch):
    def answer(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "answer", answer)
    reply = SiteExecutor().execute("train", task(), context(), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION


def test_an_aborted_task_is_answered_at_once_and_tasks_run_one_at_a_time(monkeypatch):
    release, order = threading.Event(), []

    def answer(name, task_name, msg, site, job_id):
        order.append(f"{task_name} begins")
        if task_name == "slow":
            release.wait(10)
        order.append(f"{task_name} ends")
        return FLModel(params={}, metrics={}), site

    monkeypatch.setattr(client, "answer", answer)
    ex = SiteExecutor()
    before = Signal()
    before.trigger(True)
    assert ex.execute("train", task(), context(), before).get_return_code() == ReturnCode.TASK_ABORTED
    assert order == []  # aborted before it began: never begun

    abort = Signal()
    threading.Timer(0.3, abort.trigger, args=(True,)).start()
    t0 = time.monotonic()
    assert ex.execute("slow", task(), context(), abort).get_return_code() == ReturnCode.TASK_ABORTED
    assert time.monotonic() - t0 < 5 and order == ["slow begins"]  # answered at once; the site is still in it

    queued = Signal()  # a task aborted while it waits for the one before it is never begun
    waiting = threading.Thread(target=lambda: ex.execute("queued", task(), context(), queued))
    waiting.start()
    time.sleep(0.2)
    queued.trigger(True)
    waiting.join(5)
    threading.Timer(0.3, release.set).start()
    assert ex.execute("next", task(), context(), Signal()).get_return_code() == ReturnCode.OK
    assert order == ["slow begins", "slow ends", "next begins", "next ends"]  # one task at a time


def test_a_byoc_job_runs_the_pflseg_it_carries(tmp_path):
    """FLARE puts app/custom last on the import path; job_client.py puts it first before pflseg is imported."""
    from pflseg.flare.jobs import export_job

    job = export_job("fedavg", tmp_path / "jobs", mode="byoc")
    config = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    assert config["executors"][0]["executor"] == {"path": "job_client.SiteExecutor", "args": {}}
    custom = job / "app" / "custom"
    installed = tmp_path / "installed" / "pflseg"  # another pflseg, ahead of app/custom on the path
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("raise ImportError('the installed pflseg was imported')\n")
    code = ("import job_client, pflseg; from pflseg.flare import executor; print(pflseg.__file__); "
            "print(issubclass(job_client.SiteExecutor, executor.SiteExecutor))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed.parent), str(custom)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, subclass = out.stdout.split()
    assert where == str(custom / "pflseg" / "__init__.py") and subclass == "True"


def test_site_executor_is_a_config_key(tmp_path):
    """``site.executor``: the plain executor by default, the Client API script on request, anything else refused."""
    from pflseg.config import ConfigError, load_job_config
    from pflseg.flare.jobs import export_job

    def executor(mode, kind):
        job = export_job("fedavg", tmp_path / mode / kind, overrides={"site": {"executor": kind}}, mode=mode)
        return json.loads((job / "app" / "config" / "config_fed_client.json").read_text())["executors"][0]["executor"]

    assert load_job_config("fedavg")["site"]["executor"] == "executor"
    assert executor("package", "client_api") == {"path": "pflseg.flare.executor.ClientAPISiteExecutor", "args": {}}
    byoc = executor("byoc", "client_api")
    assert byoc["path"].endswith("ClientAPIExecutor") and byoc["args"]["task_script_path"] == "job_client.py"
    with pytest.raises(ConfigError, match=r"site\.executor must be one of executor, client_api"):
        load_job_config("fedavg", overrides={"site": {"executor": "script"}})
