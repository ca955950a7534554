"""The package-mode allow list: every class of the method registry, explicitly."""

import json
import re
from pathlib import Path

import pytest
from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

from pflseg.flare.allowlist import add_to_resources, pflseg_classes
from pflseg.flare.methods import METHODS


def test_allow_list_names_every_job_class_explicitly(tmp_path):
    classes = pflseg_classes()
    assert "pflseg.flare.executor.SiteExecutor" in classes
    assert "pflseg.flare.floor.FloorController" in classes  # the speed report's floor job runs in POC too
    assert {f"{c.__module__}.{c.__qualname__}" for c in (m.controller for m in METHODS.values())} <= set(classes)
    res = tmp_path / "resources.json.default"
    res.write_text(json.dumps({"format_version": 2, "class_allow_list": ["nvflare.x.Y"], "components": []}))
    add_to_resources(res)
    add_to_resources(res)  # idempotent
    got = json.loads(res.read_text())
    assert got["class_allow_list"] == ["nvflare.x.Y", *classes] and got["components"] == []
    fresh = json.loads(add_to_resources(tmp_path / "new" / "resources.json").read_text())["class_allow_list"]
    assert fresh[: len(DEFAULT_CLASS_ALLOW_LIST)] == list(DEFAULT_CLASS_ALLOW_LIST)


ROOT = Path(__file__).resolve().parents[3]


def test_the_deployment_page_states_exactly_what_the_allow_list_holds():
    """Before: README said a site allows "what it has reviewed and nothing else" while provisioning wrote FLARE's 88
    default classes plus pflseg's (that text is now docs/deployment.md)."""
    from pflseg.flare.allowlist import allow_list

    hospital = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    assert allow_list() == list(DEFAULT_CLASS_ALLOW_LIST) + pflseg_classes()
    assert f"FLARE 2.9's default list ({len(DEFAULT_CLASS_ALLOW_LIST)} classes of" in hospital
    assert f"plus pflseg's {len(pflseg_classes())} classes by exact name" in hospital
    from pflseg.flare.allowlist import job_classes, narrow_list  # issue 39 F13: the narrow list is now written

    assert ("get the **narrow** list by default: the classes pflseg's jobs name and nothing else" in hospital
            and f"`pflseg.flare.allowlist.narrow_list`, {len(narrow_list())} classes, of which the committed jobs "
                f"name {len(job_classes())}" in hospital)


def test_job_classes_are_exactly_the_classes_the_committed_jobs_name():
    from pflseg.flare.allowlist import job_classes

    named = set()

    def walk(node):
        if isinstance(node, dict):
            named.update(v for k, v in node.items() if k == "path" and isinstance(v, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for config in (ROOT / "jobs").glob("*/app/config/config_fed_*.json"):
        walk(json.loads(config.read_text()))
    assert named and named == set(job_classes())


def test_the_narrow_list_covers_every_class_every_generated_job_names_and_kits_write_it_by_default(tmp_path):
    """Issue 39 F13: kits wrote FLARE's 88 default classes plus pflseg's; the jobs need 17."""
    from pflseg.deploy.provision import PflsegBuilder
    from pflseg.flare.allowlist import TRACKING_CLASSES, narrow_list

    named = set()
    for config in (ROOT / "jobs").glob("*/app/config/config_fed_*.json"):
        named.update(re.findall(r'"path": "([A-Za-z0-9_.]+)"', config.read_text()))
    narrow = narrow_list()
    assert named and named <= set(narrow)
    assert set(narrow) == named | set(TRACKING_CLASSES) | set(pflseg_classes())  # nothing else
    assert not set(narrow) & (set(DEFAULT_CLASS_ALLOW_LIST) - named - set(TRACKING_CLASSES))  # no other default
    res = tmp_path / "resources.json.default"
    res.write_text(json.dumps({"format_version": 2, "class_allow_list": list(DEFAULT_CLASS_ALLOW_LIST)}))
    assert json.loads(add_to_resources(res, "narrow").read_text())["class_allow_list"] == narrow
    assert PflsegBuilder().allow_list == "narrow" and PflsegBuilder(allow_list="broad").allow_list == "broad"
    with pytest.raises(ValueError, match=r"allow_list='wide': expected one of narrow, broad"):
        PflsegBuilder(allow_list="wide")


def test_every_folder_pflseg_makes_is_made_private():
    """Issue 39 F11: every folder pflseg makes is 0700: made by ``pflseg.data.files.private_dir`` (the folder and its
    missing parents), never by a bare ``mkdir`` / ``os.makedirs`` with the umask's mode."""
    package = ROOT / "custom" / "pflseg"
    bare = []
    for path in package.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.mkdir\(|os\.makedirs\(", line) and "mode=PRIVATE_DIR" not in line:
                bare.append(f"{path.relative_to(package)}:{number}")
    allowed = {"data/files.py"}  # private_dir itself (after its 0700 loop: raises what stands in the way)
    assert [b for b in bare if b.split(":")[0] not in allowed] == []
