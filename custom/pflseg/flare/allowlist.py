"""The classes a package-mode pflseg job asks FLARE to build, for the sites' ``class_allow_list``.

A job without custom code (package mode) only runs classes a site allows in its ``local/resources.json``
(``class_allow_list``; FLARE's built-in list when absent). pflseg adds exactly its own job classes
(every method's controller and the site executor) to FLARE's default list: explicit classes, not a
``pflseg.`` prefix, so a site allows what it has reviewed and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST


def _path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pflseg_classes() -> list[str]:
    """Every pflseg class a job can name (controllers of all methods, the site executor)."""
    from pflseg.flare.executor import SiteExecutor
    from pflseg.flare.methods import METHODS

    return sorted({_path(m.controller) for m in METHODS.values()} | {_path(SiteExecutor)})


def allow_list() -> list[str]:
    """FLARE's default class allow list plus pflseg's classes."""
    return list(DEFAULT_CLASS_ALLOW_LIST) + [c for c in pflseg_classes() if c not in DEFAULT_CLASS_ALLOW_LIST]


def add_to_resources(path: str | Path) -> Path:
    """Put pflseg's classes on the ``class_allow_list`` of a resources file (created if absent), in place."""
    path = Path(path)
    resources = json.loads(path.read_text()) if path.is_file() else {"format_version": 2}
    current = resources.get("class_allow_list") or list(DEFAULT_CLASS_ALLOW_LIST)
    resources["class_allow_list"] = current + [c for c in pflseg_classes() if c not in current]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(resources, indent=2))
    return path
