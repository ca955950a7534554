"""A pflseg recipe run end to end on FLARE's SimEnv through the Python API (2 sites, 1 round): pflseg's state under
the SimEnv workspace by default, FLARE's workspace of the job beside it. The sites read a tiny data root (PFLSEG_DATA:
5 cases of 6 slices) and train one epoch: the check is where things land, not the training. (``python job.py``, where
the sites make the embedded synthetic default: test_simulator.py; ProdEnv: test_deploy.py.)"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pflseg.data import make_synthetic

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys
    from nvflare.recipe import SimEnv
    from pflseg.flare.recipes import LocalRecipe

    env = SimEnv(num_clients=2, workspace_root=sys.argv[1])
    recipe = LocalRecipe(rounds=1, overrides={"data": {"size": 32}, "net": {"channels": [4, 8, 16], "strides": [2, 2]},
                                              "train": {"batch_size": 8, "epochs": 1}})
    run = recipe.execute(env)
    print("RESULT", run.get_result(), recipe.results(env))
""")


def test_a_recipe_runs_on_simenv(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PFLSEG_STATE_DIR", "PFLSEG_SITE_CONFIG")}
    env["PFLSEG_DATA"] = str(make_synthetic(tmp_path / "data", n_sites=2, cases=5, size=32, depth=6))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    flare_ws, results = line.split()[1:]
    assert flare_ws == str(tmp_path / "local") and (tmp_path / "local" / "server" / "simulate_job").is_dir()
    assert results == str(tmp_path / "pflseg_state" / "server" / "local" / "results.json")
    res = json.loads((tmp_path / "pflseg_state" / "server" / "local" / "results.json").read_text())
    assert res["job"] == "local" and sorted(res["test"]) == ["site-1", "site-2"]
    assert all(0.0 <= res["test"][s]["site"]["dice"] <= 1.0 for s in res["test"])
