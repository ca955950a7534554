"""The classes a package-mode pflseg job asks FLARE to build, for the sites' ``class_allow_list``.

A job without custom code (package mode) only runs classes a site allows in its ``local/resources.json``
(``class_allow_list``; FLARE's built-in list when absent). Two lists:

- narrow (``narrow_list``; what provisioned kits get by default, ``PflsegBuilder(allow_list="narrow")``): the classes
  pflseg's jobs name and nothing else: pflseg's own job classes by exact name (every method's controller, both
  site executors and the speed report's floor job, ``pflseg_classes``: no ``pflseg.`` prefix), FLARE's two that every
  job names (``FLARE_CLASSES``) and the server's optional MLflow and W&B receivers (``TRACKING_CLASSES``:
  ``tracking.receivers``);
- broad (``allow_list``; the simulator's and POC's, and kits made with ``allow_list: broad``): FLARE 2.9's default
  list (``DEFAULT_CLASS_ALLOW_LIST``: 88 classes of FLARE's own, its workflows, executors, aggregators, persistors,
  privacy filters and widgets, which FLARE's kits allow anyway) plus pflseg's classes.

pflseg's committed jobs name only ``job_classes``: pflseg's classes and ``FLARE_CLASSES``, less the Client API site
executor a job names only with ``site.executor: client_api`` and the floor job's ``FLOOR_CLASSES``. FLARE filters a
job adds (``privacy.update.filters``) must be on the site's list too: the broad list holds FLARE's own filters, the
narrow one none.
"""

from __future__ import annotations

import json
from pathlib import Path

from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

from pflseg.data.files import private_dir
from pflseg.flare.executor import ClientAPISiteExecutor, SiteExecutor
from pflseg.flare.floor import FloorClientAPIExecutor, FloorController, FloorExecutor
from pflseg.flare.methods import METHODS


def _path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: the classes of the no-work job ``pflseg report speed`` measures FLARE's per-round floor with (``pflseg.flare.floor``)
FLOOR_CLASSES = tuple(_path(c) for c in (FloorController, FloorExecutor, FloorClientAPIExecutor))


def pflseg_classes() -> list[str]:
    """Every pflseg class a job can name (controllers of all methods, the site executors of ``site.executor``, the
    floor job's ``FLOOR_CLASSES``)."""
    return sorted({_path(m.controller) for m in METHODS.values()} | {_path(SiteExecutor), _path(ClientAPISiteExecutor)}
                  | set(FLOOR_CLASSES))


#: FLARE's classes that every pflseg job names (``pflseg.flare.jobs.build_job``): the sites' event relay and the
#: server's TensorBoard receiver
FLARE_CLASSES = ("nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                 "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver")


#: FLARE's receivers a job names at the server with ``tracking.receivers`` mlflow / wandb (``pflseg.flare.jobs``)
TRACKING_CLASSES = ("nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver",
                    "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver")
#: ``PflsegBuilder``'s ``allow_list`` values: which list a kit gets
LISTS = ("narrow", "broad")


def job_classes() -> list[str]:
    """Every class a pflseg job (package mode, default privacy and site settings) asks FLARE to build (the floor job
    is no such job)."""
    return sorted(FLARE_CLASSES) + [c for c in pflseg_classes()
                                    if c != _path(ClientAPISiteExecutor) and c not in FLOOR_CLASSES]


def allow_list() -> list[str]:
    """The broad list: FLARE's default class allow list plus pflseg's classes."""
    return list(DEFAULT_CLASS_ALLOW_LIST) + [c for c in pflseg_classes() if c not in DEFAULT_CLASS_ALLOW_LIST]


def narrow_list() -> list[str]:
    """The narrow list: the classes pflseg's jobs can name (FLARE's, then pflseg's), nothing else."""
    return sorted(FLARE_CLASSES + TRACKING_CLASSES) + pflseg_classes()


def add_to_resources(path: str | Path, which: str = "broad") -> Path:
    """The ``class_allow_list`` of a resources file (created if absent), in place: ``broad``: pflseg's classes added
    to the list there (FLARE's default when it has none); ``narrow``: the list made ``narrow_list()``."""
    if which not in LISTS:
        raise ValueError(f"allow list {which!r}: expected one of {', '.join(LISTS)}")
    path = Path(path)
    resources = json.loads(path.read_text()) if path.is_file() else {"format_version": 2}
    if which == "narrow":
        resources["class_allow_list"] = narrow_list()
    else:
        current = resources.get("class_allow_list") or list(DEFAULT_CLASS_ALLOW_LIST)
        resources["class_allow_list"] = current + [c for c in pflseg_classes() if c not in current]
    private_dir(path.parent)
    path.write_text(json.dumps(resources, indent=2))
    return path
