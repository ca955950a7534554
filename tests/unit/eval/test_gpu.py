"""The pure parts of `pflseg report gpu` (pflseg.eval.gpu): the plan and its estimate, pytest's and nvidia-smi's
output read, GPU memory mapped to sites, the tables on fabricated measurements, the device check. The command end
to end (a dry run on the CPU): tests/integration/test_gpu_dry_run.py."""

import types

import pytest
import torch

from pflseg.eval import gpu


def test_the_check_runs_every_demo_method_with_amp_off_and_bf16_and_fedavg_on_several_sites():
    plan = gpu.make_plan(dry_run=False)
    rows = gpu.steps(plan)
    amp = {(s["job"], s["amp"]) for s in rows if s["step"] == "amp"}
    assert amp == {(job, a) for job in gpu.demo_methods() for a in ("off", "bf16")}
    assert {"fedbn", "fedsm", "grace", "iopfl", "lcfed"} <= set(gpu.demo_methods())
    assert [s["sites"] for s in rows if s["step"] == "sites"] == [3, 6]
    ref = [s for s in rows if s["step"] == "reference"]
    assert len(ref) == 1 and ref[0]["device"] == "cpu" and ref[0]["sites"] == 3
    assert [s["step"] for s in rows][:1] == ["tests"] and 2 <= plan.rounds <= 3


def test_the_dry_run_is_the_smallest_of_each_step():
    plan = gpu.make_plan(dry_run=True)
    rows = gpu.steps(plan)
    assert plan.rounds == 1 and plan.sites == (2,) and len(plan.methods) == 1 and plan.size <= 32
    assert {s["step"] for s in rows} == {"tests", "sites", "reference", "plain", "amp"}
    assert all("dry run" in s["device"] for s in rows if s["step"] in ("sites", "amp", "plain"))
    text = gpu.plan_text(plan, None)
    total = sum(s["estimate_s"] for s in rows)
    assert f"estimate {total / 60:.1f} min" in text and text.count("\n") == len(rows)


def test_pytest_summary_counts():
    out = "....s\nFAILED tests/x.py::t\n=== 3 passed, 1 failed, 2 skipped, 1 error, 4 deselected in 12.30s ===\n"
    assert gpu.pytest_counts(out) == {"passed": 3, "failed": 1, "skipped": 2, "errors": 1, "deselected": 4}
    assert gpu.pytest_counts("7 skipped in 0.5s") == {"passed": 0, "failed": 0, "skipped": 7, "errors": 0,
                                                       "deselected": 0}
    assert gpu.pytest_counts("ImportError while loading conftest")["passed"] == 0


def test_nvidia_smi_apps_and_their_sites():
    apps = gpu.smi_apps("101, 1200\n102, 900\n101, 100\n555, [N/A]\n")
    assert apps == {101: 1300.0, 102: 900.0}
    sites, other = gpu.per_site({101: 1300.0, 102: 900.0, 7: 500.0}, {101: "site-1", 102: "site-2"})
    assert sites == {"site-1": 1300.0, "site-2": 900.0} and other == 500.0


def test_the_gpu_sampler_keeps_each_sites_peak_and_the_whole_gpus():
    outputs = iter([("101, 1024\n102, 512\n9, 2048\n", "4000\n"), ("101, 2048\n102, 256\n", "5000\n")])
    state = {}

    def query(arg):
        if arg.startswith("--query-compute-apps"):
            state["now"] = next(outputs)
            return state["now"][0]
        return state["now"][1]

    procs = [(types.SimpleNamespace(pid=101), "site-1"), (types.SimpleNamespace(pid=102), "site-2"),
             (types.SimpleNamespace(pid=100), "server")]
    sampler = gpu.GpuSampler(lambda: procs, query=query)
    sampler.sample()
    sampler.sample()
    peak = sampler.peak()
    assert peak["peak_site_gib"] == {"site-1": 2.0, "site-2": 0.5}
    assert peak["peak_device_gib"] == pytest.approx(5000 / 1024) and peak["unmatched_gib"] == 2.0
    assert peak["samples"] == 2 and peak["failures"] == []


def test_a_missing_nvidia_smi_is_named_not_raised():
    def query(arg):
        raise FileNotFoundError("nvidia-smi")

    sampler = gpu.GpuSampler(lambda: [], query=query)
    sampler.sample()
    assert sampler.peak()["samples"] == 0 and "nvidia-smi" in sampler.peak()["failures"][0]


