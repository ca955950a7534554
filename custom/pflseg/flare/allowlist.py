"""The classes a package-mode pflseg job asks FLARE to build, for the sites' ``class_allow_list``.

A job without custom code (package mode) only runs classes a site allows in its ``local/resources.json``
(``class_allow_list``; FLARE's built-in list when absent). What pflseg's provisioning, POC and simulator runs
write there (``allow_list``) is exactly: FLARE 2.9's default list (``DEFAULT_CLASS_ALLOW_LIST``: 88 classes of
FLARE's own, its workflows, executors, aggregators, persistors, privacy filters and widgets, which FLARE's kits
allow anyway) plus pflseg's own job classes by exact name (every method's controller and both site executors,
``pflseg_classes``: no ``pflseg.`` prefix). pflseg's jobs name only ``job_classes``: pflseg's classes and two of
FLARE's (``FLARE_CLASSES``), less the Client API site executor a job names only with ``site.executor: client_api``;
a site that allows nothing else writes that list (docs/deployment.md, "Shipping code"). FLARE filters a job adds
(``privacy.update.filters``) must be on the site's list too.
"""

from __future__ import annotations

import json
from pathlib import Path

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST


def _path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pflseg_classes() -> list[str]:
    """Every pflseg class a job can name (controllers of all methods, the site executors of ``site.executor``)."""
    from pflseg.flare.executor import ClientAPISiteExecutor, SiteExecutor
    from pflseg.flare.methods import METHODS

    return sorted({_path(m.controller) for m in METHODS.values()} | {_path(SiteExecutor), _path(ClientAPISiteExecutor)})


#: FLARE's classes that every pflseg job names (``pflseg.flare.jobs.build_job``): the sites' event relay and the
#: server's TensorBoard receiver
FLARE_CLASSES = ("nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                 "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver")


def job_classes() -> list[str]:
    """Every class a pflseg job (package mode, default privacy and site settings) asks FLARE to build."""
    from pflseg.flare.executor import ClientAPISiteExecutor

    return sorted(FLARE_CLASSES) + [c for c in pflseg_classes() if c != _path(ClientAPISiteExecutor)]


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
