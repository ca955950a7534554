"""Shared machinery of pflseg's server workflows (FLARE ModelController).

A method's controller implements ``round(r)``; this base gives it: ``setup()`` (config, sites, state folder, then
``init_state``: the whole server state set in one place, fresh or restored), the validated job config, one send per
site with its own payload (``send_each``), checks of every answer on arrival, min_clients, round checkpoints with
resume, best-global tracking on validation Dice, the final validate + test phase and ``results.json``. Everything the
server keeps between rounds is in its ``ServerState`` (``self.state``, ``pflseg.flare.server_state``: each part
declared once, in ``declare``), which writes the round checkpoints and reads them back, so a stopped job resumes from
its last completed round.

A round's steps work as Flower's strategies do: each takes the round's answers and the current state and returns
the new state and its entries of the round's history (``aggregate``, SoftPull, GRACE's re-weighting, LC-Fed's shared
average, ``track_best``); ``round`` assigns the new state and returns a ``RoundOutput`` (compute seconds, the round's
entries, the sites' metrics), which the run loop keeps in the history. Nothing a step computes reaches the run loop
through an attribute. Message keys are named in ``pflseg.flare.wire``; n_k is FLARE's
``FLMetaKey.NUM_STEPS_CURRENT_ROUND``.

Trust at the boundary: a site's answer is data from another party. ``send_each`` checks each answer in isolation
before anything uses it (``check_result``; an answer of FLARE's kind DIFF, ``privacy.update.send: diff``, is first
added back to what the task sent, ``add_diff``, so every method gets full values either way): the update against the
reference the task sent (exact keys, shapes, dtypes, storage size, NaN/Inf), n_k (a positive integer, at most
``max_n_samples`` and at most the site's first accepted n_k), the metrics the task needs (Dice-like values in [0,
1], every number finite). A failing answer leaves that site out of that round with the reason in ``missing``; the
others complete it, so no single site's answer can end the job or take the aggregate over. A site left out of a
round is sent the next round's task again (re-admitted when it answers; left out again when it does not). What one
answer alone cannot show, the round's answers together can (``pflseg.flare.guard``, config section ``robust``): an
update norm far beyond the other sites' leaves that site out too, n_k is capped relative to the other sites' n_k,
the aggregation rule may be robust (median, trimmed mean), and a non-finite aggregate is never used (the previous
model stays).

Whose state: ``setup`` claims the server's state folder for the FLARE job's id (``pflseg.flare.state.claim``:
owner recorded, exclusive lock held until the job ends, an earlier job's state of the same name moved aside).
"""

from __future__ import annotations

import json
import numbers
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.abstract.fl_model import FLMetaKey, FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.app_opt.pt.decomposers import TensorDecomposer
from nvflare.fuel.utils import fobs

from pflseg.config import check_effective, check_ranges
from pflseg.flare import guard, metrics_files
from pflseg.flare.checks import KINDS, check_metrics, check_update, state_mismatch
from pflseg.flare.policy import check_bundle_origin, record_origin
from pflseg.flare.server_state import NET, ServerState
from pflseg.flare.state import RoundStore, StateError, claim, inside, release, save_file, state_dir, write_text
from pflseg.flare.wire import BEST, GLOBAL, prefixed, unprefixed
from pflseg.nets import build_net, fit_to_sites
from pflseg.train.loop import seed_everything


class RoundError(RuntimeError):
    """Too few sites answered a task."""


