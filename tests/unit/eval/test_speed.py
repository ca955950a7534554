"""The pure parts of `pflseg report speed` (pflseg.eval.speed): the round arithmetic against hand-made histories, the
floor measured by the floor job (pflseg.flare.floor; run in FLARE: tests/integration/test_floor.py), the tables, the
site executor kind of a job folder (its memory sampler: tests/unit/deploy/test_sampling.py)."""

import argparse
import ast
import inspect
import json

import pytest
import torch
from nvflare.apis.executor import Executor
from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor

from pflseg.config import load_job_config
from pflseg.eval import speed

HISTORY = [  # rounds count from 1, as in results.json; round 1 loads the data: not measured
    {"round": 1, "wall_seconds": 50.0, "site_compute_seconds": {"site-1": 40.0, "site-2": 45.0}},
    {"round": 2, "wall_seconds": 4.0, "site_compute_seconds": {"site-1": 1.0, "site-2": 3.0}},
    {"round": 3, "wall_seconds": 6.0, "site_compute_seconds": {"site-1": 2.0, "site-2": 1.0}},
]


class Echo(Executor):
    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        return shareable


class InProcessScript(ClientAPIExecutor):
    def __init__(self):
        super().__init__(execution_mode="in_process", task_script_path="train.py")


# ---- arithmetic -----------------------------------------------------------------------------------------------------
def test_round_costs_skip_the_first_round_and_take_medians():
    costs = speed.round_costs(HISTORY)
    assert costs["rounds"] == [2, 3]
    assert costs["wall"] == [4.0, 6.0] and costs["slowest"] == [3.0, 2.0] and costs["fixed"] == [1.0, 4.0]
    assert costs["wall_s"] == 5.0 and costs["slowest_s"] == 2.5 and costs["fixed_s"] == 2.5
    assert costs["compute"] == {"site-1": [1.0, 2.0], "site-2": [3.0, 1.0]}
    assert costs["compute_s"] == pytest.approx((1.5 + 2.0) / 2)


def test_a_single_round_is_measured_and_no_round_is_an_error():
    costs = speed.round_costs(HISTORY[:1])
    assert costs["rounds"] == [1] and costs["fixed_s"] == 5.0
    with pytest.raises(ValueError, match="no round"):
        speed.round_costs([])


#: the floor job's results.json history: no site computes; round 1 starts the sites (not measured)
FLOOR = [{"round": r, "wall_seconds": w, "site_compute_seconds": {"site-1": 0.0, "site-2": 0.0}}
         for r, w in ((1, 9.0), (2, 0.8), (3, 0.6))]


def test_compare_ratio_fixed_cost_and_the_floor_measured_beside_it():
    plain = {"site-1": [9.0, 1.0, 1.0], "site-2": [9.0, 1.0, 1.5]}  # the plain loop's first round is not compared
    floor = speed.floor_seconds(FLOOR)
    assert floor == pytest.approx(0.7)  # the median of the measured rounds 2, 3: as a job's
    row = speed.compare(speed.round_costs(HISTORY), plain, floor=floor)
    assert row["plain_s"] == pytest.approx((1.0 + 1.25) / 2)
    assert row["ratio"] == pytest.approx(1.75 / 1.125)
    assert row["floor_s"] == floor and row["above_floor_s"] == pytest.approx(2.5 - 0.7)
    poc = speed.compare(speed.round_costs(HISTORY), None, floor=speed.floor_seconds(FLOOR[:2]))
    assert poc["plain_s"] is None and poc["ratio"] is None and poc["above_floor_s"] == pytest.approx(2.5 - 0.8)
    none = speed.compare(speed.round_costs(HISTORY), plain, floor=speed.floor_seconds(None))
    assert none["floor_s"] is None and none["above_floor_s"] is None
    assert speed.compare(speed.round_costs(HISTORY), plain) == none  # the GPU check's rows: no floor


def test_plain_weighted_average_closed_form():
    out = speed.plain_weighted_average([{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])}], [1, 3])
    assert torch.allclose(out["w"], torch.tensor([2.5, 3.5]))


