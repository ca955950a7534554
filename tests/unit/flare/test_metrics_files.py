"""FLARE 2.9's metrics files (metrics/round_metrics.jsonl, metrics/metrics_summary.json) beside results.json."""

import json

from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare import metrics_files
from pflseg.flare.state import prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make

ENTRY = {"round": 2, "wall_seconds": 2.5, "val_dice_mean": 0.625, "val_dice": {"a": 0.5, "b": 0.75},
         "site_compute_seconds": {"a": 1.0, "b": 2.0},
         "site_metrics": {"a": {"n_samples": 8, "train_loss": 0.25, "val_dice": 0.5, "note": "x"},
                          "b": {"n_samples": 24, "train_loss": float("nan"), "val_dice": 0.75}}}


def test_a_round_in_flares_schema_names_as_values_weights_and_skipped():
    rec = metrics_files.round_record(ENTRY)
    assert rec["round"] == 1  # FLARE counts from 0: results.json's round 2
    assert rec["key_metric"] == {"name": "val_dice_mean", "mode": "max"}
    assert rec["aggregated_metrics"] == [{"name": "wall_seconds", "value": 2.5},
                                         {"name": "val_dice_mean", "value": 0.625}]
    a, b = rec["sites"]
    assert a["name"] == "a" and a["weight"] == 8 and a["weight_key"] == "NUM_STEPS_CURRENT_ROUND"
    assert {m["name"]: m["value"] for m in a["metrics"]} == {"n_samples": 8, "train_loss": 0.25, "val_dice": 0.5,
                                                             "site_compute_seconds": 1.0}
    assert b["weight"] == 24 and "train_loss" not in {m["name"] for m in b["metrics"]}
    assert rec["skipped_metrics"] == [{"name": "note", "reason": "unsupported_type", "site": "a"},
                                      {"name": "train_loss", "reason": "non_finite_number", "site": "b"}]
    lines = metrics_files.round_lines([ENTRY, {**ENTRY, "round": 3}]).splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]


def test_summary_has_flares_fields_and_the_test_metrics():
    results = {"job": "fedavg", "best_global_round": 1, "history": [{**ENTRY, "round": 1}, ENTRY],
               "test": {"a": {"global": {"dice": 0.5, "dice_per_class": [0.5, 0.25], "assd": None, "n_cases": 2}}}}
    s = metrics_files.summary(results)
    assert s["schema_version"] == "1" and s["status"] == "metrics_reported" and s["job_name"] == "fedavg"
    assert s["final_round"] == 1 and s["round_metrics_file"] == "round_metrics.jsonl" and s["best_round"] == 1
    assert {"name": "val_dice_mean", "value": 0.625} in s["best_aggregated_metrics"]
    assert [(m["name"], m["value"]) for m in s["test_metrics"]] == [
        ("dice", 0.5), ("dice_per_class_0", 0.5), ("dice_per_class_1", 0.25), ("n_cases", 2)]
    assert metrics_files.summary({"history": []}) is None  # post-training jobs: no rounds, no summary (as FLARE)


def test_the_controller_writes_them_each_round_and_at_the_end(tmp_path, monkeypatch):
    ctrl = make("fedavg", tmp_path, monkeypatch)
    ctrl.get_run_dir = lambda: str(tmp_path / "run")
    ctrl.abort_signal = Signal()
    ctrl.setup = lambda: 0
    rounds_file = tmp_path / "server" / "metrics" / "round_metrics.jsonl"
    seen = []

    def reply(site, data):
        task = stub.sent[-1][0]
        if task == "train":
            seen.append(rounds_file.read_text().count("\n") if rounds_file.exists() else 0)
            return FLModel(params=prefixed("global", unprefixed("global", data.params)),
                           metrics={"val_dice": 0.5, "n_samples": 4}, meta={"NUM_STEPS_CURRENT_ROUND": 4})
        if task == "validate":
            return FLModel(params={}, metrics={"val_dice": 0.5})
        return FLModel(params={}, metrics={"test": {"global": {"dice": 0.5, "hd95": 1.0}}})

    stub = Stub(ctrl, reply)
    ctrl.run_rounds()
    assert seen == [0, 0, 0, 1, 1, 1]  # after round 0, round 1 is sent with one line written
    for folder in (tmp_path / "server", tmp_path / "run"):
        assert (folder / "results.json").is_file()
        lines = (folder / "metrics" / "round_metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["round"] for line in lines] == [0, 1]
        summary = json.loads((folder / "metrics" / "metrics_summary.json").read_text())
        assert summary["final_round"] == 1 and {"site": "site-1", "model": "global", "name": "hd95",
                                                 "value": 1.0} in summary["test_metrics"]