def add_diff(res: FLModel, sent: dict, reference: dict | None) -> str | None:
    """Turn a site's answer of kind ``ParamsType.DIFF`` (FLARE's WEIGHT_DIFF: ``privacy.update.send: diff``, or
    what a FLARE filter made of it) into full values, in place: ``sent[k] + diff[k]`` for every key the task sent
    (cast to the sent tensor's dtype, integers rounded: a filter may have made them float), the value itself for a
    key not sent (an update against zero). A key the task expects back (``reference``) and sent but missing from
    the answer (dropped by a filter such as FLARE's ExcludeVars) counts as unchanged: the value sent, a zero
    update. Returns why the answer cannot be used (a non-finite or wrongly shaped difference), or None; an answer
    of another kind is left as it is. ``check_update`` then judges the full values like any other answer."""
    if res.params_type != ParamsType.DIFF:
        return None
    diff = res.params or {}
    full = {}
    for key, value in diff.items():
        base = sent.get(key)
        if not (torch.is_tensor(value) and torch.is_tensor(base)):
            full[key] = value
            continue
        if tuple(value.shape) != tuple(base.shape):
            return f"difference '{key}' has shape {tuple(value.shape)}, expected {tuple(base.shape)}"
        if value.is_floating_point() and not torch.isfinite(value).all():
            return f"difference '{key}' contains NaN or Inf"
        if base.is_floating_point():
            full[key] = base + value.to(device=base.device, dtype=base.dtype)
        else:
            step = value.round() if value.is_floating_point() else value
            full[key] = base + step.to(device=base.device, dtype=base.dtype)
    for key in reference or {}:
        if key not in full and torch.is_tensor(sent.get(key)):
            full[key] = sent[key].clone()
    res.params, res.params_type = full, ParamsType.FULL
    return None


class Answers(dict):
    """A task's usable answers, ``{site: FLModel}`` (sorted by site), with what the round's history keeps of them:
    ``site_metrics``, ``{site: the numbers it reported (not compute_seconds), and its n_k cap (guard.screen)}``."""

    def __init__(self, answers: dict | None = None, site_metrics: dict | None = None):
        super().__init__(answers or {})
        self.site_metrics: dict[str, dict] = site_metrics if site_metrics is not None else {}


@dataclass
class RoundOutput:
    """What one round gives the run loop (``RoundController.round``), kept in the round's history entry.

    Attributes:
        compute: per-site compute seconds of the round.
        metrics: the round's own entries: ``val_dice`` (per site) and ``val_dice_mean`` (``track_best``), a method's
            own (``grace_weights``, ``similarity``, ``head_bytes``, ``selector_loss``, ``selector_val_acc_mean``...).
        site_metrics: ``Answers.site_metrics`` of the round's answers.
    """

    compute: dict[str, float]
    metrics: dict = field(default_factory=dict)
    site_metrics: dict = field(default_factory=dict)

    @classmethod
    def of(cls, results: dict, metrics: dict) -> RoundOutput:
        """The output of a round whose answers are ``results`` (``send_each``'s) and whose entries are ``metrics``."""
        return cls(compute={s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()},
                   metrics=metrics, site_metrics=getattr(results, "site_metrics", {}))