def run_row(step, amp="off", sites=3, device="cuda", dice=0.8, memory=None, job="fedavg"):
    return {"step": step, "job": job, "sites": sites, "amp": amp, "device": device, "seconds_per_round": 2.5,
            "compute_s": 1.25, "fixed_s": 0.4, "seconds": 31.0, "dice": {"FedAvg": dice},
            "memory": memory or {"kind": "gpu", "peak_site_gib": {"site-1": 1.5, "site-2": 1.25}}}


def fabricated(dry=False):
    return {"setup": {"dry_run": dry, "rounds": 2, "device": "NVIDIA H100", "torch": "2.5", "cuda": "12.4"},
            "seconds": 540.0,
            "tests": {"command": "-m pytest -m gpu -q", "passed": 9, "failed": 1, "skipped": 0, "errors": 0,
                      "seconds": 120.0, "returncode": 1},
            "runs": [run_row("sites", dice=0.80), run_row("sites", sites=6, dice=0.7,
                                                         memory={"kind": "gpu", "peak_device_gib": 9.0}),
                     run_row("reference", device="cpu", dice=0.79),
                     run_row("amp", job="grace", dice=0.61), run_row("amp", "bf16", job="grace", dice=0.30)],
            "plain": {"job": "fedavg", "sites": 3, "device": "cuda", "plain_s": 1.0, "compute_s": 1.25, "ratio": 1.25},
            "skipped": ["lcfed, demo preset, train.amp bf16: over budget"], "errors": ["x: RuntimeError: boom"]}


def test_dice_pairs_the_device_with_the_cpu_and_bf16_with_amp_off():
    runs = fabricated()["runs"]
    (cpu,) = gpu.dice_pairs(runs, "cpu")
    assert (cpu["sites"], cpu["delta"], cpu["tolerance"], cpu["ok"]) == (3, pytest.approx(0.01), gpu.DICE_TOL, True)
    (amp,) = gpu.dice_pairs(runs, "amp")
    assert amp["job"] == "grace" and amp["delta"] == pytest.approx(-0.31) and amp["ok"] is False


def test_the_table_has_every_section():
    text = gpu.to_markdown(fabricated())
    for part in ("NVIDIA H100", "9 passed, 1 failed", "**Runs**", "| sites | fedavg | 6 |", "2.50",
                 "1.50 (1.50, 1.25)", "no site PID seen; whole GPU 9.00", "Site compute vs a plain PyTorch loop",
                 "| fedavg | 3 | 1.00 | 1.25 | 1.25 |", "Dice on the device vs the CPU", "+0.010 | yes",
                 "Dice with bf16 vs without", "-0.310 | **NO**", "skipped: lcfed", "error: x: RuntimeError: boom"):
        assert part in text, part
    assert "dry run" not in text


def test_a_dry_run_says_so_in_its_table():
    result = fabricated(dry=True)
    result["runs"][0]["memory"] = {"kind": "host PSS (dry run)", "peak_site_gib": {"site-1": 0.5}}
    text = gpu.to_markdown(result)
    assert "(dry run: CPU, smallest sizes; not a GPU measurement)" in text
    assert "0.50 (0.50) host PSS, dry run" in text and "dry run: no CUDA, so they are skipped" in text


def test_without_cuda_the_check_stops_and_names_the_dry_run(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device.*--dry-run"):
        gpu.run(tmp_path)
    assert not (tmp_path / gpu.RESULTS_JSON).exists()


def test_plan_prints_and_runs_nothing(tmp_path):
    text = gpu.report(plan=True, workspace=str(tmp_path))
    assert text.startswith("pflseg report gpu: GPU check") and "budget 9.5 min" in text
    assert list(tmp_path.iterdir()) == []


def test_a_runs_dice_is_the_mean_over_sites_of_each_column_it_scored():
    results = {"test": {"site-1": {"global": {"dice": 0.5}}, "site-2": {"global": {"dice": 0.7}}}}
    assert gpu.run_dice("fedavg", results) == {"FedAvg": pytest.approx(0.6)}  # no AdaBN column: train.adabn off
    both = {"test": {s: {"global": {"dice": 0.5}, "global_adabn": {"dice": 0.25}} for s in ("site-1", "site-2")}}
    assert gpu.run_dice("fedavg", both) == {"FedAvg": 0.5, "FedAvg + AdaBN": 0.25}
