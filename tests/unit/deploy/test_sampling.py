"""Timing and memory sampling (pflseg.deploy.sampling), shared by the speed report and the simulator runner: whose a
simulator process is, the two ways of finding the processes (by folder named, by process tree) on real processes,
and the interleaved timing."""

import os
import signal
import subprocess
import sys
import time

from pflseg.deploy import sampling


def test_site_of_a_simulator_process():
    worker = ["python", "-m", "nvflare.private.fed.app.simulator.simulator_worker", "-o", "/ws/sim/site-2",
              "--client", "site-2", "--token", "x"]
    assert sampling.site_of(worker) == "site-2"
    assert sampling.site_of(["nvflare", "simulator", "/jobs/fedavg", "-w", "/ws/sim", "-n", "2"]) == "server"


def test_a_command_line_names_a_folder_or_a_path_under_it():
    assert sampling.names(["x", "-w", "/ws/sim"], "/ws/sim") and sampling.names(["-o", "/ws/sim/site-1"], "/ws/sim")
    assert not sampling.names(["-w", "/ws/sim2", "/ws"], "/ws/sim")


def simulator_with_a_worker(marker):
    """A process naming ``marker`` (as ``nvflare simulator -w`` does) that started a site worker (its child)."""
    child = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
             f"{str(marker / 'site-1')!r}, '--client', 'site-1']); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", child, "-w", str(marker)], start_new_session=True)


def sample_until(sampler, parts: set, tries: int = 50) -> dict:
    for _ in range(tries):  # until both run
        time.sleep(0.1)
        sampler.sample()
        if sampler.parts.keys() == parts and len(sampler.find()) == 2:
            break
    return sampler.peak()


def test_memory_sampler_counts_each_process_for_its_site(tmp_path):
    """Found by the folder they name: each is counted for itself, not the child for its parent."""
    marker = tmp_path / "sim"
    proc = simulator_with_a_worker(marker)
    try:
        peak = sample_until(sampling.MemorySampler(sampling.named(marker)), {"server", "site-1"})
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert set(peak["peak_site_gib"]) == {"site-1"} and peak["peak_server_gib"] > 0
    assert 0 < peak["peak_site_max_gib"] < peak["peak_total_gib"]
    assert peak["peak_total_gib"] <= peak["peak_site_max_gib"] + peak["peak_server_gib"] + 1e-9
    assert peak["peak_total_gib"] <= peak["peak_total_rss_gib"], "PSS splits the shared pages RSS counts twice"


def test_a_process_tree_is_summed_in_resident_memory(tmp_path):
    """The simulator runner's footprint: the process and its descendants, RSS only (``pss=False``)."""
    proc = simulator_with_a_worker(tmp_path / "sim")
    try:
        sampler = sampling.MemorySampler(sampling.tree(proc.pid), pss=False)
        peak = sample_until(sampler, {"all"})
        alone = sampling.MemorySampler(sampling.tree(proc.pid), pss=False)
        alone.sample()
        parent = alone.find()[0][0].memory_info().rss
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(sampler.find()) == 0, "a process that has gone is sampled as nothing"
    assert sampler.total == sampler.total_rss == sampler.parts["all"] and peak["peak_server_gib"] == 0
    assert sampler.total_rss > parent > 0, "the child counts too"


def test_best_seconds_warms_up_then_keeps_the_minimum_of_interleaved_repeats():
    calls: list[str] = []
    waits = iter([0.0, 0.0, 0.05, 0.0, 0.0, 0.0])  # warm-up a, b; then a, b, a, b

    def fn(name):
        def go():
            calls.append(name)
            time.sleep(next(waits))
        return go

    best = sampling.best_seconds({"a": fn("a"), "b": fn("b")}, repeats=2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert best["a"] < 0.05 and set(best) == {"a", "b"}
