"""The package-mode allow list: every class of the method registry, explicitly."""

import json
from pathlib import Path

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

from pflseg.flare.allowlist import add_to_resources, pflseg_classes
from pflseg.flare.methods import METHODS


def test_allow_list_names_every_job_class_explicitly(tmp_path):
    classes = pflseg_classes()
    assert "pflseg.flare.executor.SiteExecutor" in classes
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
    assert "nothing else" not in hospital.replace("allows nothing else writes that list", "")


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
