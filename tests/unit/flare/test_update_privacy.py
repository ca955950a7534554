"""The server side of ``privacy.update``: answers of FLARE's kind DIFF are added back to what the task sent
(``pflseg.flare.controllers.base.add_diff``), so FLARE's own filters (ExcludeVars, PercentilePrivacy) work with
every controller; the filters written into the job by ``privacy.update.filters``."""

import json

import pytest
import torch
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.filters import ExcludeVars, PercentilePrivacy
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from pflseg.config import ConfigError
from pflseg.flare.checks import check_update
from pflseg.flare.controllers.base import add_diff
from pflseg.flare.jobs import export_job
from pflseg.flare.state import prefixed, unprefixed
from tests.unit.flare.controllers.conftest import Stub, make, scaled


def sent_model():
    return {"global.w": torch.tensor([1.0, 2.0, 3.0]), "global.n": torch.tensor(5, dtype=torch.int64)}


def test_a_diff_is_added_back_to_what_was_sent_in_the_sent_dtype():
    sent = sent_model()
    res = FLModel(params={"global.w": torch.tensor([0.5, 0.0, -1.0], dtype=torch.float64),
                          "global.n": torch.tensor(2.0)}, params_type=ParamsType.DIFF)  # a filter made n float
    assert add_diff(res, sent, sent) is None
    assert res.params_type == ParamsType.FULL
    assert res.params["global.w"].dtype == torch.float32 and res.params["global.w"].tolist() == [1.5, 2.0, 2.0]
    assert res.params["global.n"].dtype == torch.int64 and int(res.params["global.n"]) == 7
    assert check_update(res.params, sent) is None


def test_a_key_a_filter_dropped_counts_as_unchanged_and_unsent_keys_stay_as_they_are():
    sent = sent_model()
    res = FLModel(params={"global.w": torch.ones(3), "stats.x": torch.tensor([9.0])}, params_type=ParamsType.DIFF)
    assert add_diff(res, sent, {**sent, "stats.x": torch.zeros(1)}) is None
    assert torch.equal(res.params["global.n"], sent["global.n"])  # dropped: the value sent (a zero update)
    assert res.params["stats.x"].tolist() == [9.0]  # not sent: an update against zero


@pytest.mark.parametrize("value, reason", [(torch.tensor([float("nan"), 0.0, 0.0]), "NaN"),
                                           (torch.zeros(4), "shape")])
def test_an_unusable_difference_is_a_reason(value, reason):
    res = FLModel(params={"global.w": value}, params_type=ParamsType.DIFF)
    assert reason in add_diff(res, sent_model(), sent_model())


def test_full_answers_are_left_as_they_are():
    params = {"global.w": torch.zeros(3)}
    res = FLModel(params=params, params_type=ParamsType.FULL)
    assert add_diff(res, sent_model(), sent_model()) is None and res.params is params


def through(filt, reply: FLModel) -> FLModel:
    """``reply`` as FLARE carries it: to a Shareable, through the task result filter, back to an FLModel."""
    shareable = filt.process(FLModelUtils.to_shareable(reply), FLContext())
    return FLModelUtils.from_shareable(shareable)


def diff_round(tmp_path, monkeypatch, filt, send="diff"):
    """One FedAvg round of 3 stubbed sites whose answer (``factor`` x the sent floats) passes ``filt`` as FLARE's
    task result filter would; returns (controller, global state before)."""
    ctrl = make("fedavg", tmp_path, monkeypatch)
    g0 = dict(ctrl.state.global_state)

    def reply(site, data):
        sent = data.params
        trained = scaled(sent, 1.001)
        if send == "diff":
            model = FLModel(params={k: trained[k] - sent[k] for k in sent}, params_type=ParamsType.DIFF)
        else:
            model = FLModel(params=trained, params_type=ParamsType.FULL)
        model.metrics, model.meta = {"val_dice": 0.5}, {"NUM_STEPS_CURRENT_ROUND": 4}
        return through(filt, model)

    Stub(ctrl, reply)
    ctrl.round(0)
    return ctrl, g0


