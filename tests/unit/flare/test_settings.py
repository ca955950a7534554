import json

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