def test_job_overrides_keep_sets_but_rounds_sites_size_and_executor_win():
    out = speed.job_overrides(3, 4, 32, {"rounds": 9, "train": {"epochs": 1}, "data": {"size": 8}}, "client_api")
    assert out == {"rounds": 4, "min_clients": 3, "train": {"epochs": 1}, "data": {"size": 32},
                   "site": {"executor": "client_api"}}
    assert "site" not in speed.job_overrides(2, 2, 32)


# ---- tables ---------------------------------------------------------------------------------------------------------
def result(**more):
    row = {"env": "sim", "job": "fedavg", "executor": "executor", "plain_s": 1.125, "compute_s": 1.75, "ratio": 1.5556,
           "wall_s": 5.0, "slowest_s": 2.5, "fixed_s": 2.5, "floor_s": 0.6, "above_floor_s": 1.9,
           "floor_parameters": 205_878,
           "peak_total_gib": 2.054, "peak_site_max_gib": 0.651}
    return {"setup": {"sites": 2, "size": 32, "rounds": 3, "threads_per_site": 1, "cores": 2}, "device": "cpu",
            "rows": [row], "plain": {"iopfl": {"none": "its site's round is its own step"}},
            "aggregation": [{"job": "grace", "step": "GraceController.aggregate", "sites": 6, "parameters": 8_000_000,
                             "step_s": 0.2, "plain_s": 0.05, "ratio": 4.0, "vs_first": 2.5,
                             "first": "fedavg"},
                            {"job": "local", "step": None, "note": "LocalController aggregates nothing"}],
            "errors": [], **more}


def test_aggregation_steps_are_timed_together_against_fedavgs_and_a_plain_average():
    """Real controllers' aggregate steps on a small UNet (FedProx's step is FedAvg's; LC-Fed's net has updates of
    its own; Local aggregates nothing)."""
    small = {"channels": [4, 8], "strides": [2], "num_res_units": 0}
    rows = {r["job"]: r for r in speed.aggregation_times(["fedavg", "fedprox", "grace", "lcfed", "local"], n_sites=3,
                                                         repeats=1, net=small)}
    assert rows["local"]["step"] is None and "aggregates nothing" in rows["local"]["note"]
    assert rows["fedavg"]["vs_first"] == 1.0 and rows["grace"]["step"] == "GraceController.aggregate"
    for job in ("fedavg", "fedprox", "grace", "lcfed"):
        assert rows[job]["first"] == "fedavg" and rows[job]["step_s"] > 0 and rows[job]["plain_s"] > 0
        assert rows[job]["vs_first"] == rows[job]["step_s"] / rows["fedavg"]["step_s"]
        assert rows[job]["checks_s"] > 0 and rows[job]["checks_ratio"] == rows[job]["checks_s"] / rows[job]["plain_s"]
    assert rows["fedavg"]["parameters"] == rows["grace"]["parameters"] < rows["lcfed"]["parameters"]
    # the step every round after robust.median_rounds takes (round 0 timed the first round's median: 20x a plain
    # average at 8 M parameters, reported as FedAvg's step)
    assert rows["fedavg"]["round"] == load_job_config("fedavg")["robust"]["median_rounds"]


def test_to_markdown_renders_the_rows():
    text = speed.to_markdown(result())
    assert "2 sites, image size 32, 3 rounds (measured: rounds 1..2; medians)" in text
    assert "| " + " | ".join(speed.HEAD) + " |" in text
    assert "| sim | fedavg | executor | 1.12 | 1.75 | 1.56 | 5.00 | 2.50 | 2.50 | 0.60 | 1.90 | 2.05 / 0.65 |" in text
    assert "FLARE floor s (this run)" in text and "FLARE floor: measured in this run, just before each job" in text
    assert "iopfl: no plain loop (its site's round is its own step)" in text
    assert "step / fedavg's |" in text
    assert "| grace | GraceController.aggregate | 6 | 8.00 | 0.2000 | 0.0500 | 4.00 | 2.50 | - | - |" in text
    assert "| local | LocalController aggregates nothing | - | - | - | - | - | - | - | - |" in text
    assert "error:" not in text and "Scaling" not in text


