"""The package-mode allow list: every class of the method registry, explicitly."""

import json

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
