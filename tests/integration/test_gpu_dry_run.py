"""`pflseg report gpu --dry-run`: the GPU check end to end on the CPU at its smallest sizes, so that the command is
ready (and cannot rot) for the day a GPU is lent. Its table builder on fabricated measurements:
tests/unit/eval/test_gpu.py."""

import json

import pytest

from pflseg.cli import main
from pflseg.eval import gpu

pytestmark = pytest.mark.slow


def test_the_dry_run_fills_every_section(tmp_path, capsys):
    assert main(["report", "gpu", "--dry-run", "--workspace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / gpu.RESULTS_JSON).read_text())
    assert result["errors"] == [] and result["skipped"] == []
    assert result["setup"]["dry_run"] and result["setup"]["rounds"] == 1

    tests = result["tests"]  # collected from the files that mark gpu tests; skipped without CUDA
    assert tests["skipped"] >= 2 and tests["passed"] == tests["failed"] == tests["errors"] == 0
    assert "-m gpu" in tests["command"] and "tests/gpu/test_cuda.py" in tests["command"]

    runs = {(r["step"], r["job"], r["amp"]): r for r in result["runs"]}
    (method,) = gpu.make_plan(dry_run=True).methods
    assert set(runs) == {("sites", "fedavg", "off"), ("reference", "fedavg", "off"), ("amp", method, "off"),
                         ("amp", method, "bf16")}
    for r in runs.values():
        assert r["seconds_per_round"] > 0 and r["compute_s"] > 0
        assert set(r["memory"]["peak_site_gib"]) == {"site-1", "site-2"}, r["memory"]
        assert r["memory"]["kind"] == "host PSS (dry run)"
        assert r["dice"] and all(0 <= v <= 1 for v in r["dice"].values())
    # the same config on the same device (the CPU, in a dry run): the same numbers
    assert runs[("sites", "fedavg", "off")]["dice"] == runs[("reference", "fedavg", "off")]["dice"]

    plain = result["plain"]
    assert plain["plain_s"] > 0 and plain["ratio"] > 0 and set(plain["per_site"]) == {"site-1", "site-2"}

    text = (tmp_path / gpu.MARKDOWN).read_text()
    assert out.rstrip().endswith(text.rstrip())  # printed after the plan and the progress lines
    assert "pflseg report gpu: dry run on the CPU" in out.splitlines()[0]  # the plan comes first
    for part in ("(dry run: CPU, smallest sizes; not a GPU measurement)", "**gpu-marked tests**", "**Runs**",
                 "Site compute vs a plain PyTorch loop", "Dice on the device vs the CPU", "Dice with bf16 vs without",
                 "host PSS, dry run"):
        assert part in text and part in out, part
    assert "**NO**" not in text
