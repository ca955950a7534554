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