def test_exclude_vars_on_differences_keeps_the_site_and_the_excluded_keys(tmp_path, monkeypatch):
    ctrl, g0 = diff_round(tmp_path, monkeypatch, ExcludeVars(exclude_vars=r"global\.model\.0\."))
    assert ctrl.missing == {}
    excluded = [k for k in g0 if k.startswith("model.0.")]
    assert excluded and all(torch.equal(ctrl.state.global_state[k], g0[k]) for k in excluded)
    moved = next(k for k,
                 v in g0.items() if not k.startswith("model.0.") and v.is_floating_point() and v.abs().sum() > 0)
    assert torch.allclose(ctrl.state.global_state[moved], g0[moved] * 1.001)


def test_exclude_vars_on_full_weights_drops_the_site(tmp_path, monkeypatch):
    with pytest.raises(Exception, match="missing key"):  # every site left out: the round fails (before: the same)
        diff_round(tmp_path, monkeypatch, ExcludeVars(exclude_vars=r"global\.model\.0\."), send="weights")


def test_percentile_privacy_on_differences_bounds_the_step_and_keeps_int_buffers(tmp_path, monkeypatch):
    gamma, n_k = 1e-5, 4
    ctrl, g0 = diff_round(tmp_path, monkeypatch,
                          PercentilePrivacy(percentile=10, gamma=gamma, data_kinds=["WEIGHT_DIFF"]))
    assert ctrl.missing == {}
    for k, v in g0.items():
        assert ctrl.state.global_state[k].dtype == v.dtype
        if v.is_floating_point():  # per site |diff| <= gamma x n_k (the filter's bound), so the mean's too
            # float32 rounding of w + d - w
            assert float((ctrl.state.global_state[k] - v).abs().max()) <= gamma * n_k * 1.01
    assert any(not torch.equal(ctrl.state.global_state[k], v) for k, v in g0.items())


def test_percentile_privacy_on_full_weights_breaks_int_buffers(tmp_path, monkeypatch):
    """What FLARE's default (data_kinds WEIGHTS and WEIGHT_DIFF) does to a full-weights answer: int buffers turn
    float, so the answer is refused (and the weights themselves would be clipped to +-gamma)."""
    ctrl = make("fedavg", tmp_path, monkeypatch)
    sent = prefixed("global", ctrl.state.global_state)
    out = through(PercentilePrivacy(percentile=10, gamma=0.01),
                  FLModel(params=dict(sent), params_type=ParamsType.FULL, metrics={"val_dice": 0.5},
                          meta={"NUM_STEPS_CURRENT_ROUND": 1}))
    assert "dtype" in check_update(out.params, sent)


def test_filters_go_into_the_job_on_the_train_task(tmp_path):
    over = {"privacy": {"update": {"send": "diff", "filters": [
        {"filter": "nvflare.app_common.filters.ExcludeVars", "args": {"exclude_vars": r"global\.model\.2\."}},
        {"filter": "nvflare.app_common.filters.PercentilePrivacy", "args": {"gamma": 0.001}}]}}}
    job = export_job("fedavg", tmp_path, overrides=over)
    (entry,) = json.loads((job / "app/config/config_fed_client.json").read_text())["task_result_filters"]
    assert entry["tasks"] == ["train"]
    first, second = entry["filters"]
    assert first["path"].endswith("ExcludeVars")
    assert first["args"] == {"exclude_vars": r"global\.model\.2\.", "data_kinds": ["WEIGHT_DIFF"]}  # the regex itself
    assert second["args"] == {"gamma": 0.001, "data_kinds": ["WEIGHT_DIFF"]}


def test_default_job_has_no_filters_and_filters_need_diff(tmp_path):
    job = export_job("fedavg", tmp_path)
    assert json.loads((job / "app/config/config_fed_client.json").read_text())["task_result_filters"] == []
    with pytest.raises(ConfigError, match="send: diff"):
        export_job("fedavg", tmp_path, overrides={"privacy": {"update": {"filters": [
            {"filter": "nvflare.app_common.filters.ExcludeVars", "args": {"exclude_vars": ["x"]}}]}}})
    with pytest.raises(ConfigError, match="not a FLARE Filter"):
        export_job("fedavg", tmp_path, overrides={"privacy": {"update": {"send": "diff", "filters": [
            {"filter": "pflseg.config.ConfigError"}]}}})


def test_unprefixed_round_trip_helper():  # guards the helper the tests above lean on
    assert set(unprefixed("global", sent_model())) == {"w", "n"}