def test_to_markdown_names_errors_and_missing_numbers():
    res = result(errors=["poc: RuntimeError: no connection"])
    res["rows"][0].update(plain_s=None, ratio=None, floor_s=None, above_floor_s=None, peak_total_gib=None)
    text = speed.to_markdown(res)
    assert "| sim | fedavg | executor | - | 1.75 | - | 5.00 | 2.50 | 2.50 | - | - | - |" in text
    assert "error: poc: RuntimeError: no connection" in text


def test_scaling_table():
    rows = [{"axis": "sites", "value": 3, "wall_s": 2.0, "slowest_s": 1.5, "peak_total_gib": 1.25,
             "peak_site_max_gib": 0.5},
            {"axis": "experts", "value": 4, "peak_rss_gib": 0.75, "routing_rss_gib": 0.25,
             "routing_s_per_image": 0.0123, "ratio_routing_to_unet": 41.6},
            {"axis": "size", "value": 256, "error": "MemoryError: "}]
    text = speed.scaling_markdown(rows)
    assert "| sites | 3 | 2.00 | 1.50 | 1.25 | 0.50 | - | - |" in text
    assert "| experts | 4 | - | - | 0.75 (+0.25 routing) | - | 0.012 | 42 |" in text
    assert "| size | 256 | failed: MemoryError:  |" in text


# ---- the job's site executor kind -----------------------------------------------------------------------------------
def job_folder(tmp_path, path, args=None, tasks=("*",)):
    config = tmp_path / "job" / "app" / "config"
    config.mkdir(parents=True, exist_ok=True)
    entry = {"tasks": list(tasks), "executor": {"path": path, "args": args or {}}}
    (config / "config_fed_client.json").write_text(json.dumps({"format_version": 2, "executors": [entry]}))
    return tmp_path / "job"


@pytest.mark.parametrize("path, args, kind", [
    ("pflseg.flare.executor.SiteExecutor", {}, "executor"),
    ("job_client.SiteExecutor", {}, "executor"),  # a BYOC job's name for it
    (f"{__name__}.Echo", {}, "executor"),
    ("nvflare.app_common.executors.client_api_executor.ClientAPIExecutor",
     {"execution_mode": "in_process", "task_script_path": "job_client.py"}, "client_api"),
    (f"{__name__}.InProcessScript", {}, "client_api"),  # a subclass that sets the mode itself
    ("nvflare.app_common.executors.client_api_executor.ClientAPIExecutor",
     {"execution_mode": "external_process", "command": "python train.py"}, "client_api_external"),
    ("no.such_module.Executor", {}, "unknown"),
])
def test_executor_kind_of_a_job_folder(tmp_path, path, args, kind):
    assert speed.executor_kind(job_folder(tmp_path, path, args)) == kind


def test_executor_kind_of_the_train_task(tmp_path):
    assert speed.executor_kind(job_folder(tmp_path, f"{__name__}.Echo", tasks=["validate"])) == "unknown"
    job = job_folder(tmp_path, f"{__name__}.Echo", tasks=["train"])
    assert speed.executor_kind(job) == "executor"


# ---- the floor job beside each job ----------------------------------------------------------------------------------
def test_the_floor_job_matches_the_job_it_runs_beside(tmp_path):
    """Its settings come from the exported job: kind, sites, rounds and the net's parameter count (LC-Fed's net sized
    to the sites, as its server sizes it); the Client API in another process has no floor job."""
    from pflseg.flare.jobs import export_job
    from pflseg.nets import build_net

    small = {"channels": [4, 8], "strides": [2], "num_res_units": 0}
    job = export_job("fedavg", tmp_path, overrides={"rounds": 3, "min_clients": 2, "net": small})
    setting = speed.floor_setting(job, speed.executor_kind(job), 2)
    assert setting == {"kind": "executor", "sites": 2, "rounds": 3,
                       "parameters": sum(p.numel() for p in build_net(small).parameters())}
    lcfed = export_job("lcfed", tmp_path, overrides={"rounds": 2, "min_clients": 3})
    three, four = (speed.floor_setting(lcfed, "client_api", n)["parameters"] for n in (3, 4))
    assert 0 < three < four  # one site embedding per site
    assert speed.floor_setting(job, "client_api_external", 2) is None


