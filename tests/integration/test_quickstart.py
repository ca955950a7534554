"""The README's researcher quick start, run as a newcomer runs it: its first command, verbatim, in a fresh folder.

Only that command runs here (one FLARE simulator run of the tiny job, `jobs/fedavg_tiny`'s config): the test command
has 15 minutes in all. Every other `pflseg` command of README.md and docs/ is parsed by the real argument parser, its
jobs and config keys loaded (tests/unit/test_docs.py); the project admin's loopback federation runs in
tests/integration/test_deploy.py, a site's `site init` / `site check` in tests/unit/flare/test_settings.py.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from pflseg.cli import main

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start(role: str) -> list[list[str]]:
    """The `pflseg` commands of the first code block under the README's "Quick start: <role>" heading."""
    text = README.read_text()
    section = text[text.index(f"## Quick start: {role}"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("pflseg ")]


def test_the_researchers_first_command_runs_as_written(tmp_path, monkeypatch, capsys):
    argv = quick_start("researcher")[0]
    assert argv == ["pflseg", "run", "fedavg_tiny"]  # the tiny committed job, no flags to get wrong
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "runs/fedavg_tiny/state/server/fedavg_tiny/results.json").read_text())
    assert results["sites"] == ["site-1", "site-2", "site-3"] and not results["missing"]
    assert len(results["history"]) == 2 and results["config"]["data"]["size"] == 32
    assert "| site-1 |" in out and (tmp_path / "runs/fedavg_tiny/results/test.md").is_file()
