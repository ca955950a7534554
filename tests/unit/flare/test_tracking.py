"""Experiment tracking (config ``tracking``): FLARE's TensorBoard and MLflow receivers in the exported job, a clear
error at config load when MLflow is asked for but not installed, the same metric names at every site."""

import importlib.util
import json
import types

import pytest

from pflseg.config import ConfigError, load_job_config
from pflseg.flare.jobs import MLFLOW_FILE_STORE, export_job

HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None
MLFLOW = "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver"
TB = "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver"


def _server_components(job):
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    return {c["path"]: c.get("args", {}) for c in server["components"]}


def test_the_default_job_has_tensorboard_only(tmp_path):
    components = _server_components(export_job("fedavg", tmp_path))
    assert TB in components and MLFLOW not in components


@pytest.mark.skipif(not HAVE_MLFLOW, reason="mlflow not installed (extra [tracking])")
def test_the_job_has_the_mlflow_receiver_when_asked(tmp_path):
    components = _server_components(export_job("fedavg", tmp_path, overrides={
        "tracking": {"receivers": ["tensorboard", "mlflow"], "experiment": "exp1"}}))
    assert TB in components
    args = components[MLFLOW]
    assert args["tracking_uri"] == MLFLOW_FILE_STORE == "file://{WORKSPACE}/{JOB_ID}/mlruns"
    assert args["kw_args"]["experiment_name"] == "exp1" and args["events"] == ["fed.analytix_log_stats"]
    only = _server_components(export_job("fedavg", tmp_path, overrides={
        "tracking": {"receivers": ["mlflow"], "mlflow_uri": "http://localhost:5000"}}))
    assert TB not in only and only[MLFLOW]["tracking_uri"] == "http://localhost:5000"
    assert only[MLFLOW]["kw_args"]["experiment_name"] == "fedavg"  # the job's name by default


def test_mlflow_missing_fails_at_config_load_naming_the_key_and_pip(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking\.receivers lists mlflow.*pip install \"pflseg\[tracking\]\""):
        load_job_config("fedavg", overrides={"tracking": {"receivers": ["mlflow"]}})
    load_job_config("fedavg")  # TensorBoard alone needs nothing more


@pytest.mark.parametrize("tracking, bad", [({"receivers": ["neptune"]}, "tracking.receivers"),
                                           ({"receivers": ["mlflow", "mlflow"]}, "tracking.receivers"),
                                           ({"receivers": "mlflow"}, "tracking.receivers"),
                                           ({"mlflow_uri": " "}, "tracking.mlflow_uri")])
def test_bad_tracking_values_are_named(tracking, bad):
    with pytest.raises(ConfigError, match=bad.replace(".", r"\.")):
        load_job_config("fedavg", overrides={"tracking": tracking})


def test_every_site_writes_its_metrics_under_the_same_names(monkeypatch):
    """FLARE's receivers keep the sites apart (tb_events/<site>/, one MLflow run per site): the names carry no site."""
    import nvflare.client as flare
    import nvflare.client.tracking as tracking
    from nvflare.app_common.abstract.fl_model import FLModel

    from pflseg.flare import client

    written, messages = [], [FLModel(params={}, current_round=3)]

    class Writer:
        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

    monkeypatch.setattr(tracking, "SummaryWriter", Writer)
    for fn, value in {"init": None, "get_site_name": "site-7", "get_job_id": "j", "get_task_name": "train",
                      "send": None}.items():
        monkeypatch.setattr(flare, fn, lambda *a, v=value, **k: v)
    monkeypatch.setattr(flare, "is_running", lambda: bool(messages))
    monkeypatch.setattr(flare, "receive", lambda: messages.pop())
    monkeypatch.setattr(client, "answer", lambda name, task, msg, site, job: (
        FLModel(params={}, metrics={"val_dice": 0.5, "test": {}}), types.SimpleNamespace()))
    client.main()
    assert written == [("val_dice", 0.5, 3)]


# ---- Weights & Biases (tracking.receivers: wandb), tested without wandb installed --------------------------------
WANDB = "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver"
WANDB_MODULE = "nvflare.app_opt.tracking.wandb.wandb_receiver"


