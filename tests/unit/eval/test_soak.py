"""The soak report's growth: per process, the slope of its per-round median PSS after the warm-up."""

import pytest

from pflseg.eval.soak import BOUND_MIB, MIB, growth, rounds_done


def trace(per_round_mib, samples=3, warm_jump=500.0):
    """Samples of two processes: "server" as given per round, "site-1" flat; rounds 1-2 jump by ``warm_jump``."""
    out = []
    for r, mib in enumerate(per_round_mib, 1):
        for i in range(samples):
            jump = warm_jump if r <= 2 else 0.0
            out.append((r, {"server": int((mib + jump + 0.1 * i) * MIB), "site-1": int((800 + jump) * MIB)}))
    return out


def test_a_flat_process_passes_and_a_growing_one_fails_the_warm_up_left_out():
    flat = growth(trace([1000.0] * 20), warmup=5)
    assert flat["server"]["growth_mib_per_round"] == pytest.approx(0.0, abs=1e-3) and flat["server"]["passes"]
    assert flat["site-1"]["rounds"] == 15 and flat["site-1"]["passes"]  # rounds 6..20: the jump of 1-2 left out
    grows = growth(trace([1000.0 + 5.0 * r for r in range(20)]), warmup=5)
    assert grows["server"]["growth_mib_per_round"] == pytest.approx(5.0, abs=0.01) and 5.0 > BOUND_MIB
    assert not grows["server"]["passes"] and grows["site-1"]["passes"]
    assert growth(trace([1000.0] * 7), warmup=5)["server"]["growth_mib_per_round"] is None  # 2 rounds: no slope


def test_the_round_a_sample_belongs_to_is_the_newest_checkpoint(tmp_path):
    newest = rounds_done(tmp_path)
    assert newest() == 0
    for r in (1, 2, 12):
        (tmp_path / f"round_{r:04d}.pt").write_bytes(b"")
    assert newest() == 12


def test_a_federations_processes_are_its_participants_and_their_job_processes():
    """The POC soak samples each participant's process by its name and what it started as '<name> job'."""
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    from pflseg.eval.soak import participants

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fed = SimpleNamespace(pids={"server": os.getpid(), "site-1": 2**22 + 12345})  # site-1: no such process
        labels = {proc.pid: label for proc, label in participants(fed)()}
        assert labels[os.getpid()] == "server" and labels[child.pid] == "server job"
        assert "site-1" not in labels.values()
    finally:
        child.kill()
        child.wait()
