import json
import re
import stat
from pathlib import Path

import pytest

from pflseg.data import DataError, make_synthetic
from pflseg.flare.settings import resolve_data, site_settings

DATA_CFG = {"synth_task": "prostate", "synth_sites": 3, "synth_seed": 0, "size": 32, "foreground_only": False}


def test_configured_but_missing_data_names_site_path_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PFLSEG_DATA", str(tmp_path / "nowhere"))
    settings = site_settings("site-2")
    with pytest.raises(DataError, match=r"site site-2: data location .*nowhere.* does not exist.*pflseg site init"):
        resolve_data("site-2", settings, DATA_CFG)


def test_site_folder_absent_from_data_root(tmp_path, monkeypatch):
    root = make_synthetic(tmp_path / "root", n_sites=2, cases=3, size=16, depth=2)
    monkeypatch.setenv("PFLSEG_DATA", str(root))
    with pytest.raises(DataError, match=r"site site-7: .*no site\(s\) \['site-7'\]"):
        resolve_data("site-7", site_settings("site-7"), DATA_CFG)


def test_site_config_file_and_unknown_keys(tmp_path, monkeypatch):
    cfg = tmp_path / "s.json"
    cfg.write_text(json.dumps({"data": "/x", "device": "cpu"}))
    monkeypatch.setenv("PFLSEG_SITE_CONFIG", str(cfg))
    s = site_settings("site-1")
    assert s["data"] == "/x" and s["device"] == "cpu" and s["source"] == str(cfg.resolve())
    cfg.write_text(json.dumps({"dataa": "/x"}))
    with pytest.raises(DataError, match="dataa"):
        site_settings("site-1")


def test_no_data_configured_makes_synthetic_data_in_the_workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root, data_site = resolve_data("site-1", site_settings("site-1"), DATA_CFG)
    assert data_site == "site-1" and root.is_relative_to(tmp_path) and (root / "site-1" / "datalist.json").is_file()


# ---- pflseg site init / site check -----------------------------------------------------------------------
def site_kit(path: Path) -> Path:
    """A folder that is a site's startup kit as far as `pflseg site` looks (startup/fed_client.json)."""
    (path / "startup").mkdir(parents=True)
    (path / "startup" / "fed_client.json").write_text("{}")
    return path


@pytest.mark.parametrize("args, problem", [
    (["--data", "{tmp}/nowhere"], r"data location .*nowhere does not exist"),
    (["--data", "{tmp}/root", "--data-site", "site-9"], r"has no site folder 'site-9' \(it holds \['site-1', "
     r"'site-2'\]\)"),
    (["--data", "{tmp}/root", "--device", "gpu0"], r"device 'gpu0' is not auto, cpu, cuda or cuda:N"),
    (["--data", "{tmp}/root", "--device", "cuda:7"], r"device 'cuda:7': this machine has \d+ CUDA device"),
])
def test_site_init_refuses_what_would_fail_and_writes_nothing(args, problem, tmp_path, capsys):
    """Before: `pflseg site init` wrote any path, data site and device, exit 0."""
    from pflseg.cli import main

    make_synthetic(tmp_path / "root", n_sites=2, cases=3, size=16, depth=2)
    kit = site_kit(tmp_path / "site-1")
    assert main(["site", "init", "--site-dir", str(kit), *[a.format(tmp=tmp_path) for a in args]]) == 2
    assert re.search(problem, capsys.readouterr().err) and not (kit / "local" / "pflseg_site.json").exists()


def test_site_init_writes_private_settings_and_site_check_reports_them(tmp_path, monkeypatch, capsys):
    from pflseg.cli import main

    for var in ("PFLSEG_DATA", "PFLSEG_DEVICE", "PFLSEG_SITE_CONFIG", "PFLSEG_STATE_DIR", "PFLSEG_THREADS"):
        monkeypatch.delenv(var, raising=False)
    root = make_synthetic(tmp_path / "root", n_sites=2, cases=3, size=16, depth=2)
    kit, state = site_kit(tmp_path / "site-2"), tmp_path / "outside" / "state"
    assert main(["site", "init", "--site-dir", str(kit), "--data", str(root), "--device", "cpu", "--state-dir",
                 str(state), "--no-publish", "--methods", "fedavg,fedbn"]) == 0
    written = kit / "local" / "pflseg_site.json"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and stat.S_IMODE(state.stat().st_mode) == 0o700
    assert json.loads(written.read_text())["policy"] == {"methods": ["fedavg", "fedbn"], "publish": False}
    capsys.readouterr()
    assert main(["site", "check", "--site-dir", str(kit)]) == 0
    out = capsys.readouterr().out
    assert f"site site-2: settings from {written}" in out and f"state: {state}" in out and "data: valid" in out
    assert "publish: false (default: true)" in out and "methods: fedavg, fedbn" in out
    (root / "site-2" / "datalist.json").unlink()  # the site's data breaks after init: check says so
    assert main(["site", "check", "--site-dir", str(kit)]) == 1
    assert "problem(s):" in capsys.readouterr().out


def test_every_setting_and_environment_variable_is_in_the_configuration_references_one_table():
    """Before: PFLSEG_STATE_DIR, PFLSEG_THREADS, PFLSEG_SITE_CONFIG, PFLSEG_BUNDLE_ROOTS and the settings
    data_site, state_dir, threads had no place in the README where a site's IT would look them up (now in
    docs/configuration.md, which the README's site IT quick start links)."""
    from pflseg.flare.settings import KEYS

    repo = Path(__file__).resolve().parents[3]
    code = "\n".join(p.read_text() for p in (repo / "custom/pflseg").rglob("*.py"))
    variables = set(re.findall(r"PFLSEG_[A-Z_]+[A-Z]", code))
    rows = [line for line in (repo / "docs/configuration.md").read_text().splitlines() if line.startswith("| `")]
    documented = {line.split("`")[1] for line in rows}
    assert variables >= {"PFLSEG_DATA", "PFLSEG_STATE_DIR", "PFLSEG_BUNDLE_ROOTS"}
    assert sorted((variables | set(KEYS)) - documented) == []
