"""`pflseg site init` / `site check` (pflseg.deploy.site_setup): only in a site's startup kit, and init keeps the
settings it is not given (e.g. the threads `pflseg deploy local` wrote)."""

import json

import pytest

from pflseg.cli import main
from pflseg.data import make_synthetic
from tests.unit.flare.test_settings import site_kit


@pytest.fixture
def root(tmp_path, monkeypatch):
    for var in ("PFLSEG_DATA", "PFLSEG_DEVICE", "PFLSEG_SITE_CONFIG", "PFLSEG_STATE_DIR", "PFLSEG_THREADS"):
        monkeypatch.delenv(var, raising=False)
    return make_synthetic(tmp_path / "root", n_sites=2, cases=3, size=16, depth=2)


@pytest.mark.parametrize("startup, words", [(None, "not a FLARE site's startup kit (no startup/fed_client.json)"),
                                            ("fed_server.json", "the server's startup kit, not a site's"),
                                            ("fed_admin.json", "an admin's startup kit, not a site's")])
def test_init_and_check_refuse_a_folder_that_is_not_a_sites_kit(root, tmp_path, capsys, startup, words):
    """Before: `site init` wrote settings into any folder; `site check` reported a site named after it."""
    folder = tmp_path / "Downloads"
    (folder / "startup").mkdir(parents=True)
    if startup:
        (folder / "startup" / startup).write_text("{}")
    assert main(["site", "init", "--site-dir", str(folder), "--data", str(root)]) == 2
    assert words in capsys.readouterr().err and not (folder / "local").exists()
    assert main(["site", "check", "--site-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert words in err and "--site-dir" in err


def test_init_keeps_what_it_is_not_given_and_takes_threads(root, tmp_path, capsys):
    """Before: `site init --allow-two-sites` dropped the threads `deploy local` had written (and had no --threads)."""
    kit = site_kit(tmp_path / "site-1")
    settings = kit / "local" / "pflseg_site.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"threads": 2, "device": "cpu", "data": str(root),
                                    "policy": {"methods": ["fedavg"]}}))
    assert main(["site", "init", "--site-dir", str(kit), "--data", str(root), "--allow-two-sites"]) == 0
    out = capsys.readouterr().out
    assert json.loads(settings.read_text()) == {"threads": 2, "device": "cpu", "data": str(root.resolve()),
                                                "policy": {"methods": ["fedavg"], "two_sites": True}}
    assert "kept from the earlier settings: device=cpu, threads=2, policy.methods" in out
    assert main(["site", "init", "--site-dir", str(kit), "--data", str(root), "--threads", "3"]) == 0
    assert json.loads(settings.read_text())["threads"] == 3
    assert main(["site", "check", "--site-dir", str(kit)]) == 0
    assert "threads: 3" in capsys.readouterr().out