@pytest.fixture
def stub_wandb(monkeypatch):
    """A stand-in ``wandb`` module (FLARE's receiver imports wandb at import time; the job only names it); FLARE's
    receiver module imported against it is dropped afterwards."""
    import importlib.machinery
    import sys

    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delitem(sys.modules, WANDB_MODULE, raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    yield module
    sys.modules.pop(WANDB_MODULE, None)


def test_the_job_has_the_wandb_receiver_offline_in_the_servers_job_folder(tmp_path, stub_wandb):
    import os

    from pflseg.flare.jobs import WANDB_DIR

    components = _server_components(export_job("fedavg", tmp_path, overrides={
        "tracking": {"receivers": ["tensorboard", "wandb"]}}))
    assert TB in components and MLFLOW not in components
    args = components[WANDB]
    assert args.get("mode", "offline") == "offline"  # FLARE writes non-default arguments only: offline is the default
    assert args["events"] == ["fed.analytix_log_stats"]  # the sites' metrics, one W&B run per site
    assert args["wandb_args"] == {"project": "fedavg", "name": "fedavg", "group": "fedavg", "job_type": "fedavg",
                                  "dir": WANDB_DIR, "tags": ["fedavg", "fedavg"],
                                  "config": {"method": "fedavg", "job": "fedavg"}}
    assert WANDB_DIR == "{WORKSPACE}/{JOB_ID}" and "WANDB_MODE" not in os.environ  # nothing set where the job is built
    chosen = _server_components(export_job("iopfl", tmp_path, overrides={"tracking": {
        "receivers": ["wandb"], "experiment": "exp1", "wandb_mode": "online", "wandb_dir": "/srv/wandb"}}))
    assert TB not in chosen and chosen[WANDB]["mode"] == "online"
    assert chosen[WANDB]["wandb_args"]["project"] == "exp1" and chosen[WANDB]["wandb_args"]["dir"] == "/srv/wandb"
    assert chosen[WANDB]["wandb_args"]["job_type"] == "iopfl"


def test_wandb_missing_fails_at_config_load_and_at_build_naming_pip(monkeypatch):
    import sys

    from pflseg.flare.jobs import tracking_receivers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"tracking\.receivers lists wandb.*pip install \"pflseg\[tracking\]\""):
        load_job_config("fedavg", overrides={"tracking": {"receivers": ["wandb"]}})
    cfg = load_job_config("fedavg")
    cfg["tracking"]["receivers"] = ["wandb"]  # a config that skipped the check (e.g. carried by an exported job)
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it fails
    monkeypatch.delitem(sys.modules, WANDB_MODULE, raising=False)
    with pytest.raises(ConfigError, match=r"wandb is not installed where the job is built: pip install \"pflseg"):
        tracking_receivers(cfg)


@pytest.mark.parametrize("tracking, bad", [({"wandb_mode": "cloud"}, "tracking.wandb_mode"),
                                           ({"wandb_dir": ""}, "tracking.wandb_dir")])
def test_bad_wandb_values_are_named(tracking, bad):
    with pytest.raises(ConfigError, match=bad.replace(".", r"\.")):
        load_job_config("fedavg", overrides={"tracking": tracking})


def test_wandb_keeps_each_sites_metrics_apart_under_the_same_names(stub_wandb):
    """What the sites send (TensorBoard-style scalars, ``pflseg.flare.client``) reaches FLARE's W&B receiver as one
    queue (one W&B run) per site, each with the same metric names and the round as the step."""
    from nvflare.apis.analytix import AnalyticsData, AnalyticsDataType, LogWriterName
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBReceiver

    class Queue(list):  # what the receiver's per-site process would read
        put = list.append

        def __bool__(self):
            return True

    receiver = WandBReceiver(wandb_args={"project": "p", "name": "n", "group": "g", "job_type": "t"})
    receiver.queues = {"site-1": Queue(), "site-2": Queue()}
    for site, dice in (("site-1", 0.5), ("site-2", 0.7)):
        for tag, value in (("val_dice", dice), ("train_loss", 1 - dice)):
            data = AnalyticsData(key=tag, value=value, data_type=AnalyticsDataType.SCALAR,
                                 sender=LogWriterName.TORCH_TB, global_step=3)
            receiver.save(FLContext(), data.to_dxo().to_shareable(), site)
    logged = {site: [(t.task_type, t.task_data, t.step) for t in q] for site, q in receiver.queues.items()}
    assert logged == {"site-1": [("log", {"val_dice": 0.5}, 3), ("log", {"train_loss": 0.5}, 3)],
                      "site-2": [("log", {"val_dice": 0.7}, 3), ("log", {"train_loss": 1 - 0.7}, 3)]}
