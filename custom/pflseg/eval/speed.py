"""Where a federated round's time goes, measured side by side in one run.

    pflseg report speed --methods fedavg grace --sites 3 --rounds 4 --size 64 --envs sim poc
    pflseg report speed --scaling --scaling-sites 3 6 12 24 --scaling-sizes 64 128 256

Per method (a job name of ``app_configs/``), on one synthetic data root (``<workspace>/data/``), one job config and
the same torch threads per site (``PFLSEG_THREADS``, else this machine's cores / sites, as the simulator and POC give
their sites):

(a) **plain loop**: a site's round of work without FLARE or pflseg's site plumbing (no state files, no replies, no
    privacy, no best-model tracking): the job's net (``pflseg.nets.build_net``), loss, data (``site_dataset`` of the
    same root, size, batch size and shuffling seed), Adam kept across rounds, validation Dice before and after (the
    one evaluation, ``pflseg.train.evaluate``), ``train.epochs`` epochs of the one training loop (``train_epochs``)
    with the method's own plug-in (its site class's ``round_hooks``: GRACE's meta step, FedProx's proximal term;
    called on a stand-in holding only the config and the device). Every site in a process of its own, all at once,
    each round started together (a barrier, as the server's round starts them), each round timed. A method whose
    site replaces the round skeleton's ``step`` (FedSM, IOP-FL, LC-Fed) or pools other sites' data has no plain
    equivalent here: its plain column is ``-``.
(b) **site compute**: what each site reports per task (``compute_seconds``, ``pflseg.flare.client.answer``), kept per
    round by the server in results.json (``history[r].site_compute_seconds``).
(c) **round wall**: the server's ``history[r].wall_seconds``: from the round's first send to the new global model
    (its checkpoint write and FLARE's round metrics file come after it and are not in it).
(d) **FLARE's floor**, measured in the same run: just before each job, in the same environment (the same POC
    federation), a FLARE job of no work (``pflseg.flare.floor``) with the job's site executor kind (read from the built
    job's ``config_fed_client.json``), sites and rounds, sending every site a model of as many float32 values as the
    job's net has parameters and getting it back unchanged; its controller waits for FLARE's task check (pflseg's go
    on the moment the last site has answered, so a fixed cost may lie below its floor). A kind the floor job lacks
    (the Client API in another process) has no floor. Its history: ``speed.json``'s ``runs[env][job]["floor"]``.

Rounds measured: 1 .. R-1 (round 0 also loads and caches each site's data; with one round only, round 0); the floor
job's likewise. Reported: site compute / plain loop, and the **fixed cost per round** = round wall - the round's
slowest site compute (median over the measured rounds) beside the floor (the median of the floor job's round walls)
and their difference. ``sim``: ``nvflare simulator`` (``pflseg.deploy.simulator.run_simulator``), with the host memory
(PSS) of its processes sampled (``pflseg.deploy.sampling``, every 0.5 s: per site process and in all); ``poc``: one
loopback POC federation (``pflseg.deploy.poc.PocFederation``) that runs every method's floor job and job in turn
through the FLARE API.

Server aggregation: each method's controller ``aggregate`` step (the very method its ``round`` calls, on a
controller made outside FLARE with ``init_state``) over K Gaussian updates of the job's net (a UNet of about 8 M
parameters, ``pflseg.flare.controllers.grace_benchmark.NET``, for UNet jobs), against a plain torch weighted average
of the same tensors; minimum over interleaved repeats. FedSM's SoftPull and selector fit come after ``aggregate`` in
its round and are not in it.

``--scaling``: wall per round and peak host memory (per site process, the largest; and the whole simulator) in the
simulator against the number of sites and the image size, and IOP-FL test-time routing's time per image and peak
memory against the number of experts (``pflseg.eval.iopfl_cost.measure``, each in a fresh process), as a Markdown
table and a PNG plot. Everything lands in the workspace: ``speed.json``, ``speed.md``, ``speed_scaling.png``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pflseg.deploy.sampling import GIB, MemorySampler, best_seconds, named
from pflseg.markdown import markdown_table
from pflseg.markdown import number_cell as _num

ENVS = ("sim", "poc")
EXECUTOR_KINDS = ("executor", "client_api")
RESULTS_JSON, MARKDOWN, SCALING_PNG = "speed.json", "speed.md", "speed_scaling.png"
#: ``run``'s defaults (its jobs: ``default_jobs``); scaling: the experts are K + 1 for the K of the sites sweep
DEFAULTS: dict[str, Any] = {"sites": 3, "rounds": 4, "size": 64, "envs": ENVS,
                            "agg_sites": 6, "repeats": 3, "scaling_sites": (3, 6, 12, 24),
                            "scaling_sizes": (64, 128, 256), "scaling_experts": (4, 7, 13, 25)}


def default_jobs() -> dict[str, Any]:
    """``run``'s jobs when none is named, from the registry: ``methods``, its reference job then the methods whose
    ``Method.reports`` name the speed report (FedAvg, GRACE); ``scaling_method``, the reference job."""
    from pflseg.flare.methods import REFERENCE_JOB, report_jobs

    return {"methods": (REFERENCE_JOB, *report_jobs("speed")), "scaling_method": REFERENCE_JOB}


# ---- the arithmetic (pure) ------------------------------------------------------------------------------------------
def measured(history: list[dict], skip: int | None = None) -> list[dict]:
    """The history entries measured: all but the first ``skip`` rounds (default: the first, when there are several;
    it loads the data)."""
    if skip is None:
        skip = 1 if len(history) > 1 else 0
    return list(history[skip:])


def round_costs(history: list[dict], skip: int | None = None) -> dict:
    """Per measured round (``measured``): the server's wall, the slowest site's compute and the fixed cost (wall -
    slowest compute), each site's compute; and their summaries: medians over the rounds (``wall_s``, ``slowest_s``,
    ``fixed_s``), ``compute_s`` = the mean over sites of each site's median compute.

    Args:
        history: results.json's ``history``: ``{"round", "wall_seconds", "site_compute_seconds": {site: s}}``.
    """
    rows = measured(history, skip)
    if not rows:
        raise ValueError("history: no round to measure (the run completed none)")
    wall = [float(h["wall_seconds"]) for h in rows]
    slowest = [max(h["site_compute_seconds"].values(), default=0.0) for h in rows]
    compute: dict[str, list[float]] = {}
    for h in rows:
        for site, seconds in h["site_compute_seconds"].items():
            compute.setdefault(site, []).append(float(seconds))
    return {"rounds": [h["round"] for h in rows], "wall": wall, "slowest": slowest,
            "fixed": [w - s for w, s in zip(wall, slowest)], "compute": compute,
            "wall_s": statistics.median(wall), "slowest_s": statistics.median(slowest),
            "fixed_s": statistics.median([w - s for w, s in zip(wall, slowest)]),
            "compute_s": statistics.mean(statistics.median(v) for v in compute.values()) if compute else 0.0}


def plain_seconds(plain: dict[str, list[float]], rounds: list[int]) -> float | None:
    """The plain loop's seconds per round over the same ``rounds`` (numbered from 1, as results.json's history): the
    mean over sites of each site's median (a site's list holds round r at r - 1); None without plain times."""
    per_site = [statistics.median(times[r - 1] for r in rounds if 0 < r <= len(times)) for times in plain.values()
                if any(0 < r <= len(times) for r in rounds)]
    return statistics.mean(per_site) if per_site else None


def floor_seconds(history: list[dict] | None) -> float | None:
    """FLARE's per-round floor from the floor job's results.json ``history``: the median wall of its measured rounds
    (``measured``, as a job's); None without a history."""
    return round_costs(history)["wall_s"] if history else None


def compare(costs: dict, plain: dict[str, list[float]] | None, floor: float | None = None) -> dict:
    """One row of the report: ``round_costs`` beside the plain loop (``plain``: site -> seconds per round, or None)
    and FLARE's floor measured in the same run (``floor``: ``floor_seconds`` of the floor job run beside the job;
    None where none was).

    Returns:
        ``plain_s``, ``compute_s``, ``ratio`` (site compute / plain loop), ``wall_s``, ``slowest_s``, ``fixed_s``,
        ``floor_s`` and ``above_floor_s`` (fixed - floor); None where a part is missing.
    """
    base = plain_seconds(plain, costs["rounds"]) if plain else None
    return {"plain_s": base, "compute_s": costs["compute_s"],
            "ratio": costs["compute_s"] / base if base else None, "wall_s": costs["wall_s"],
            "slowest_s": costs["slowest_s"], "fixed_s": costs["fixed_s"], "floor_s": floor,
            "above_floor_s": costs["fixed_s"] - floor if floor is not None else None}


# ---- the job's site executor kind -----------------------------------------------------------------------------------
def executor_kind(job_dir: str | Path) -> str:
    """The kind of site executor a built job runs its ``train`` task with (``config_fed_client.json``):

    - ``client_api``: FLARE's Client API in-process (``ClientAPIExecutor`` with ``execution_mode: in_process``, a
      subclass of it that sets that mode, e.g. ``pflseg.flare.executor.ClientAPISiteExecutor``, or the older
      ``InProcessClientAPIExecutor``);
    - ``client_api_external``: the Client API in another process (``external_process``, ``attach``; no floor
      measured for it);
    - ``executor``: a plain FLARE ``Executor`` subclass answering inside ``execute()``
      (``pflseg.flare.executor.SiteExecutor``);
    - ``unknown``: no executor for ``train``, or a class that cannot be imported (``job_client.X`` of a BYOC job is
      looked up as ``pflseg.flare.job_client.X``, the file the job carries).
    """
    path = Path(job_dir) / "app" / "config" / "config_fed_client.json"
    entries = json.loads(path.read_text()).get("executors", [])
    entry = next((e for e in entries if "train" in e.get("tasks", [])), None) or next(
        (e for e in entries if "*" in e.get("tasks", [])), None)
    if entry is None:
        return "unknown"
    spec = entry.get("executor", {})
    cls = _import_class(spec.get("path", ""))
    if cls is None:
        return "unknown"
    from nvflare.apis.executor import Executor
    from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor

    if issubclass(cls, ClientAPIExecutor):
        mode = (spec.get("args") or {}).get("execution_mode") or _execution_mode(cls, spec.get("args") or {})
        return "client_api" if mode == "in_process" else "client_api_external"
    if cls.__name__ == "InProcessClientAPIExecutor":
        return "client_api"
    if "Launcher" in cls.__name__:
        return "client_api_external"
    return "executor" if issubclass(cls, Executor) else "unknown"


def _import_class(path: str):
    module, _, name = path.rpartition(".")
    candidates = [module] + ([f"pflseg.flare.{module}"] if module and "." not in module else [])
    for mod in candidates:
        try:
            found = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    return None


def _execution_mode(cls, args: dict) -> str | None:
    """The execution mode a ClientAPIExecutor subclass sets itself (made as FLARE makes it, from the job's args)."""
    try:
        return getattr(cls(**args), "_execution_mode", None)
    except Exception:  # noqa: BLE001 - a class that cannot be made here: its mode is unknown
        return None


# ---- (a) the plain loop ---------------------------------------------------------------------------------------------
def plain_equivalent(site_cls) -> str | None:
    """Why a method's site class has no plain loop here (None: it has one): its round is its own ``step``, or it
    pools other sites' data."""
    from pflseg.flare.sites.base import Site

    if site_cls.step is not Site.step:
        return f"its site's round is its own step ({site_cls.__module__}.{site_cls.__qualname__}.step)"
    if site_cls.pools():
        return "its site pools other sites' data"
    return None


def plain_rounds(root: str | Path, sites: list[str], cfg: dict, rounds: int, threads: int,
                 timeout: float = 3600.0) -> dict[str, list[float]]:
    """Seconds of each round of the plain loop at every site (site -> [round 0, round 1, ...]); all sites at once,
    one process each (spawned), every round started together."""
    from pflseg.flare.methods import method
    from pflseg.nets import fit_to_sites

    site_cls = method(cfg).site
    cfg = json.loads(json.dumps(cfg))
    fit_to_sites(cfg["net"], sites)  # as the server sizes it (the LC-Fed net's site embeddings: FT, LC-Fed)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(max_workers=len(sites), mp_context=ctx) as pool:
        barrier = manager.Barrier(len(sites), timeout=timeout)
        futures = {s: pool.submit(_plain_site, str(root), s, cfg, site_cls, rounds, threads, barrier) for s in sites}
        return {s: f.result() for s, f in futures.items()}


def _plain_site(root: str, site: str, cfg: dict, site_cls, rounds: int, threads: int, barrier) -> list[float]:
    try:
        return _plain_loop(root, site, cfg, site_cls, rounds, threads, barrier)
    except BaseException:
        barrier.abort()  # the other sites stop waiting for this one
        raise


def _plain_loop(root: str, site: str, cfg: dict, site_cls, rounds: int, threads: int, barrier) -> list[float]:
    """The plain side of the comparison: the site's round outside FLARE, with the package's one training loop
    (``train_epochs``, the site's data order, optimizer and hooks) and one evaluation (``evaluate``) and nothing
    else: no messages, no state on disk, no privacy path. compute / plain is then what the site's FLARE side adds."""
    import torch

    from pflseg.data import site_dataset
    from pflseg.nets import build_net
    from pflseg.train import (
        build_loss,
        build_optimizer,
        derive_seed,
        evaluate,
        make_loader,
        pick_device,
        seed_everything,
        train_epochs,
    )

    torch.set_num_threads(threads)
    device = pick_device("auto")
    tc, size = cfg["train"], cfg["data"]["size"]
    train = site_dataset(root, site, "training", size=size, foreground_only=cfg["data"]["foreground_only"])
    val = site_dataset(root, site, "validation", size=size)
    model = build_net(cfg["net"]).to(device)
    loss_fn = build_loss(tc["loss"])
    stand_in = types.SimpleNamespace(cfg=cfg, device=device, name=site, sites=[site], inner={})
    forward = {"amp": tc["amp"], "channels_last": tc["channels_last"]}

    optimizer, times = None, []
    for r in range(rounds):
        barrier.wait()
        seed = derive_seed(cfg["seed"], site, r)
        seed_everything(seed)
        t0 = time.perf_counter()
        evaluate(model, val, device, tc["eval_batch_size"], **forward)
        hooks, extra = site_cls.round_hooks(stand_in, model, {})
        if optimizer is None or extra is not None or not tc["keep_optimizer_state"]:
            optimizer = build_optimizer(model, device, tc["lr"],
                                        extra=None if extra is None else list(extra.to(device).parameters()))
        train_epochs(model, make_loader(train, tc["batch_size"], shuffle=True, seed=seed), optimizer, loss_fn,
                     tc["epochs"], device, hooks, **forward)
        evaluate(model, val, device, tc["eval_batch_size"], **forward)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


# ---- (b), (c): FLARE runs -------------------------------------------------------------------------------------------
def threads_per_site(n_sites: int) -> int:
    """The torch threads a site gets in the simulator and in POC: ``PFLSEG_THREADS``, else cores / sites."""
    return int(os.environ.get("PFLSEG_THREADS") or max(1, (os.cpu_count() or 1) // n_sites))


def data_root(workspace: Path, n_sites: int, size: int) -> Path:
    """A synthetic data root with at least ``n_sites`` inside sites (site-1 .. site-N; one more, the outside one, is
    never used), made once per (sites, size) under ``<workspace>/data``."""
    from pflseg.data import make_synthetic

    root = workspace / "data" / f"sites{n_sites}_size{size}"
    if not (root / "dataset.json").is_file():
        make_synthetic(root, n_sites=n_sites + 1, size=size, seed=0)
    return root


def job_overrides(n_sites: int, rounds: int, size: int, sets: dict | None = None, executor: str | None = None) -> dict:
    """The config overrides of every job of the report: ``sets`` (``--set``), then rounds, every site in every round
    (min_clients), the image size and the site executor kind (when given)."""
    out = _merge({}, sets or {})
    out.update(rounds=rounds, min_clients=n_sites)
    out.setdefault("data", {})["size"] = size
    if executor:
        out.setdefault("site", {})["executor"] = executor
    return out


def _merge(base: dict, more: dict) -> dict:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = json.loads(json.dumps(value))
    return base


def _history(results: dict) -> list[dict]:
    return [{"round": h["round"], "wall_seconds": h["wall_seconds"], "site_compute_seconds": h["site_compute_seconds"]}
            for h in results.get("history", [])]


def floor_setting(job_dir: Path, kind: str, n_sites: int) -> dict | None:
    """The floor job's settings (``pflseg.flare.floor.export_floor_job``'s keywords) for exported job ``job_dir`` run
    with ``n_sites`` sites: its site executor ``kind``, sites, rounds and its net's parameter count (sized to the sites,
    as the server sizes it); None for a kind the floor job lacks."""
    from pflseg.deploy.workspace import job_config
    from pflseg.flare.floor import KINDS
    from pflseg.nets import build_net, fit_to_sites

    if kind not in KINDS:
        return None
    cfg = job_config(job_dir)
    net = json.loads(json.dumps(cfg["net"]))
    fit_to_sites(net, [f"site-{i + 1}" for i in range(n_sites)])
    return {"kind": kind, "sites": n_sites, "rounds": int(cfg["rounds"]),
            "parameters": sum(p.numel() for p in build_net(net).parameters())}


def _floor_job(job: str) -> str:
    return f"{job}_floor"


def run_floor_sim(workspace: Path, job: str, setting: dict, progress=print) -> dict:
    """The floor job of ``setting`` (``floor_setting``) in FLARE's simulator (workspace
    ``<workspace>/sim/<job>/floor``). Returns ``{"history", **setting}``."""
    from pflseg.deploy.simulator import run_simulator
    from pflseg.flare.floor import export_floor_job

    ws = workspace / "sim" / job / "floor"
    progress(f"[sim] {job}: FLARE's floor ({setting['kind']}, {setting['parameters']} parameters)")
    job_dir = export_floor_job(ws / "job", _floor_job(job), **setting)
    results = run_simulator(job_dir, ws, n_sites=setting["sites"], progress=progress)
    return {"history": _history(results), **setting}


def _floor_or_error(run_floor: Callable[..., dict], *args) -> dict:
    try:
        return run_floor(*args)
    except Exception as exc:  # noqa: BLE001 - named in the report; the job itself still runs
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_sim(workspace: Path, job: str, n_sites: int, root: Path, overrides: dict, progress=print,
            floor: bool = False) -> dict:
    """Job ``job`` in FLARE's simulator (workspace ``<workspace>/sim/<job>``), its processes' memory sampled; with
    ``floor``, FLARE's floor job for it just before (``run_floor_sim``). Returns ``{"history", "executor",
    "footprint", "memory"}``, with ``floor``: ``"floor"`` (``run_floor_sim``'s, ``{"error"}`` or None: no floor job
    for the kind)."""
    from pflseg.deploy.simulator import run_simulator
    from pflseg.flare.jobs import export_job

    ws = workspace / "sim" / job
    job_dir = export_job(job, ws / "job", overrides=overrides)
    kind = executor_kind(job_dir)
    out: dict[str, Any] = {}
    if floor:
        setting = floor_setting(job_dir, kind, n_sites)
        out["floor"] = setting and _floor_or_error(run_floor_sim, workspace, job, setting, progress)
    with MemorySampler(named(ws.resolve() / "sim")) as sampler:
        results = run_simulator(job_dir, ws, n_sites=n_sites, data=root, progress=progress)
    return {"history": _history(results), "executor": kind, "footprint": results.get("footprint"),
            "memory": sampler.peak(), **out}


def run_poc(workspace: Path, jobs: dict[str, dict], n_sites: int, root: Path, progress=print,
            floor: bool = False) -> dict:
    """Every job of ``jobs`` (job -> overrides) in one loopback POC federation (``<workspace>/poc``), one after the
    other through the FLARE API; with ``floor``, each job's floor job (``floor_setting``) just before it. Returns
    job -> ``{"history", "executor", "wall_seconds"}`` (with ``floor``: ``"floor"``, as ``run_sim``'s) or
    ``{"error"}``."""
    from pflseg.deploy.poc import PocFederation
    from pflseg.deploy.submit import submit
    from pflseg.flare.floor import export_floor_job
    from pflseg.flare.jobs import export_job

    def run_floor(job: str, setting: dict) -> dict:
        progress(f"[poc] {job}: FLARE's floor ({setting['kind']}, {setting['parameters']} parameters)")
        floor_dir = export_floor_job(fed.workspace / "jobs", _floor_job(job), **setting)
        results = submit(floor_dir, fed.admin_kit(), out=fed.workspace / "results" / floor_dir.name,
                         progress=progress)
        return {"history": _history(results), **setting}

    fed = PocFederation(workspace / "poc", n_sites=n_sites, progress=progress)
    fed.provision({"data": str(root)})
    out: dict[str, dict] = {}
    try:
        fed.start()
        fed.wait_connected()
        for job, overrides in jobs.items():
            job_dir = export_job(job, fed.workspace / "jobs", overrides=overrides)
            kind = executor_kind(job_dir)
            setting = floor_setting(job_dir, kind, n_sites) if floor else None
            floor_run = setting and _floor_or_error(run_floor, job, setting)
            t0 = time.time()
            try:
                results = submit(job_dir, fed.admin_kit(), out=fed.workspace / "results" / job, progress=progress)
            except Exception as exc:  # noqa: BLE001 - one job's failure is reported; the others still run
                out[job] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            out[job] = {"history": _history(results), "executor": kind, "wall_seconds": time.time() - t0,
                        "status": results.get("status"), **({"floor": floor_run} if floor else {})}
    finally:
        fed.stop()
    return out


# ---- server aggregation ---------------------------------------------------------------------------------------------
def plain_weighted_average(states: Sequence[dict], weights: Sequence[float]) -> dict:
    """sum_k p_k w_k key by key, in float32, p_k = n_k / sum n: the plain torch reference of an aggregation step."""
    total = float(sum(weights))
    p = [float(w) / total for w in weights]
    return {k: sum(pk * s[k].float() for pk, s in zip(p, states)) for k in states[0]}


def bound_checks(sent: dict, states: Sequence[dict]) -> None:
    """What the server's guard does to a round's answers before any method weighs them (``pflseg.flare.guard.screen``
    with the default ``robust`` settings): the update norms (whole and per tensor, for the norm bound) once, then the
    clip at 3 x the other sites' median, from those norms."""
    from pflseg.algorithms.robust import clip_updates, update_norms

    sites = [str(i) for i in range(len(states))]
    _, per_key = update_norms(dict(zip(sites, states)), dict.fromkeys(sites, sent))
    clip_updates(sent, states, 3.0, list(sent), [{k: n[s] for k, n in per_key.items()} for s in sites])


def aggregation_times(jobs: Sequence[str], n_sites: int = 6, repeats: int = 3, net: dict | None = None) -> list[dict]:
    """Each job's server aggregation step (its controller's ``aggregate``) over ``n_sites`` Gaussian updates of its
    net (UNet jobs: ``net``, default ``grace_benchmark.NET``, ~8 M parameters) against ``plain_weighted_average`` of
    the same tensors and beside the guard's bound checks of those updates (``bound_checks``: ``checks_s``,
    ``checks_ratio``), every step and average timed interleaved in one loop (jobs on the same net share the updates),
    so the steps compare with each other too (``vs_first``: the step / the step of the first job that has one,
    named in ``first``; ``--methods fedavg grace`` gives GRACE's against FedAvg's). The step is that of round
    ``robust.median_rounds`` (``round``), the rule of every later round: the rounds before it aggregate by the
    coordinate-wise median (``pflseg.flare.guard.robust_args``), ~20x a plain average at 8 M parameters, once per
    job. A controller without an ``aggregate`` step gets a row with a ``note``."""
    import torch
    from nvflare.app_common.abstract.fl_model import FLMetaKey, FLModel

    from pflseg.config import load_job_config
    from pflseg.flare.controllers.grace_benchmark import NET
    from pflseg.flare.methods import method
    from pflseg.flare.state import RoundStore
    from pflseg.flare.wire import GLOBAL, prefixed
    from pflseg.nets import build_net

    rows: list[dict[str, Any]] = []
    sites = [f"site-{i + 1}" for i in range(n_sites)]
    weights = [10.0 * (i + 1) for i in range(n_sites)]
    updates: dict[str, tuple] = {}  # net config -> (global state, site states, FLARE results)
    fns: dict[str, Callable[[], object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs:
            cfg = load_job_config(job)
            if cfg["net"]["name"] == "unet":
                cfg = load_job_config(job, overrides={"net": dict(net or NET)})
            ctrl_cls = method(cfg).controller
            if not callable(getattr(ctrl_cls, "aggregate", None)):
                rows.append({"job": job, "step": None, "note": f"{ctrl_cls.__name__} aggregates nothing"})
                continue
            ctrl = ctrl_cls(config=cfg)
            for name in ("info", "warning", "error", "log_scalars"):  # FLARE's logging needs a running job
                setattr(ctrl, name, lambda *a, **k: None)
            torch.manual_seed(0)
            ctrl.init_state(cfg, sites, RoundStore(Path(tmp) / job))
            key = json.dumps(ctrl.cfg["net"], sort_keys=True)
            if key not in updates:
                g = ctrl.state.global_state
                states = [{k: (v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v.clone())
                           for k, v in g.items()} for _ in sites]
                results = {s: FLModel(params=prefixed(GLOBAL, st), metrics={},
                                      meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: w})
                           for s, st, w in zip(sites, states, weights)}
                updates[key] = (g, states, results)
                fns[f"plain {key}"] = lambda states=states: plain_weighted_average(states, weights)
                fns[f"checks {key}"] = lambda g=g, states=states: bound_checks(g, states)
            g, _, results = updates[key]
            # the round every round after robust.median_rounds is (round 0 would time the median of the first rounds)
            steady = int(ctrl.cfg["robust"].get("median_rounds", 0))
            fns[job] = lambda ctrl=ctrl, results=results, g=g, r=steady: ctrl.aggregate(results, g, r)
            params = sum(p.numel() for p in build_net(ctrl.cfg["net"]).parameters())
            rows.append({"job": job, "step": f"{ctrl_cls.__name__}.aggregate", "sites": n_sites, "parameters": params,
                         "net": key, "threads": torch.get_num_threads(), "round": steady})
        t = best_seconds(fns, repeats)
    first = next((row["job"] for row in rows if row.get("step")), None)
    for row in rows:
        if row.get("step"):
            net = row.pop("net")
            row.update(step_s=t[row["job"]], plain_s=t[f"plain {net}"], checks_s=t[f"checks {net}"], first=first)
            row["ratio"] = row["step_s"] / row["plain_s"]
            row["checks_ratio"] = row["checks_s"] / row["plain_s"]
            row["vs_first"] = row["step_s"] / t[first]
    return rows


# ---- scaling --------------------------------------------------------------------------------------------------------
def _routing_point(size: int, experts: int, threads: int) -> dict:
    """IOP-FL routing cost at ``size`` with ``experts`` experts in this (fresh) process, with its peak RSS and the part
    of it above the process's RSS before routing (``routing_rss_gib``: after the imports)."""
    import resource

    import psutil
    import torch

    from pflseg.eval.iopfl_cost import measure

    torch.set_num_threads(threads)
    base = psutil.Process().memory_info().rss  # the process with torch, MONAI and pflseg imported
    row = measure(size, experts)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {**row, "peak_rss_gib": peak / GIB, "routing_rss_gib": max(0, peak - base) / GIB}


def scaling(workspace: Path, job: str, sites: Sequence[int], sizes: Sequence[int], experts: Sequence[int],
            base_sites: int, base_size: int, rounds: int, sets: dict | None = None, executor: str | None = None,
            progress=print) -> list[dict]:
    """Rows ``{"axis": "sites" | "size" | "experts", "value", ...}``: job ``job`` in the simulator at each number of
    ``sites`` (image size ``base_size``) and each image size of ``sizes`` (``base_sites`` sites): wall per round, the
    slowest site's compute, peak memory; IOP-FL routing at each number of ``experts`` (image size ``base_size``)."""
    runs: dict[tuple[int, int], dict] = {}
    rows = []
    for axis, values in (("sites", sites), ("size", sizes)):
        for value in values:
            n, size = (value, base_size) if axis == "sites" else (base_sites, value)
            if (n, size) not in runs:
                progress(f"scaling: {job}, {n} sites, size {size}")
                ws = workspace / "scaling" / f"sites{n}_size{size}"
                over = job_overrides(n, rounds, size, sets, executor)
                try:
                    run = run_sim(ws, job, n, data_root(workspace, n, size), over, progress)
                    costs = round_costs(run["history"])
                    runs[n, size] = {"sites": n, "size": size, "wall_s": costs["wall_s"],
                                     "slowest_s": costs["slowest_s"], **run["memory"]}
                except Exception as exc:  # noqa: BLE001 - a setting too large for this machine: named, the rest runs
                    runs[n, size] = {"sites": n, "size": size, "error": f"{type(exc).__name__}: {exc}"}
            rows.append({"axis": axis, "value": value, **runs[n, size]})
    ctx = multiprocessing.get_context("spawn")
    for e in experts:
        progress(f"scaling: IOP-FL routing, {e} experts, size {base_size}")
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            try:
                point = pool.submit(_routing_point, base_size, e, threads_per_site(1)).result()
            except Exception as exc:  # noqa: BLE001
                point = {"error": f"{type(exc).__name__}: {exc}"}
        rows.append({"axis": "experts", "value": e, "size": base_size, **point})
    return rows


def scaling_markdown(rows: list[dict]) -> str:
    """The scaling rows as one Markdown table."""
    head = ["axis", "value", "wall / round s", "slowest site s", "peak PSS, all GiB", "peak PSS, largest site GiB",
            "routing s / image", "routing / UNet forward"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["axis"], r["value"], f"failed: {r['error'][:80]}", "", "", "", "", ""])
        elif r["axis"] == "experts":
            rss = f"{_num(r.get('peak_rss_gib'), 2)} (+{_num(r.get('routing_rss_gib'), 2)} routing)"
            body.append([r["axis"], r["value"], "-", "-", rss, "-",
                         _num(r.get("routing_s_per_image"), 3), _num(r.get("ratio_routing_to_unet"), 0)])
        else:
            body.append([r["axis"], r["value"], _num(r["wall_s"], 2), _num(r["slowest_s"], 2),
                         _num(r["peak_total_gib"], 2), _num(r["peak_site_max_gib"], 2), "-", "-"])
    return markdown_table(head, body)


def plot_scaling(rows: list[dict], path: str | Path) -> Path | None:
    """One panel per axis: seconds (wall per round; routing s per image) and peak memory (GiB, right axis); None
    without matplotlib or rows."""
    from pflseg.eval.plots import _pyplot, have_matplotlib

    axes = [a for a in ("sites", "size", "experts") if any(r["axis"] == a and "error" not in r for r in rows)]
    if not have_matplotlib() or not axes:
        return None
    plt = _pyplot()
    fig, panels = plt.subplots(1, len(axes), figsize=(4.5 * len(axes), 3.6), squeeze=False)
    for ax, axis in zip(panels[0], axes):
        pts = [r for r in rows if r["axis"] == axis and "error" not in r]
        x = [r["value"] for r in pts]
        if axis == "experts":
            ax.plot(x, [r["routing_s_per_image"] for r in pts], "o-", label="routing s / image")
            mem = {"peak RSS (process)": [r["peak_rss_gib"] for r in pts]}
        else:
            ax.plot(x, [r["wall_s"] for r in pts], "o-", label="wall / round")
            ax.plot(x, [r["slowest_s"] for r in pts], "s--", label="slowest site compute")
            mem = {"peak PSS, all": [r["peak_total_gib"] for r in pts],
                   "peak PSS, largest site": [r["peak_site_max_gib"] for r in pts]}
        ax.set_xlabel({"sites": "sites", "size": "image size (px)", "experts": "experts (K + 1)"}[axis])
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        if len(x) > 1:  # the sweeps double: a log2 axis spaces them evenly
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
        right = ax.twinx()
        for (label, ys), style in zip(mem.items(), ("^:", "v:")):
            right.plot(x, ys, style, color="tab:red", label=label)
        right.set_ylabel("GiB")
        right.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- the report -----------------------------------------------------------------------------------------------------
def run(workspace: str | Path, methods: Sequence[str] | None = None, sites: int = DEFAULTS["sites"],
        rounds: int = DEFAULTS["rounds"], size: int = DEFAULTS["size"], envs: Sequence[str] = ENVS,
        executor: str | None = None, sets: dict | None = None, agg_sites: int = DEFAULTS["agg_sites"],
        repeats: int = DEFAULTS["repeats"], scale: bool = False,
        scaling_sites: Sequence[int] = DEFAULTS["scaling_sites"],
        scaling_sizes: Sequence[int] = DEFAULTS["scaling_sizes"],
        scaling_experts: Sequence[int] = DEFAULTS["scaling_experts"],
        scaling_method: str | None = None,
        progress=print) -> dict:
    """Measure everything the module docstring lists; write ``speed.json`` (and with ``scale`` the scaling PNG) in
    ``workspace``; return the result ``to_markdown`` renders.

    Args:
        methods: job names (``app_configs/<job>.yaml``; default ``default_jobs``).
        envs: of ``ENVS``: ``sim`` (FLARE's simulator), ``poc`` (a loopback POC federation).
        executor: the sites' executor kind (``site.executor``: ``executor`` | ``client_api``); None: the config's.
        sets: config overrides of every job (``pflseg.config.parse_set`` of ``--set``).
        scale: also the scaling sweeps (``scaling``) of ``scaling_method`` (default ``default_jobs``).
    """
    from pflseg.deploy.workspace import workspace_lock

    if methods is None or scaling_method is None:
        jobs = default_jobs()
        methods = jobs["methods"] if methods is None else methods
        scaling_method = scaling_method or jobs["scaling_method"]

    unknown = [e for e in envs if e not in ENVS]
    if unknown or not envs:
        raise ValueError(f"envs {list(envs)}: expected one or more of {', '.join(ENVS)}")
    if sites < 2:
        raise ValueError(f"sites={sites}: a federation needs at least 2 sites")
    ws = Path(workspace).resolve()
    result: dict = {"setup": {"methods": list(methods), "sites": sites, "rounds": rounds, "size": size,
                              "envs": list(envs), "executor": executor, "sets": sets or {},
                              "threads_per_site": threads_per_site(sites), "cores": os.cpu_count()},
                    "rows": [], "errors": [], "plain": {}, "runs": {}}
    with workspace_lock(ws):
        root = data_root(ws, sites, size)
        names = [f"site-{i + 1}" for i in range(sites)]
        overrides = {job: job_overrides(sites, rounds, size, sets, executor) for job in methods}
        for env in envs:
            result["runs"][env] = {}
        _flare_runs(result, ws, root, overrides, progress)
        _plain_runs(result, ws, root, names, overrides, progress)
        for env in envs:
            for job, run_ in result["runs"][env].items():
                plain = result["plain"].get(job, {}).get("seconds")
                floor = run_.get("floor") or {}
                if "error" in floor:
                    result["errors"].append(f"{env} {job} floor: {floor['error']}")
                row = compare(round_costs(run_["history"]), plain, floor=floor_seconds(floor.get("history")))
                memory = run_.get("memory") or {}
                result["rows"].append({"env": env, "job": job, "executor": run_["executor"], **row,
                                       "floor_parameters": floor.get("parameters"),
                                       "peak_total_gib": memory.get("peak_total_gib"),
                                       "peak_site_max_gib": memory.get("peak_site_max_gib")})
        progress(f"[aggregation] {', '.join(methods)}: {agg_sites} sites")
        try:
            result["aggregation"] = aggregation_times(methods, agg_sites, repeats)
        except Exception as exc:  # noqa: BLE001
            result["errors"].append(f"aggregation: {type(exc).__name__}: {exc}")
        if scale:
            result["scaling"] = scaling(ws, scaling_method, scaling_sites, scaling_sizes, scaling_experts, sites, size,
                                        rounds, sets, executor, progress)
            png = plot_scaling(result["scaling"], ws / SCALING_PNG)
            result["scaling_png"] = str(png) if png else None
        result["device"] = _device()
        (ws / RESULTS_JSON).write_text(json.dumps(result, indent=1, default=str))
        (ws / MARKDOWN).write_text(to_markdown(result) + "\n")
    return result


def _flare_runs(result: dict, ws: Path, root: Path, overrides: dict[str, dict], progress) -> None:
    """(b), (c), (d): every job, each just after its floor job, in each environment of ``result["setup"]`` into
    ``result["runs"][env][job]``; a run that failed is named in ``result["errors"]`` and the others go on."""
    s = result["setup"]
    methods, sites, rounds, size = s["methods"], s["sites"], s["rounds"], s["size"]
    if "sim" in s["envs"]:
        for job in methods:
            progress(f"[sim] {job}: {sites} sites, {rounds} rounds, size {size}")
            try:
                result["runs"]["sim"][job] = run_sim(ws, job, sites, root, overrides[job], progress, floor=True)
            except Exception as exc:  # noqa: BLE001 - named in the report; the other runs go on
                result["errors"].append(f"sim {job}: {type(exc).__name__}: {exc}")
    if "poc" in s["envs"]:
        progress(f"[poc] {', '.join(methods)}: {sites} sites, {rounds} rounds, size {size}")
        try:
            for job, run_ in run_poc(ws, overrides, sites, root, progress, floor=True).items():
                if "error" in run_:
                    result["errors"].append(f"poc {job}: {run_['error']}")
                else:
                    result["runs"]["poc"][job] = run_
        except Exception as exc:  # noqa: BLE001
            result["errors"].append(f"poc: {type(exc).__name__}: {exc}")


def _plain_runs(result: dict, ws: Path, root: Path, names: list[str], overrides: dict[str, dict], progress) -> None:
    """(a): every job's plain loop, with the config its sites received, into ``result["plain"][job]`` (``{"none":
    why}`` for a method without one); a failure is named in ``result["errors"]``."""
    from pflseg.config import load_job_config
    from pflseg.flare.methods import method

    s = result["setup"]
    for job in s["methods"]:
        cfg = _effective(ws, job, result["runs"]) or load_job_config(job, overrides=overrides[job])
        why = plain_equivalent(method(cfg).site)
        if why:
            result["plain"][job] = {"none": why}
            continue
        progress(f"[plain] {job}: {s['sites']} sites at once, {s['rounds']} rounds")
        try:
            result["plain"][job] = {"seconds": plain_rounds(root, names, cfg, s["rounds"],
                                                            threads_per_site(s["sites"]))}
        except Exception as exc:  # noqa: BLE001
            result["errors"].append(f"plain {job}: {type(exc).__name__}: {exc}")


def _effective(ws: Path, job: str, runs: dict) -> dict | None:
    """The effective config the sites received: the exported job's (simulator first, then POC); None if none ran."""
    from pflseg.deploy.workspace import job_config

    for folder in (ws / "sim" / job / "job" / job, ws / "poc" / "jobs" / job):
        try:
            return job_config(folder)
        except (OSError, ValueError):
            continue
    return None


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _memory(row: dict) -> str:
    if row.get("peak_total_gib") is None:
        return "-"
    return f"{row['peak_total_gib']:.2f} / {_num(row.get('peak_site_max_gib'), 2)}"


HEAD = ["env", "job", "site executor", "plain loop s", "site compute s", "compute / plain", "round wall s",
        "slowest site s", "fixed s / round", "FLARE floor s (this run)", "fixed - floor s",
        "peak PSS GiB (all / largest site)"]


def to_markdown(result: dict) -> str:
    """The report: a header line, the round table (one row per environment and job), the aggregation table, the
    scaling table (when measured), notes and errors."""
    s = result["setup"]
    rounds = s["rounds"]
    measured_text = "round 0" if rounds <= 1 else (f"rounds 1..{rounds - 1}" if rounds > 2 else "round 1")
    lines = [f"{s['sites']} sites, image size {s['size']}, {rounds} rounds (measured: {measured_text}; medians), "
             f"{s['threads_per_site']} torch thread(s) per site on {s['cores']} cores, device "
             f"{result.get('device', '?')}", ""]
    body = [[r["env"], r["job"], r["executor"], _num(r["plain_s"], 2), _num(r["compute_s"], 2), _num(r["ratio"], 2),
             _num(r["wall_s"], 2), _num(r["slowest_s"], 2), _num(r["fixed_s"], 2), _num(r["floor_s"], 2),
             _num(r["above_floor_s"], 2), _memory(r)] for r in result["rows"]]
    lines.append(markdown_table(HEAD, body))
    lines += ["", "round wall: the server's history[r].wall_seconds (first send to new global model); fixed = wall - "
              "the round's slowest site compute; FLARE floor: measured in this run, just before each job in the same "
              "environment: the median round wall (same rounds measured) of a no-work job (pflseg.flare.floor) with "
              "the job's site executor, sites, rounds and its net's parameter count as the model sent and returned "
              "(its controller waits for FLARE's task check; pflseg's goes on at the last answer, so fixed may lie "
              "below); peak PSS: the simulator's processes (proportional set size: shared library pages split "
              "between the processes that map them; sampled every 0.5 s)."]
    if rounds - 1 < 5:
        lines.append(f"only {max(rounds - 1, 1)} round(s) measured: a round's fixed cost and the floor job's round "
                     "depend on where their ends fall in FLARE's polling cycles, so fixed - floor may even be "
                     "negative; use --rounds 7 or more for stable medians.")
    for job, plain in result.get("plain", {}).items():
        if "none" in plain:
            lines.append(f"{job}: no plain loop ({plain['none']})")
    agg = result.get("aggregation") or []
    if agg:
        lines += ["", "Server aggregation (minimum over repeats, every step interleaved with the others):", ""]
        first = next((a["first"] for a in agg if a.get("first")), None)
        lines.append(markdown_table(
            ["job", "server step", "sites", "parameters (M)", "step s", "plain weighted average s", "step / plain",
             f"step / {first}'s", "bound checks s", "checks / plain"],
            [[a["job"], a.get("note") or a["step"], a.get("sites", "-"),
              _num(a["parameters"] / 1e6 if "parameters" in a else None, 2), _num(a.get("step_s"), 4),
              _num(a.get("plain_s"), 4), _num(a.get("ratio"), 2), _num(a.get("vs_first"), 2),
              _num(a.get("checks_s"), 4), _num(a.get("checks_ratio"), 2)] for a in agg]))
        lines.append("Bound checks: the guard's work on the same updates before any method weighs them (update norms "
                     "for the norm bound, then the clip; robust defaults), in float64 as the guard computes them.")
    if result.get("scaling"):
        lines += ["", "Scaling (simulator; routing: IOP-FL test-time routing, one process):", "",
                  scaling_markdown(result["scaling"])]
        if result.get("scaling_png"):
            lines.append(f"\nplot: {result['scaling_png']}")
    if result.get("errors"):
        lines += ["", *[f"error: {e}" for e in result["errors"]]]
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pflseg report speed``; a flag the parser has already (a report flag shared with other reports:
    --workspace, --sites, --rounds, --size, --repeats, --set) is left as it is."""
    def add(flag: str, **kw) -> None:
        if flag not in parser._option_string_actions:
            parser.add_argument(flag, **kw)

    add("--workspace", default=None, help="folder of the data, runs and report (default: runs/speed)")
    add("--methods", nargs="+", default=None,
        help="jobs to measure (default: the reference job and the registry's speed methods; commas also separate)")
    add("--sites", type=int, default=None, help=f"sites of every run (default {DEFAULTS['sites']})")
    add("--rounds", type=int, default=None, help=f"rounds of every run (default {DEFAULTS['rounds']}; round 0 is "
                                                 "not measured)")
    add("--size", type=int, default=None, help=f"image size (default {DEFAULTS['size']})")
    add("--envs", nargs="+", choices=ENVS, default=None, help="where FLARE runs: sim, poc (default: both)")
    add("--executor", choices=EXECUTOR_KINDS, default=None, help="site executor kind site.executor (default: the "
                                                                 "config's)")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every job")
    add("--agg-sites", type=int, default=None,
        help=f"sites of the aggregation timing (default {DEFAULTS['agg_sites']})")
    add("--repeats", type=int, default=None, help="timing repeats of the aggregation step")
    add("--scaling", action="store_true", help="also: wall per round and peak memory against sites, size, experts")
    add("--scaling-sites", type=int, nargs="+", default=None,
        help=f"--scaling: numbers of sites (default {' '.join(map(str, DEFAULTS['scaling_sites']))})")
    add("--scaling-sizes", type=int, nargs="+", default=None,
        help=f"--scaling: image sizes (default {' '.join(map(str, DEFAULTS['scaling_sizes']))})")
    add("--scaling-experts", type=int, nargs="+", default=None,
        help=f"--scaling: routing experts K + 1 (default {' '.join(map(str, DEFAULTS['scaling_experts']))})")
    add("--scaling-method", default=None, help="--scaling: the job (default: the reference job)")


def name_defaults(parser: argparse.ArgumentParser) -> None:
    """The help of --methods and --scaling-method naming ``default_jobs`` (read from the registry when the command is
    parsed)."""
    jobs = default_jobs()
    for action in parser._actions:
        if action.dest == "methods":
            action.help = f"jobs to measure (default: {' '.join(jobs['methods'])}; commas also separate)"
        elif action.dest == "scaling_method":
            action.help = f"--scaling: the job (default {jobs['scaling_method']})"


def options(**flags) -> dict:
    """``run``'s keywords from parsed flags (``vars(args)``); flags of other reports are ignored."""
    from pflseg.config import parse_set

    def get(name, default=None):
        value = flags.get(name)
        return default if value is None else value

    named = get("methods")
    methods = None if named is None else [m.strip() for item in named for m in str(item).split(",") if m.strip()]
    return {"workspace": get("workspace", "runs/speed"), "methods": methods, "sites": get("sites", DEFAULTS["sites"]),
            "rounds": get("rounds", DEFAULTS["rounds"]), "size": get("size", DEFAULTS["size"]),
            "envs": tuple(get("envs", ENVS)), "executor": flags.get("executor"),
            "sets": parse_set(list(flags.get("set") or [])), "agg_sites": get("agg_sites", DEFAULTS["agg_sites"]),
            "repeats": get("repeats", DEFAULTS["repeats"]), "scale": bool(flags.get("scaling")),
            "scaling_sites": tuple(get("scaling_sites", DEFAULTS["scaling_sites"])),
            "scaling_sizes": tuple(get("scaling_sizes", DEFAULTS["scaling_sizes"])),
            "scaling_experts": tuple(get("scaling_experts", DEFAULTS["scaling_experts"])),
            "scaling_method": get("scaling_method")}


def report(**flags) -> str:
    """``pflseg report speed``: ``run`` with the parsed flags (``options``); its Markdown (also in
    ``<workspace>/speed.md``)."""
    return to_markdown(run(**options(**flags)))
