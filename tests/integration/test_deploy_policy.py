"""Issue 39's loopback lines on a provisioned 3-site federation (narrow class allow lists, the kits' default): a site
whose policy requires DP refuses a job without it; a job pointing tracking at a remote URI is refused by a deployed
site's default; a refused job leaves only 0700 folders at the site. The policy is the site's own file
(``local/pflseg_site.json``), read anew before every task, so each test sets it while the federation runs."""

import json

import pytest

from pflseg.deploy.submit import submit
from pflseg.flare.state import write_text
from tests.integration.federation import federation, job

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.xdist_group("deploy_policy"),
              pytest.mark.in_file_order]


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    yield from federation(tmp_path_factory)


def set_policy(fed, site, **policy):
    path = fed.kit(site) / "local" / "pflseg_site.json"
    settings = json.loads(path.read_text())
    settings["policy"] = {"two_sites": True, **policy}
    write_text(path, json.dumps(settings))


def test_the_kits_allow_the_narrow_list(fed):
    from pflseg.flare.allowlist import narrow_list

    for name in ("site-1", "localhost"):
        resources = json.loads((fed.kit(name) / "local" / "resources.json.default").read_text())
        assert resources["class_allow_list"] == narrow_list()


def test_dp_required_and_remote_tracking_refused_at_deployed_sites_leaving_only_private_folders(fed, tmp_path):
    """One job (the cheapest run that shows both lines, and F12's record of who trained): site-1 requires DP,
    site-2 keeps the deployment default (remote_tracking null: refused), site-3 allows remote tracking and trains
    alone (min_clients 1). The job asks MLflow at another host; the server's MLflow receiver is not built here (the
    sites judge the config the server sends them)."""
    set_policy(fed, "site-1", require_dp=True)
    set_policy(fed, "site-3", remote_tracking=True)
    folder = job(tmp_path, "fedavg", rounds=1, min_clients=1)
    path = folder / "app" / "config" / "config_fed_server.json"
    server = json.loads(path.read_text())
    tracking = server["workflows"][0]["args"]["config"]["tracking"]
    tracking.update(receivers=["tensorboard", "mlflow"], mlflow_uri="https://mlflow.example.org")
    path.write_text(json.dumps(server))
    try:
        res = submit(folder, fed.admin_kit(), out=tmp_path / "dl", progress=lambda m: None, poll=0.5)
    finally:
        for site in ("site-1", "site-3"):
            set_policy(fed, site)
    assert res["status"] == "FINISHED:COMPLETED" and sorted(res["test"]) == ["site-3"], res["missing"]
    assert "policy.require_dp: true" in res["missing"]["site-1"], res["missing"]
    assert "policy.remote_tracking: null (false in a deployment)" in res["missing"]["site-2"], res["missing"]
    origins = [json.loads(f.read_text()) for f in (fed.kit("site-3") / "pflseg_state").glob("*/origin.json")]
    assert [o["submitter"] for o in origins] == [fed.admin], origins  # F12: who trained it, from FLARE's job meta
    for site in ("site-1", "site-2"):  # refused: nothing made but the state root of the site-local error log
        root = fed.kit(site) / "pflseg_state"
        modes = {str(p): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")] if p.is_dir()}
        assert set(modes.values()) == {"0o700"}, modes