class RoundController(ModelController):
    """Base of every pflseg workflow: ``run()`` = restore, rounds, final test, results."""

    #: What a site's answer to a task must carry in its metrics, checked on arrival so that no later step can
    #: fail on one site's answer: task -> {metric: kind (``KINDS``)}. A method with its own tasks extends it.
    task_metrics: dict[str, dict[str, str]] = {"train": {"val_dice": "dice"}, "validate": {"val_dice": "dice"},
                                                "test": {"test": "dict"}}
    #: The same for the answer's meta.
    task_meta: dict[str, dict[str, str]] = {}
    #: Tasks whose answers are aggregated with weight n_k: their meta must carry NUM_STEPS_CURRENT_ROUND.
    weighted_tasks: tuple[str, ...] = ("train",)

    def __init__(self, config: dict, task_check_period: float = 0.2):
        super().__init__(persistor_id="", ignore_result_error=True, task_check_period=task_check_period)
        self.config = config
        self.task_check_period = task_check_period

    # ---- the workflow ---------------------------------------------------------------------------
    #: Bounds of the method's own integer keys that size memory or run time (dotted key -> (lowest, highest)), as
    #: ``pflseg.config.RANGES`` bounds the common ones; ``check_config`` applies them.
    ranges: dict[str, tuple[int, int]] = {}

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        """The method's own config rules (beyond the common ones of ``pflseg.config.validate``): its ``ranges``, and
        in a subclass, after ``super().check_config``, its sections' values; ConfigError naming the key and the fix.
        ``pflseg.flare.methods.method`` runs it wherever a job is loaded, built, run or received."""
        check_ranges(cfg, source, cls.ranges, f"{cls.__module__}.{cls.__qualname__}.ranges")

    def setup(self) -> int | None:
        """Everything before the first round: validated config, connected sites, state folder (claimed), then the
        server's state (``init_state``). Returns the first round to run, or None after a panic (named in the log)."""
        fobs.register(TensorDecomposer)  # messages carry torch tensors end to end
        try:
            self.cfg = check_effective(self.config, "server job config")
            sites = sorted(self.sample_clients())
            if len(sites) < self.cfg["min_clients"]:
                self.panic(f"{len(sites)} site(s) connected but min_clients={self.cfg['min_clients']}")
                return None
            store = self.open_store()
            self.check_config(self.cfg, "server job config")
            return self.init_state(self.cfg, sites, store)
        except (ValueError, RuntimeError) as exc:  # bad config or name, bad method settings, corrupt checkpoint
            self.panic(str(exc))
            return None

    def init_state(self, cfg: dict, sites: list[str], store: RoundStore) -> int:
        """The server's whole state, set in one place (``setup`` calls it once the sites are connected; tests call it
        with a loaded config, site names and a folder): the job config, the sites (sorted), the state folder, the
        network sized to the sites, no site left out yet, and the server state (``declare``: its parts, fresh), or, when
        resuming, that of the last completed round (``restore``). Returns the first round to run."""
        self.cfg, self.sites, self.store = cfg, sorted(sites), store
        self.size_net()
        self.state = ServerState(self.sites)
        self.declare(self.state)
        return self.restore()

    @property
    def missing(self) -> dict[str, str]:
        """The sites left out of some round, each with the latest reason: a part of the server state, so that a
        resumed run's results.json still names the sites left out before it stopped."""
        return self.state.missing

    def flare_job_id(self) -> str | None:
        """The FLARE job's id (``simulate_job`` in the simulator); None outside FLARE (tests)."""
        fl_ctx = getattr(self, "fl_ctx", None)
        return fl_ctx.get_job_id() if fl_ctx is not None else None

    def open_store(self) -> RoundStore:
        """The server's state folder of this job, claimed for the FLARE job's id (see the module docstring)."""
        folder = state_dir("server", self.cfg["name"])
        job_id = self.flare_job_id()
        if job_id is not None:
            moved = claim(folder, job_id, self.cfg["resume"])
            self.claimed = folder
            record_origin(folder, job_id)  # deployed: who submitted it (a bundle is read by their own jobs only)
            if moved:
                self.info(f"job {job_id} starts afresh; the earlier job's state of this name is now in {moved}")
        return RoundStore(folder)

    def run(self) -> None:
        try:
            self.run_rounds()
        finally:
            if getattr(self, "claimed", None) is not None:
                release(self.claimed)

    def run_rounds(self) -> None:
        start = self.setup()
        if start is None:
            return
        for r in range(start, self.n_rounds()):
            t0 = time.time()
            self.info(f"round {r + 1}/{self.n_rounds()}: sites {self.sites}")
            before = self.state.snapshot()
            try:
                out = self.round(r)
            except RoundError as exc:
                self.panic(str(exc))
                return
            if self.abort_signal.triggered:
                return
            rejected = guard.keep_finite(self.state, r, before, self.error)  # a non-finite aggregate is not used
            if rejected:
                out.metrics = {**out.metrics, "aggregate_rejected": rejected}
            wall, compute = time.time() - t0, out.compute
            # rounds count from 1 in results.json (as in the log); a model is named by the rounds it has seen
            # (best_global_round, selected_round: 0 = the initial model, k = the model after round k)
            self.state.history.append({"round": r + 1, "wall_seconds": wall, "site_compute_seconds": compute,
                                 "site_metrics": out.site_metrics, **out.metrics})
            self.store.save(r, self.checkpoint(r))
            rounds_file = self.store.root / metrics_files.FOLDER / metrics_files.ROUNDS  # FLARE's format, each round
            write_text(rounds_file, metrics_files.round_lines(self.state.history))
            self.info(f"round {r + 1} done in {wall:.2f} s (site compute max {max(compute.values(), default=0):.2f} s)")
        self.finish()

    def size_net(self) -> None:
        """The net config sized to the connected sites (``pflseg.nets.fit_to_sites``)."""
        fit_to_sites(self.cfg["net"], self.sites)

    def round(self, r: int) -> RoundOutput:
        """Run round ``r``: send, collect, then the method's steps, each taking the round's answers and the current
        state and returning the new state (assigned here, in ``round``) and the round's entries. Returns what the
        run loop keeps of the round (``RoundOutput.of(results, metrics)``)."""
        raise NotImplementedError

    def n_rounds(self) -> int:
        return self.cfg["rounds"]

    # ---- state ----------------------------------------------------------------------------------
    def initial_state(self) -> dict:
        seed_everything(self.cfg["seed"])
        return {k: v.detach().clone() for k, v in build_net(self.cfg["net"]).state_dict().items()}

    def declare(self, state: ServerState) -> None:
        """The parts of the server state (``pflseg.flare.server_state``) with their fresh values: the round history,
        the best global model's record, each site's first accepted n_k (its later n_k may not exceed it), the global
        model (guarded) and the best one, the sites left out. A method declares its own after
        ``super().declare(state)``."""
        state.add("history", [])
        state.add("missing", {})
        state.add("best", {"round": -1, "score": -1.0})
        state.add("n_first", {})
        state.add("global_state", self.initial_state(), NET, GLOBAL, guarded=True)
        state.add("best_state", {}, NET, BEST)

    def restore(self) -> int:
        """Load the last completed round into the server state when resuming; else start fresh. Returns the first
        round to run."""
        latest = self.store.latest()
        if not self.cfg["resume"] or latest is None:
            self.store.clear()
            return 0
        ckpt = self.store.load(latest)
        mismatch = state_mismatch(unprefixed(GLOBAL, ckpt), self.state.global_state)
        if mismatch:
            raise ValueError(f"resume: the config no longer matches the checkpoint {self.store.path(latest)} ("
                             f"{mismatch}): the network (net.*) differs from the run that wrote it. Run with that "
                             "run's config, or start afresh (resume: false; pflseg run without --resume)")
        self.state.restore(ckpt)
        self.info(f"resuming after round {latest + 1} from {self.store.path(latest)}")
        return latest + 1

    def checkpoint(self, r: int) -> dict:
        return {"round": r, **self.state.checkpoint()}

    def track_best(self, r: int, results: dict[str, FLModel], state: dict) -> dict:
        """Keep the global model ``state`` when its n_k-weighted validation Dice (scored at the sites; every answer's
        val_dice and n_k were checked on arrival) is the best so far. Returns the round's entries ``val_dice`` (per
        site) and ``val_dice_mean``."""
        scores = [(res.metrics["val_dice"], res.meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1) or 1)
                  for res in results.values()]
        score = guard.validation_score(scores, self.cfg)  # n_k capped in send_each (guard.screen)
        if score > self.state.best["score"]:
            self.state.best, self.state.best_state = {"round": r, "score": score}, dict(state)
        return {"val_dice": {s: res.metrics["val_dice"] for s, res in results.items()}, "val_dice_mean": score}

    def log_scalars(self, tag: str, values: dict[str, float], step: int) -> None:
        """Server-side TensorBoard scalars (``tb_events/<server name>``) through FLARE's analytics receiver."""
        with self.engine.new_context() as fl_ctx:
            dxo = create_analytic_dxo(tag, {k: float(v) for k, v in values.items()}, AnalyticsDataType.SCALARS,
                                      global_step=step)
            send_analytic_dxo(self, dxo, fl_ctx)

    # ---- messaging ------------------------------------------------------------------------------
    def message(self, r: int, params: dict | None = None, **meta) -> FLModel:
        return FLModel(params=params or {}, params_type=ParamsType.FULL, current_round=r,
                       total_rounds=self.n_rounds(), meta={"pflseg": self.cfg, "sites": self.sites, **meta})

    def send_each(self, task: str, payloads: dict[str, FLModel], reference: dict | None = None) -> Answers:
        """Send each site its own payload; wait; return usable results by site (sorted), with their site metrics.

        A site that fails, times out (``task_timeout``), reports an error or sends an unusable answer
        (``check_result``) is named in the log and in ``self.missing``; fewer than ``min_clients`` usable
        answers raise RoundError. Only usable answers are returned, so what follows cannot fail on one site's
        answer. A site left out is left out of this task only: the next task goes to it again, and its answer
        counts when it is usable (its personalized state continues from the latest round it completed).
        """
        results: dict[str, FLModel] = {}
        need = min(self.cfg["min_clients"], len(payloads))
        all_in = threading.Event()

        def collect(result: FLModel):
            results[result.meta.get("client_name", "?")] = result
            if all(site in results for site in payloads):
                all_in.set()

        for site, data in payloads.items():
            self.send_model(task_name=task, data=data, targets=[site], timeout=self.cfg["task_timeout"],
                            callback=collect)
        # On as soon as every site has answered: FLARE marks a task done only on its next check (task_check_period),
        # and that wait plus a poll of our own cost up to 0.4 s a round. A site that never answers: its task ends by
        # timeout or failure, and then no task stands.
        while not all_in.is_set() and self.get_num_standing_tasks():
            if self.abort_signal.triggered:
                return {}
            all_in.wait(self.task_check_period)
        usable = Answers()
        for site in sorted(payloads):
            res = results.get(site)
            reason = None
            if res is None:
                reason = "no result (site failed, disconnected or timed out)"
            else:  # differences (privacy.update.send: diff, FLARE filters) become full values first
                reason = self.restored(res, payloads[site].params
                                       or {}, reference) or self.checked(task, site, res, reference)
            if reason:
                self.error(f"{task}: site {site} left out of this round: {reason}")
                self.missing[site] = reason
            else:
                usable[site] = res
                usable.site_metrics[site] = {k: v for k, v in (res.metrics or {}).items()
                                             if isinstance(v, (int, float)) and k != "compute_seconds"}
        guard.screen(self, task, payloads, usable, reference)  # norm bounds, n_k caps: relative to the others
        for site, res in usable.items():
            n_k = res.meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND)
            if n_k is not None:
                self.state.n_first.setdefault(site, int(n_k))
        if len(usable) < need:
            raise RoundError(
                f"task '{task}': only {len(usable)} of {len(payloads)} site(s) answered usably, min_clients={need}. "
                f"Problems: " + "; ".join(f"{s}: {m}" for s, m in self.missing.items())
            )
        return usable

    def restored(self, res: FLModel, sent: dict, reference: dict | None) -> str | None:
        """``add_diff``, with any exception in it made that answer's reason."""
        try:
            return add_diff(res, sent, reference)
        except Exception as exc:  # a malformed answer must not end the job, whatever it holds
            return f"malformed difference ({type(exc).__name__}: {exc})"

    def checked(self, task: str, site: str, res: FLModel, reference: dict | None) -> str | None:
        """``check_result``, with any exception in checking one answer made that answer's reason."""
        try:
            return self.check_result(task, site, res, reference)
        except Exception as exc:  # a malformed answer must not end the job, whatever it holds
            return f"malformed answer ({type(exc).__name__}: {exc})"

    def check_result(self, task: str, site: str, res: FLModel, reference: dict | None) -> str | None:
        """Why ``site``'s answer to ``task`` cannot be used, or None. Checks the site's error report, the
        message body's types, the update against ``reference`` (``check_update``; when the task sent one),
        the metrics the task needs (``task_metrics``, ``check_metrics``), its meta (``task_meta``) and n_k."""
        meta = res.meta if isinstance(res.meta, dict) else {}
        if meta.get("pflseg_error"):
            return str(meta["pflseg_error"])[:2000]
        if res.params is not None and not isinstance(res.params, dict) and hasattr(res.params, "items"):
            res.params = dict(res.params.items())  # FLARE's lazily loaded tensors (disk offload)
        for name in ("params", "metrics"):
            value = getattr(res, name)
            if value is not None and not isinstance(value, dict):
                return f"{name} is {type(value).__name__}, not a dict"
        if reference is not None:
            reason = check_update(res.params or {}, reference)
            if reason:
                return reason
        reason = check_metrics(res.metrics or {}, self.task_metrics.get(task, {}))
        if reason:
            return reason
        for key, kind in self.task_meta.get(task, {}).items():
            if key not in meta or not KINDS[kind][0](meta[key]):
                return f"meta {key}={meta.get(key)!r} is not {KINDS[kind][1]}"
        return self.check_n_k(task, site, meta)

    def check_n_k(self, task: str, site: str, meta: dict) -> str | None:
        """n_k (meta NUM_STEPS_CURRENT_ROUND, the aggregation weight): required for ``weighted_tasks``; where
        given, a positive integer, at most ``max_n_samples`` and at most the site's first accepted n_k."""
        key = FLMetaKey.NUM_STEPS_CURRENT_ROUND
        if meta.get(key) is None:
            return f"no {key} (n_k, the aggregation weight)" if task in self.weighted_tasks else None
        n_k = meta[key]
        if not isinstance(n_k, numbers.Integral) or isinstance(n_k, bool) or n_k < 1:
            return f"{key}={n_k!r} is not a positive integer"
        if n_k > self.cfg["max_n_samples"]:
            return f"{key}={n_k} exceeds max_n_samples={self.cfg['max_n_samples']}"
        first = self.state.n_first.get(site)
        if first is not None and n_k > first:
            return f"{key}={n_k} exceeds its first accepted value {first} (a site's n_k may not grow during a job)"
        return None

    # ---- end of training ------------------------------------------------------------------------
    def final_params(self, site: str) -> dict:
        """What the final validate task carries to ``site`` (the global model; empty for methods without one)."""
        return prefixed(GLOBAL, self.state.global_state)

    def extra_results(self) -> dict:
        """Method-specific entries of results.json."""
        return {}

    def personalize(self, last: int, best: dict) -> dict:
        """After training, before the final test (e.g. FT's local fine-tuning of ``best``). Returns its entries of
        results.json; default nothing."""
        return {}

    def after_test(self, results: dict) -> dict:
        """After the final test, before results are written (e.g. IOP-FL's routing bundle). Returns the entries it
        adds to ``results`` (read only); default nothing."""
        return {}

    def finish(self) -> None:
        last = self.n_rounds()
        try:
            val = self.send_each("validate", {s: self.message(last, self.final_params(s)) for s in self.sites})
            if self.final_params(self.sites[0]):
                self.track_best(last, val, self.state.global_state)
            best = prefixed(GLOBAL, self.state.best_state) if self.state.best_state else {}
            personalized = self.personalize(last, best)
            save_file(self.store.final_path, self.checkpoint(last))  # the models the final test scores, for bundles
            tested = self.send_each("test", {s: self.message(last, best) for s in self.sites})
            results = {
                "job": self.cfg["name"], "method": self.cfg["method"], "rounds": self.cfg["rounds"],
                "sites": self.sites,
                "best_global_round": self.state.best["round"], "missing": self.missing,
                "history": self.state.history,
                "test": {s: res.metrics["test"] for s, res in tested.items()}, "config": self.cfg,
                **self.extra_results(), **personalized,
                **guard.result_notes(self),
            }
            results.update(self.after_test(results))
        except RoundError as exc:
            self.panic(str(exc))
            return
        if not self.abort_signal.triggered:
            self.write_results(results)

    def write_results(self, results: dict) -> None:
        """``results.json`` into the server's state folder and FLARE's run folder, each written atomically; beside
        it FLARE's ``metrics/metrics_summary.json`` and ``metrics/round_metrics.jsonl`` (after training)."""
        text = json.dumps(results, indent=1, sort_keys=True)
        summary = metrics_files.summary(results)  # and FLARE 2.9's metrics/ files (pflseg.flare.metrics_files)
        for folder in (self.store.root, Path(self.get_run_dir())):
            write_text(folder / "results.json", text)
            if summary is not None:
                write_text(folder / metrics_files.FOLDER / metrics_files.SUMMARY, json.dumps(summary, indent=2))
                write_text(folder / metrics_files.FOLDER / metrics_files.ROUNDS,
                           metrics_files.round_lines(results["history"]))
        self.info(f"results written to {self.store.root / 'results.json'}")


