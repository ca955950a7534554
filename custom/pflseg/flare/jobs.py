"""Effective config -> FLARE FedJob, and export of ``jobs/<name>/`` folders.

A job is: the method's controller (carrying the whole effective config), the tracking receivers on the server
(``tracking.receivers``: TensorBoard by default, MLflow and W&B on request), and on every site the one site entry point
(``pflseg.flare.client.answer``) run by the site executor ``site.executor`` names (``site_executor``: FLARE's plain
``Executor`` ``pflseg.flare.executor.SiteExecutor`` by default, the Client API script on request) with torch tensors
end to end; with ``privacy.update.filters``, FLARE filters on the train task's answer (task_result_filters in
config_fed_client.json). Two ways to ship the code:

- ``package`` (default): sites pip-install pflseg; the job carries no code at all (no ``app/custom``), its
  site executor is ``pflseg.flare.executor.SiteExecutor`` (or ``ClientAPISiteExecutor``, which runs the installed
  launcher), and FLARE only builds the job's pflseg classes because provisioning put them on every site's
  ``class_allow_list``. No ``byoc`` right is needed.
- ``byoc``: the job carries the pflseg package and the small module ``job_client.py`` in ``app/custom`` and names
  ``job_client.SiteExecutor`` (or runs job_client.py as the Client API script); importing it puts that folder first
  on the job's import path, so the job's pflseg wins over an installed one; needs the ``byoc`` right.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
from pathlib import Path

from nvflare.apis.dxo import DataKind
from nvflare.apis.filter import Filter
from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.client.config import ExchangeFormat
from nvflare.job_config.api import FedJob
from nvflare.job_config.defs import FilterType
from nvflare.job_config.script_runner import ScriptRunner

from pflseg.config import TRACKERS, ConfigError, job_names, load_job_config
from pflseg.flare.executor import ClientAPISiteExecutor, SiteExecutor
from pflseg.flare.methods import server_controller

CLIENT_SCRIPT = Path(__file__).with_name("job_client.py")  # BYOC: job_client.SiteExecutor; as a script: client.main

#: server poll interval (seconds) the sites use to ask for tasks; FLARE's default is 2 s
TASK_REQUEST_INTERVAL = 0.2


MODES = ("package", "byoc")


def build_job(cfg: dict, mode: str = "package") -> FedJob:
    """The FLARE job of effective config ``cfg`` (from ``pflseg.config.load_job_config``) in ``mode`` (see MODES)."""
    if mode not in MODES:
        raise ValueError(f"job mode '{mode}' is unknown; use one of {', '.join(MODES)}")
    job = FedJob(name=cfg["name"], min_clients=cfg["min_clients"])
    job.to_server(server_controller(cfg), id="controller")  # its own config only: no other method's section
    for receiver_id, receiver in tracking_receivers(cfg):
        job.to_server(receiver, id=receiver_id)
    job.to_server({"server": {"task_request_interval": TASK_REQUEST_INTERVAL}})
    kind = cfg["site"]["executor"]
    if mode == "byoc" and kind == "client_api":  # relative to the script's folder, so that the job carries it as
        # app/custom/job_client.py (see in_script_dir)
        job.to_clients(ScriptRunner(script=CLIENT_SCRIPT.name, server_expected_format=ExchangeFormat.PYTORCH))
    else:
        job.to_clients(site_executor(kind, mode), tasks=["*"])
    job.to_clients(ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed."),
                   id="event_to_fed")
    for k, spec in enumerate(cfg["privacy"]["update"]["filters"]):
        job.to_clients(update_filter(spec), id=f"update_filter_{k}", filter_type=FilterType.TASK_RESULT,
                       tasks=["train"])
    job.set_app_packages(["pflseg"])
    return job


def site_executor(kind: str, mode: str):
    """The site executor of ``site.executor`` ``kind`` (``executor`` | ``client_api``) in a job of ``mode``.

    ``executor``: FLARE's plain Executor answering inside ``execute()`` (``pflseg.flare.executor``; no Client API
    result poll: FLARE's per-round floor is lower); in a BYOC job the same class named through the job's
    ``job_client.py`` (``byoc_module``). ``client_api``: FLARE's in-process Client API executor running the launcher.
    """
    if kind == "client_api":
        return ClientAPISiteExecutor()
    return SiteExecutor() if mode == "package" else byoc_module().SiteExecutor()


def byoc_module():
    """``pflseg/flare/job_client.py`` as the top-level module ``job_client`` that it is in a BYOC job's app/custom:
    FLARE's export names ``job_client.SiteExecutor`` after its module and copies the file into the job."""
    module = sys.modules.get("job_client")
    if module is None or Path(module.__file__ or "").resolve() != CLIENT_SCRIPT.resolve():
        spec = importlib.util.spec_from_file_location("job_client", CLIENT_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["job_client"] = module
        spec.loader.exec_module(module)
    return module


#: FLARE's config fills these in when it builds the server's job (``nvflare.apis.fl_constant.SystemVarName``): the
#: server's job folder, where TensorBoard's tb_events/ also lies
MLFLOW_FILE_STORE = "file://{WORKSPACE}/{JOB_ID}/mlruns"
#: W&B's local folder by default: the server's job folder (W&B writes its offline runs into ``wandb/`` there)
WANDB_DIR = "{WORKSPACE}/{JOB_ID}"


def tracking_receivers(cfg: dict) -> list[tuple[str, object]]:
    """``(component id, FLARE receiver)`` of each name in ``tracking.receivers``, on the server.

    The sites' metrics reach the server as ``fed.analytix_log_stats`` events (ConvertToFedEvent at every site);
    TensorBoard also takes the server's own scalars (``analytix_log_stats``), MLflow and W&B only the sites' (each
    keeps one run per site, under the same metric names). MLflow writes to ``tracking.mlflow_uri``, by default a file
    store in the server's job folder; W&B runs in ``tracking.wandb_mode`` (offline by default: no network) and writes
    under ``tracking.wandb_dir``, by default the server's job folder.

    Raises:
        ConfigError: a receiver whose package (mlflow, wandb) is not installed here, naming the pip command.
    """
    out: list[tuple[str, object]] = []
    for name in cfg["tracking"]["receivers"]:
        if name == "tensorboard":  # the id "receiver" keeps the jobs exported before MLflow came unchanged
            out.append(("receiver", TBAnalyticsReceiver(events=["fed.analytix_log_stats", "analytix_log_stats"])))
        elif name == "mlflow":
            MLflowReceiver = _receiver_class(name, "nvflare.app_opt.tracking.mlflow.mlflow_receiver", "MLflowReceiver")
            experiment = cfg["tracking"]["experiment"] or cfg["name"]
            tags = {"method": cfg["method"], "job": cfg["name"]}
            kw_args = {"experiment_name": experiment, "run_name": cfg["name"], "experiment_tags": tags,
                       "run_tags": tags}
            uri = cfg["tracking"]["mlflow_uri"] or MLFLOW_FILE_STORE
            out.append(("mlflow_receiver", MLflowReceiver(tracking_uri=uri, kw_args=kw_args,
                                                          events=["fed.analytix_log_stats"])))
        elif name == "wandb":
            WandBReceiver = _receiver_class(name, "nvflare.app_opt.tracking.wandb.wandb_receiver", "WandBReceiver")
            tracking = cfg["tracking"]
            # FLARE's receiver names each site's run "<site>-<job id>-<name>" in the group "<name>-<job id>"
            wandb_args = {"project": tracking["experiment"] or cfg["name"], "name": cfg["name"],
                          "group": cfg["name"], "job_type": cfg["method"], "dir": tracking["wandb_dir"] or WANDB_DIR,
                          "tags": [cfg["method"], cfg["name"]], "config": {"method": cfg["method"], "job": cfg["name"]}}
            with _env_kept("WANDB_MODE"):  # the receiver sets it where it is made: at the server, not here
                receiver = WandBReceiver(wandb_args=wandb_args, mode=tracking["wandb_mode"],
                                         events=["fed.analytix_log_stats"])
            out.append(("wandb_receiver", receiver))
        else:
            raise ConfigError(f"tracking.receivers: unknown receiver {name!r}")
    return out


@contextlib.contextmanager
def _env_kept(name: str):
    """Environment variable ``name`` as it was before the block."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _receiver_class(name: str, module: str, cls: str) -> type:
    """FLARE's receiver class for ``tracking.receivers`` entry ``name``; ConfigError naming the pip command when the
    package it needs is missing here (``load_job_config`` says so first; a config from elsewhere reaches this)."""
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise ConfigError(f"tracking.receivers lists {name}, but {exc.name or name} is not installed where the job is "
                          f"built: {TRACKERS[name][1]}, or take {name} out of tracking.receivers") from exc


def update_filter(spec: dict):
    """The FLARE filter of a ``privacy.update.filters`` entry ``{filter, args}`` (on the train task's answer at every
    site, after pflseg's own update path: with ``privacy.update.send: diff`` it sees weight differences)."""
    module, _, name = spec["filter"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"privacy.update.filters: cannot import {spec['filter']!r} ({exc}); name a FLARE filter "
                          "class, "
                          "e.g. nvflare.app_common.filters.PercentilePrivacy") from exc
    if not (isinstance(cls, type) and issubclass(cls, Filter)):
        raise ConfigError(f"privacy.update.filters: {spec['filter']!r} is not a FLARE Filter "
                          "(nvflare.apis.filter.Filter)")
    args = dict(spec.get("args") or {})
    if "data_kinds" in inspect.signature(cls).parameters and "data_kinds" not in args:
        args["data_kinds"] = [DataKind.WEIGHT_DIFF]  # never applied to full weights
    try:
        obj = cls(**args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"privacy.update.filters: {spec['filter']}({spec.get('args')}) fails: {exc}") from exc
    for name, value in args.items():  # FLARE's export writes the attribute of each argument's name: put back what was
        setattr(obj, name, value)     # given (ExcludeVars keeps a compiled regex there); this object is only exported
    return obj


def export_job(name: str, out_dir: str | Path, overrides: dict | None = None, mode: str = "package",
               gpu_mem_gib: float | None = None, sites: list[str] | None = None, job_name: str | None = None) -> Path:
    """Write ``<out_dir>/<job_name or name>/`` (meta.json, app/config/*.json; in byoc mode also app/custom/).

    Args:
        mode: ``package`` (no code in the job) or ``byoc`` (pflseg + launcher in app/custom).
        gpu_mem_gib: ask every site for one GPU with at least this much free memory (meta.json resource_spec);
            None = no GPU requirement (sites use CUDA when they have it, CPU otherwise).
        sites: site names for a per-site resource_spec (needed to state GPU memory); without them the
            requirement is ``{"@default": {"num_of_gpus": 1}}`` (any GPU size).
        job_name: folder and FLARE job name (default: the config name).
    """
    out_dir = Path(out_dir).resolve()
    cfg = load_job_config(name, overrides=overrides)
    if job_name:
        cfg["name"] = job_name
    target = out_dir / cfg["name"]
    if target.exists():
        shutil.rmtree(target)
    with in_script_dir():
        build_job(cfg, mode).export_job(str(out_dir))
    if mode == "byoc":
        shutil.copytree(Path(__file__).resolve().parents[1], target / "app" / "custom" / "pflseg",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if gpu_mem_gib is not None:
        meta_path = target / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["resource_spec"] = gpu_resource_spec(gpu_mem_gib, sites)
        meta_path.write_text(json.dumps(meta, indent=4))
    return target


def gpu_resource_spec(mem_gib: float, sites: list[str] | None = None) -> dict:
    """meta.json ``resource_spec``: one GPU per site with at least ``mem_gib`` GiB.

    FLARE's GPUResourceManager compares this with the ``mem_per_gpu_in_GiB`` a site declares (its project.yml
    ``capacity``); a nominal "16 GB" card has about 14.6-15.9 GiB usable, so ask for what the job needs
    (measure it), never for a card's nominal size. ``@default`` can only carry the GPU count.
    """
    if mem_gib <= 0:
        raise ValueError(f"GPU memory {mem_gib} GiB: give a positive number of GiB (what one site's training needs)")
    if not sites:
        return {"@default": {"num_of_gpus": 1}}
    return {site: {"num_of_gpus": 1, "mem_per_gpu_in_GiB": mem_gib} for site in sites}


def in_script_dir():
    """FLARE resolves the client script relative to the working directory when it builds or exports."""
    return contextlib.chdir(CLIENT_SCRIPT.parent)


def export_all(out_dir: str | Path) -> list[Path]:
    return [export_job(name, out_dir) for name in job_names()]
