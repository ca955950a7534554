"""Shared machinery of pflseg's server workflows (FLARE ModelController).

A method's controller implements ``round(r)``; this base gives it: ``setup()`` (config, sites, restore), the validated job config, one send per
site with its own payload (``send_each``), update checks (NaN/Inf, shapes), min_clients, round
checkpoints with resume, best-global tracking on validation Dice, the final validate + test phase and
``results.json``. Everything the server keeps between rounds is in the checkpoint, so a stopped job
resumes from its last completed round.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.app_opt.pt.decomposers import TensorDecomposer
from nvflare.fuel.utils import fobs

from pflseg.config import check_effective
from pflseg.flare.state import RoundStore, StateError, prefixed, save_file, state_dir, unprefixed
from pflseg.nets import build_net
from pflseg.train.loop import seed_everything


class RoundError(RuntimeError):
    """Too few sites answered a task."""


def check_update(params: dict, reference: dict) -> str | None:
    """Why a site's update cannot be used (unknown key, wrong shape, NaN/Inf), or None if it is fine.

    ``reference`` maps every key a site may send (flat, prefixed: "global.x", "person.x", ...) to a tensor
    of the expected shape.
    """
    for key, value in params.items():
        if key not in reference:
            return f"unexpected key '{key}'"
        if not torch.is_tensor(value):
            return f"'{key}' is {type(value).__name__}, not a tensor"
        if tuple(value.shape) != tuple(reference[key].shape):
            return f"'{key}' has shape {tuple(value.shape)}, expected {tuple(reference[key].shape)}"
        if value.is_floating_point() and not torch.isfinite(value).all():
            return f"'{key}' contains NaN or Inf"
    return None


class RoundController(ModelController):
    """Base of every pflseg workflow: ``run()`` = restore, rounds, final test, results."""

    def __init__(self, config: dict, task_check_period: float = 0.2):
        super().__init__(persistor_id="", ignore_result_error=True, task_check_period=task_check_period)
        self.config = config
        self.task_check_period = task_check_period

    # ---- the workflow ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: dict) -> None:
        """The method's own config rules (beyond the schema); raise ConfigError naming the key and the fix."""

    def setup(self) -> int | None:
        """Everything before the first round: validated config, connected sites, state folder, network size,
        restored checkpoint. Returns the first round to run, or None after a panic (named in the log)."""
        fobs.register(TensorDecomposer)  # messages carry torch tensors end to end
        self.cfg = check_effective(self.config, "server job config")
        self.sites = sorted(self.sample_clients())
        if len(self.sites) < self.cfg["min_clients"]:
            self.panic(f"{len(self.sites)} site(s) connected but min_clients={self.cfg['min_clients']}")
            return None
        self.store = RoundStore(state_dir("server", self.cfg["name"]))
        self.missing: dict[str, str] = {}
        self.site_metrics: dict = {}
        try:
            self.check_config(self.cfg)
            self.size_net()
            return self.restore()
        except (ValueError, RuntimeError) as exc:  # bad method settings for this federation, corrupt checkpoint
            self.panic(str(exc))
            return None

    def run(self) -> None:
        start = self.setup()
        if start is None:
            return
        for r in range(start, self.n_rounds()):
            t0 = time.time()
            self.info(f"round {r + 1}/{self.n_rounds()}: sites {self.sites}")
            try:
                compute = self.round(r)
            except RoundError as exc:
                self.panic(str(exc))
                return
            if self.abort_signal.triggered:
                return
            wall = time.time() - t0
            self.history.append({"round": r, "wall_seconds": wall, "site_compute_seconds": compute,
                                 "site_metrics": self.site_metrics, **self.round_metrics})
            self.store.save(r, self.checkpoint(r))
            self.info(f"round {r + 1} done in {wall:.2f} s (site compute max {max(compute.values(), default=0):.2f} s)")
        self.finish()

    def size_net(self) -> None:
        """LC-Fed's net has one site embedding per site: ``net.n_sites: 0`` becomes the number of sites."""
        net = self.cfg["net"]
        if net["name"] != "lcfed":
            return
        if net["n_sites"] == 0:
            net["n_sites"] = len(self.sites)
        elif net["n_sites"] < len(self.sites):
            raise ValueError(f"net.n_sites={net['n_sites']} but {len(self.sites)} sites joined ({self.sites}); "
                             "set net.n_sites: 0 (one site embedding per connected site)")

    def round(self, r: int) -> dict:
        """Run round ``r``: send, collect, aggregate. Returns per-site compute seconds."""
        raise NotImplementedError

    def n_rounds(self) -> int:
        return self.cfg["rounds"]

    # ---- state ----------------------------------------------------------------------------------
    def initial_state(self) -> dict:
        seed_everything(self.cfg["seed"])
        return {k: v.detach().clone() for k, v in build_net(self.cfg["net"]).state_dict().items()}

    def restore(self) -> int:
        """Load the last completed round when resuming; else start fresh. Returns the first round to run."""
        self.global_state = self.initial_state()
        self.history, self.best, self.best_state = [], {"round": -1, "score": -1.0}, {}
        latest = self.store.latest()
        if not self.cfg["resume"] or latest is None:
            self.store.clear()
            return 0
        ckpt = self.store.load(latest)
        self.global_state.update(unprefixed("global", ckpt))
        self.best_state = unprefixed("best", ckpt)
        self.history, self.best = list(ckpt["history"]), dict(ckpt["best"])
        self.info(f"resuming after round {latest + 1} from {self.store.path(latest)}")
        return latest + 1

    def checkpoint(self, r: int) -> dict:
        return {"round": r, "history": self.history, "best": self.best,
                **prefixed("global", self.global_state), **prefixed("best", self.best_state)}

    def track_best(self, r: int, results: dict[str, FLModel], state: dict) -> None:
        """Keep the global model with the best n_k-weighted validation Dice (scored at the sites)."""
        scores = [(res.metrics["val_dice"], res.meta.get("NUM_STEPS_CURRENT_ROUND", 1) or 1) for res in results.values()]
        score = sum(s * n for s, n in scores) / sum(n for _, n in scores)
        self.round_metrics = {"val_dice": {s: res.metrics["val_dice"] for s, res in results.items()}, "val_dice_mean": score}
        if score > self.best["score"]:
            self.best, self.best_state = {"round": r, "score": score}, dict(state)

    def log_scalars(self, tag: str, values: dict[str, float], step: int) -> None:
        """Server-side TensorBoard scalars (``tb_events/<server name>``) through FLARE's analytics receiver."""
        with self.engine.new_context() as fl_ctx:
            dxo = create_analytic_dxo(tag, {k: float(v) for k, v in values.items()}, AnalyticsDataType.SCALARS, global_step=step)
            send_analytic_dxo(self, dxo, fl_ctx)

    # ---- messaging ------------------------------------------------------------------------------
    def message(self, r: int, params: dict | None = None, **meta) -> FLModel:
        return FLModel(params=params or {}, params_type=ParamsType.FULL, current_round=r,
                       total_rounds=self.n_rounds(), meta={"pflseg": self.cfg, "sites": self.sites, **meta})

    def send_each(self, task: str, payloads: dict[str, FLModel], reference: dict | None = None) -> dict[str, FLModel]:
        """Send each site its own payload; wait; return usable results by site (sorted).

        A site that fails, times out, reports an error or sends an unusable update is named in the log and
        in ``self.missing``; fewer than ``min_clients`` usable answers raise RoundError. A site that gave
        no result at all (crashed, disconnected, timed out) is out for the rest of the job: it gets no
        further tasks (no more waiting for a dead site), its personalized state stays as it last was.
        """
        results: dict[str, FLModel] = {}
        gone = getattr(self, "gone", set())
        for site in sorted(set(payloads) & gone):
            self.error(f"{task}: site {site} left out: out of the job since it stopped answering")
        need = min(self.cfg["min_clients"], len(payloads))
        payloads = {s: p for s, p in payloads.items() if s not in gone}

        def collect(result: FLModel):
            results[result.meta.get("client_name", "?")] = result

        for site, data in payloads.items():
            self.send_model(task_name=task, data=data, targets=[site], timeout=self.cfg["task_timeout"], callback=collect)
        while self.get_num_standing_tasks():
            if self.abort_signal.triggered:
                return {}
            time.sleep(self.task_check_period)
        usable = {}
        self.site_metrics = {}
        for site in sorted(payloads):
            res = results.get(site)
            reason = None
            if res is None:
                reason = "no result (site failed, disconnected or timed out)"
                gone.add(site)
                self.gone = gone
            elif res.meta.get("pflseg_error"):
                reason = res.meta["pflseg_error"]
            elif reference is not None:
                reason = check_update(res.params or {}, reference)
            if reason:
                self.error(f"{task}: site {site} left out of this round: {reason}")
                self.missing[site] = reason
            else:
                usable[site] = res
                self.site_metrics[site] = {k: v for k, v in (res.metrics or {}).items()
                                           if isinstance(v, (int, float)) and k != "compute_seconds"}
        if len(usable) < need:
            raise RoundError(
                f"task '{task}': only {len(usable)} of {len(payloads)} site(s) answered usably, min_clients={need}. "
                f"Problems: " + "; ".join(f"{s}: {m}" for s, m in self.missing.items())
            )
        return usable

    # ---- end of training ------------------------------------------------------------------------
    def final_params(self, site: str) -> dict:
        """What the final validate task carries to ``site`` (the global model; empty for methods without one)."""
        return prefixed("global", self.global_state)

    def extra_results(self) -> dict:
        """Method-specific entries of results.json."""
        return {}

    def personalize(self, last: int, best: dict) -> None:
        """After training, before the final test (e.g. FT's local fine-tuning of ``best``); default nothing."""

    def after_test(self, results: dict) -> None:
        """After the final test, before results are written (e.g. IOP-FL's routing bundle); may add entries."""

    def finish(self) -> None:
        last = self.n_rounds()
        try:
            val = self.send_each("validate", {s: self.message(last, self.final_params(s)) for s in self.sites})
            if self.final_params(self.sites[0]):
                self.track_best(last, val, self.global_state)
            best = prefixed("global", self.best_state) if self.best_state else {}
            self.personalize(last, best)
            save_file(self.store.final_path, self.checkpoint(last))  # the models the final test scores, for bundles
            tested = self.send_each("test", {s: self.message(last, best) for s in self.sites})
            results = {
                "job": self.cfg["name"], "method": self.cfg["method"], "rounds": self.cfg["rounds"], "sites": self.sites,
                "best_global_round": self.best["round"], "missing": self.missing, "history": self.history,
                "test": {s: res.metrics["test"] for s, res in tested.items()}, "config": self.cfg, **self.extra_results(),
            }
            self.after_test(results)
        except RoundError as exc:
            self.panic(str(exc))
            return
        if not self.abort_signal.triggered:
            self.write_results(results)

    def write_results(self, results: dict) -> None:
        """``results.json`` into the server's state folder and FLARE's run folder, each written atomically."""
        text = json.dumps(results, indent=1, sort_keys=True)
        for folder in (self.store.root, Path(self.get_run_dir())):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / "results.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, folder / "results.json")
        self.info(f"results written to {self.store.root / 'results.json'}")


class PostTrainingController(RoundController):
    """A job after training (FedSM inference, IOP-FL test-time routing): read the trained models from a
    bundle, send them to the sites once, write the sites' answers as ``results.json``. Subclasses implement
    ``post_training() -> results`` (RoundError and ValueError end the job with the reason in the log)."""

    def setup(self) -> int | None:
        fobs.register(TensorDecomposer)
        self.cfg = check_effective(self.config, "server job config")
        self.sites, self.missing, self.history = sorted(self.sample_clients()), {}, []
        self.store = RoundStore(state_dir("server", self.cfg["name"]))
        return 0

    def run(self) -> None:
        self.setup()
        try:
            results = self.post_training()
        except (RoundError, ValueError, StateError) as exc:
            self.panic(str(exc))
            return
        self.write_results({"job": self.cfg["name"], "method": self.cfg["method"], "sites": self.sites,
                            "missing": self.missing, "history": [], "config": self.cfg, **results})

    def post_training(self) -> dict:
        raise NotImplementedError
