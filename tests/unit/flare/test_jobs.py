"""The committed jobs/ folders are exactly what `pflseg jobs export` makes from app_configs/."""

import filecmp
import json
from pathlib import Path

from pflseg.config import check_effective, job_names, load_job_config
from pflseg.flare.jobs import export_all, export_job
from pflseg.flare.methods import METHOD_SECTIONS, own_config

REPO = Path(__file__).resolve().parents[3]


def _diff(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    out = [f"{a.name}: only in one side {cmp.left_only + cmp.right_only}"] if cmp.left_only or cmp.right_only else []
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    out += [str(a / f) for f in mismatch + errors]
    for sub in cmp.common_dirs:
        out += _diff(a / sub, b / sub)
    return out


def test_committed_jobs_match_a_fresh_export(tmp_path):
    export_all(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (REPO / "jobs").iterdir())
    assert _diff(tmp_path, REPO / "jobs") == [], "jobs/ is stale: run `pflseg jobs export`"


def test_export_carries_every_effective_value(tmp_path):
    job = export_job("fedprox", tmp_path, overrides={"fedprox": {"mu": 0.5}})
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    carried = server["workflows"][0]["args"]["config"]
    effective = load_job_config("fedprox", overrides={"fedprox": {"mu": 0.5}})
    # its own section and every common one; no other method's section (issue 24: "a job carries only its own")
    assert carried == own_config(effective) and carried["fedprox"] == {"mu": 0.5}
    assert not (METHOD_SECTIONS - {"fedprox"}) & set(carried) and set(effective) - set(carried)
    assert check_effective(carried) == effective  # the server and the sites merge the rest from defaults.yaml again
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["path"] == "pflseg.flare.executor.SiteExecutor"
    assert not (job / "app" / "custom").exists()  # package mode: the job carries no code
    assert json.loads((job / "meta.json").read_text())["deploy_map"] == {"app": ["@ALL"]}


def test_every_config_has_a_job():
    assert set(job_names()) == {p.name for p in (REPO / "jobs").iterdir()}