def test_the_floor_job_is_a_package_mode_job_of_allowed_classes(tmp_path):
    from pflseg.flare.allowlist import FLOOR_CLASSES, allow_list, job_classes, narrow_list
    from pflseg.flare.floor import export_floor_job

    for kind, site in (("executor", "FloorExecutor"), ("client_api", "FloorClientAPIExecutor")):
        job = export_floor_job(tmp_path, f"fedavg_floor_{kind}", kind, sites=3, rounds=4, parameters=1000)
        assert not (job / "app" / "custom").exists()  # no code in the job: the sites' pflseg runs
        server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
        client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
        assert server["workflows"] == [{"id": "controller", "path": "pflseg.flare.floor.FloorController",
                                        "args": {"job": f"fedavg_floor_{kind}", "rounds": 4, "parameters": 1000}}]
        assert [e["executor"]["path"] for e in client["executors"]] == [f"pflseg.flare.floor.{site}"]
        assert json.loads((job / "meta.json").read_text())["min_clients"] == 3
        assert speed.executor_kind(job) == kind  # the kind the report compares it with
    assert set(FLOOR_CLASSES) == {f"pflseg.flare.floor.{c}" for c in
                                  ("FloorController", "FloorExecutor", "FloorClientAPIExecutor")}
    assert set(FLOOR_CLASSES) <= set(narrow_list()) and set(FLOOR_CLASSES) <= set(allow_list())
    assert not set(FLOOR_CLASSES) & set(job_classes())
    with pytest.raises(ValueError, match="site executor kind 'client_api_external'"):
        export_floor_job(tmp_path, "x", "client_api_external")


def test_the_floor_site_sends_the_model_back_unchanged():
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from pflseg.flare.floor import FloorExecutor

    sent = {"w": torch.arange(5, dtype=torch.float32)}
    reply = FloorExecutor().execute("train", FLModelUtils.to_shareable(FLModel(params=sent)), None, None)
    back = FLModelUtils.from_shareable(reply)
    assert torch.equal(back.params["w"], sent["w"]) and back.meta["NUM_STEPS_CURRENT_ROUND"] == 1


# ---- plain loop availability, flags -------------------------------------------------------------------------------
def test_plain_equivalent_only_for_the_one_loop_with_hooks():
    from pflseg.flare.methods import METHODS

    assert speed.plain_equivalent(METHODS["fedavg"].site) is None
    assert speed.plain_equivalent(METHODS["grace"].site) is None
    assert "own step" in speed.plain_equivalent(METHODS["iopfl"].site)


def test_the_plain_loop_runs_the_one_training_loop_at_a_site(tmp_path, monkeypatch):
    """The plain side trains with ``train_epochs`` and scores with ``evaluate`` (issue 40 item 5: no second loop):
    one round of FedAvg at a site, in a process of its own, timed; the one loop's functions are the ones it calls."""
    from pflseg.config import load_job_config
    from pflseg.data import make_synthetic

    root = make_synthetic(tmp_path / "root", n_sites=2, cases=3, size=16, depth=2)
    cfg = load_job_config("fedavg", overrides={"data": {"size": 16}, "train": {"epochs": 1, "batch_size": 4},
                                               "net": {"channels": [4, 8], "strides": [2]}})
    times = speed.plain_rounds(root, ["site-2"], cfg, rounds=1, threads=1, timeout=300)
    assert list(times) == ["site-2"] and len(times["site-2"]) == 1 and times["site-2"][0] > 0
    source = inspect.getsource(speed._plain_loop)
    called = {n.func.id for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"train_epochs", "evaluate"} <= called and ".backward(" not in source


def test_flags_reach_run():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", type=int)  # a report flag declared elsewhere is left as it is
    speed.add_arguments(parser)
    args = parser.parse_args(["--methods", "fedavg,grace", "fedprox", "--sites", "2", "--envs", "sim", "--set",
                              "train.epochs=1", "--scaling"])
    opts = speed.options(**vars(args), experts=5)
    assert opts["methods"] == ["fedavg", "grace", "fedprox"] and opts["sites"] == 2 and opts["envs"] == ("sim",)
    assert opts["sets"] == {"train": {"epochs": 1}} and opts["scale"] and opts["rounds"] == speed.DEFAULTS["rounds"]
    assert opts["workspace"] == "runs/speed"