class PostTrainingController(RoundController):
    """A job after training (FedSM inference, IOP-FL test-time routing): read the trained models from a
    bundle, send them to the sites once, write the sites' answers as ``results.json``. Subclasses implement
    ``post_training() -> results`` (RoundError and ValueError end the job with the reason in the log)."""

    def setup(self) -> int | None:
        fobs.register(TensorDecomposer)
        sites = self.sample_clients()
        try:
            self.cfg = check_effective(self.config, "server job config")
            self.check_config(self.cfg, "server job config")
            return self.init_state(self.cfg, sites, self.open_store())
        except (ValueError, StateError) as exc:
            self.panic(str(exc))
            return None

    def init_state(self, cfg: dict, sites: list[str], store: RoundStore) -> int:
        """A post-training job's state: the job config, the sites (sorted), the state folder; no rounds to restore."""
        self.cfg, self.sites, self.store = cfg, sorted(sites), store
        self.state = ServerState(self.sites)
        self.state.add("history", [])
        self.state.add("missing", {})
        self.state.add("n_first", {})
        return 0

    def run_rounds(self) -> None:
        if self.setup() is None:
            return
        try:
            results = self.post_training()
        except (RoundError, ValueError, StateError) as exc:
            self.panic(str(exc))
            return
        self.write_results({"job": self.cfg["name"], "method": self.cfg["method"], "sites": self.sites,
                            "missing": self.missing, "history": [], "config": self.cfg, **results})

    def post_training(self) -> dict:
        raise NotImplementedError

    def bundle_folder(self, key: str) -> Path:
        """The folder named by config ``key`` (``fedsm.bundle``, ``iopfl.bundle``): another job's server state
        folder, which must lie inside this server's state root (the parent of its own state folder) or inside
        a folder the server's operator lists in ``$PFLSEG_BUNDLE_ROOTS`` (os.pathsep-separated; the server's
        environment, never the job). The job's submitter cannot make the server read files elsewhere."""
        section, name = key.split(".")
        value = self.cfg[section][name]
        roots = [self.store.root.parent] + [Path(p)
                                            for p in os.environ.get("PFLSEG_BUNDLE_ROOTS", "").split(os.pathsep) if p]
        if value and not any(inside(value, root) for root in roots):
            extra = f" or in $PFLSEG_BUNDLE_ROOTS ({', '.join(map(str, roots[1:]))})" if roots[1:] else ""
            raise ValueError(f"{key}={value!r} is not a folder inside the server's state root {roots[0]}{extra}: a "
                             "bundle "
                             "must be a trained job's server state folder of this deployment (the server's operator "
                             "may allow more folders with PFLSEG_BUNDLE_ROOTS)")
        if value:  # deployed: the trained job's submitter (or study) must be this job's (policy.check_bundle_origin)
            check_bundle_origin("the server", Path(value), self.flare_job_id(), key)
        return Path(value)
