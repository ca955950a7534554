"""The site side of every pflseg job: ``Site`` holds what all methods share, a method's site class
(``pflseg.flare.sites.<method>``) overrides a few hooks and adds its own tasks.

The round skeleton (``Site.run_round``; task ``train`` runs it with the method's ``step``)::

    seed = derive_seed(seed, site, r)          # everything seeded; a fresh job clears old state at round 0
    prev = previous(r)                         # the site's latest completed state ({} in round 0); the one
                                               #   "no state before round r" error when the method ``keeps`` one
    send, keep, metrics, n = step(received, prev, seed)  # the method's round; ``training_time`` marks its training
    save keep as round r's state; reply(send, metrics + train_seconds, n)  # the Outgoing; the site's one exit
                                                                           #   (pflseg.flare.outbox) sends it

The default ``step`` (FedAvg and the methods built like it: FedProx, FedBN, Local, FT, GRACE, Centralized)::

    model = model_for_round(received, prev)    # the method's model for this site now
    before = score_before(model, r)            # validation Dice of what the site received
    hooks = round_hooks(model, prev)           # the method's plug-ins to the one training loop
    fit(...)                                   # the one loop (pflseg.train.train_epochs)
    after = score_after(model, r); send upload(trained), keep the trained model and its optimizer state

The job's configuration arrives from the server (``meta["pflseg"]``); the site's data, device and state
folder come from its own local settings (``pflseg.flare.settings``). Everything kept between rounds is on
disk (``pflseg.flare.state``), so results do not depend on the simulator's thread count.

A round starts from the site's latest completed state, not necessarily the previous round's: a site left
out of a round (slow, failed, disk full) is sent the next round's task again and continues from what it
last completed; an unreadable state file (truncated) is named in the log and the round before it is used.
Run in FLARE, the site claims its state folder for the job's id (``pflseg.flare.state.claim``). A task returns an
``Outgoing`` (``reply``), never a reply of its own: the site's one exit (``pflseg.flare.outbox.leave``) applies the
site's policy, the privacy path (``pflseg.flare.privacy``: public metrics, ``privacy.update``'s diff, clip and DP
noise) and the error-text rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from nvflare.app_common.abstract.fl_model import FLModel
from torch.utils.data import ConcatDataset

from pflseg.data import DataError, load_dataset_info, pooled_dataset, site_dataset
from pflseg.data.check import empty_split_error
from pflseg.flare.outbox import Outgoing
from pflseg.flare.privacy import Pseudonyms, public_text, report_local
from pflseg.flare.settings import resolve_data, site_settings
from pflseg.flare.state import RoundStore, StateError, claim, file_stamp, load_file, save_file, state_dir
from pflseg.flare.wire import GLOBAL, PERSON, prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.train import (
    Hooks,
    build_loss,
    build_optimizer,
    derive_seed,
    evaluate,
    make_loader,
    peak_gpu_memory,
    pick_device,
    seed_everything,
    train_epochs,
)
from pflseg.train.evaluate import adabn, batch_norms
from pflseg.train.overlays import write_overlays

log = logging.getLogger("pflseg.client")


def cpu_state(model: torch.nn.Module) -> dict:
    """A detached CPU copy of ``model``'s state (what is saved and sent)."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def trained_metrics(scores: dict, stats: dict, own: dict | None = None, extra: dict | None = None) -> dict:
    """A training round's metrics as every method's site reports them (``Step.metrics``; the server keeps them as
    the round's ``site_metrics`` in results.json's history, and ``round_metrics.jsonl`` lists them in this order):
    ``scores`` (the round's validation Dice, ``val_dice`` of the received model first), ``train_loss`` (the loop's
    mean loss, from its ``stats``), the method's ``own`` numbers of training, ``n_samples`` and ``steps`` (the
    loop's), then ``extra`` (numbers measured after training)."""
    return {**scores, "train_loss": stats["loss"], **(own or {}), "n_samples": stats["samples"],
            "steps": stats["steps"], **(extra or {})}


class Step(NamedTuple):
    """What a method's round step hands the skeleton (``Site.run_round``)."""

    send: dict  # what the site sends (``reply``; the site's exit applies privacy.update to it)
    keep: dict  # the site's state of this round, saved on disk (``RoundStore``); unused by tasks without state
    metrics: dict  # the round's metrics; the skeleton adds ``train_seconds``
    n_samples: int | None  # the update's weight n_k; None: the reply is no model update


class Site:
    """One site's side of a pflseg job: data, model and state on disk.

    Args:
        job_id: the FLARE job's id (``flare.get_job_id()``): the site claims its state folder for it (owner,
            lock, an earlier job's state moved aside). None (sites called in-process, e.g. tests): no claim.

    Attributes:
        personalized: True when the site's model is its own (tables report the site's best model);
            False when it is the server's global model.
        exchanges_models: whether what the site receives while training is made from the other sites' models (a
            deployed site refuses such a job of exactly two sites unless its policy allows it:
            ``pflseg.flare.policy``).
        keeps: what of the site's model lives only in its state on disk, in words (every round after its first
            needs it: ``previous``); None: the site's model is made from what it receives.
    """

    personalized = True
    exchanges_models = True
    keeps: str | None = None

    @classmethod
    def personal_models_sent(cls, cfg: dict) -> str | None:
        """What of the site's personalized model a job of config ``cfg`` sends, in words (the site's policy may
        refuse it: ``publish``); None: nothing."""
        return None

    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        self.name, self.cfg, self.sites, self.job_id = name, cfg, sites, job_id
        self.settings = site_settings(name)
        self.device = pick_device(self.settings["device"])
        if self.settings["threads"]:
            torch.set_num_threads(self.settings["threads"])
        self.pool_sites = self.pooled_sites()
        self.root, self.data_site = resolve_data(name, self.settings, cfg["data"], sites=self.pool_sites)
        info = load_dataset_info(self.root)
        if len(info["classes"]) != cfg["net"]["out_channels"] or info["in_channels"] != cfg["net"]["in_channels"]:
            raise DataError(
                f"site {name}: data {self.root} has {info['in_channels']} image channel(s) and classes "
                f"{info['classes']}, "
                f"but the job's network takes net.in_channels={cfg['net']['in_channels']} and predicts "
                f"net.out_channels={cfg['net']['out_channels']}; use a job config made for this data"
            )
        folder = state_dir(name, cfg["name"], self.settings["state_dir"])
        if job_id is not None:
            moved = claim(folder, job_id, cfg["resume"])
            if moved:
                log.info("site %s: job %s starts afresh; the earlier job's state is now in %s", name, job_id, moved)
        self.store = RoundStore(folder)
        self.best_path = self.store.root / "best.pt"
        self._best: tuple = (None, None)  # (file_stamp, score) of best.pt as this site last read or wrote it
        self.pseudonyms = Pseudonyms(self.store.root.parent)
        self._told: set = set()  # fall-backs already named in the log
        self.net = build_net(cfg["net"])
        self._data: dict = {}
        self._train_s = 0.0  # the running round's training time (``training_time``)

    def pooled_sites(self) -> list[str] | None:
        """Sites whose training data this site pools (Centralized); None: its own data only."""
        return None

    @classmethod
    def pools(cls) -> bool:
        """Whether this method's site may pool other sites' data (its class overrides ``pooled_sites``)."""
        return cls.pooled_sites is not Site.pooled_sites

    # ---- data -----------------------------------------------------------------------------------
    def data(self, split: str, own: bool = False):
        """The site's ``split``; a pooling site (``pooled_sites``) gets every pooled site's training and validation
        data, unless ``own``."""
        pooled = bool(self.pool_sites) and split in ("training", "validation") and not own
        if (split, pooled) not in self._data:
            size, fg = self.cfg["data"]["size"], self.cfg["data"]["foreground_only"] and split == "training"
            if pooled:
                data = pooled_dataset(self.root, self.pool_sites, split, size=size, foreground_only=fg)
            else:
                data = site_dataset(self.root, self.data_site, split, size=size, foreground_only=fg)
            if len(data) == 0 and not pooled:  # the words of `pflseg data check` and `data index`
                raise empty_split_error(self.root, self.data_site, split)
            if len(data) == 0:
                raise DataError(f"site {self.name}: the {split} split of the pooled sites {self.pool_sites} is empty. "
                                "Fix: give every site at least 3 cases (training, validation and test each get one)")
            self._data[split, pooled] = data
        return self._data[split, pooled]

    def all_images(self):
        """Every image of the site (an outside site's post-training jobs); an empty split is named in the log."""
        parts = []
        for split in ("training", "validation", "testing"):
            try:
                parts.append(self.data(split))
            except DataError as exc:  # FLARE's log gets codes and pseudonyms; the detail stays in the site-local log
                public = report_local(exc, self.name, "all_images", self.store.root.parent, self.pseudonyms)
                log.info("site %s: without split %s (%s)", self.name, split, public)
        if not parts:
            raise DataError(f"site {self.name}: no images in {self.root / self.data_site}; add the site's images")
        return ConcatDataset(parts)

    def evaluate(self, model, split: str = "validation", surface: bool = False) -> dict:
        train = self.cfg["train"]
        return evaluate(model, self.data(split), self.device, train["eval_batch_size"], surface=surface,
                        amp=train["amp"], channels_last=train["channels_last"])

    # ---- tasks ----------------------------------------------------------------------------------
    def tasks(self) -> dict:
        """Task name -> handler: the tasks this method's sites answer."""
        return {"train": self.train, "validate": self.validate, "test": self.test}

    # ---- the round skeleton ---------------------------------------------------------------------
    def train(self, msg: FLModel) -> Outgoing:
        """Task ``train``: the round skeleton with the method's ``step``."""
        return self.run_round(msg, self.step)

    def run_round(self, msg: FLModel, step: Callable[[FLModel, dict, int], Step], state: bool = True) -> Outgoing:
        """The round skeleton: round ``r = msg.current_round`` seeded from (seed, site, r), ``step(msg, prev, seed)``
        run on the site's state before round ``r`` (``previous``), the time spent in its ``training_time`` reported
        as ``train_seconds``, its ``keep`` saved as the site's state of round ``r``, its ``send`` and metrics
        replied (``reply``; the site's exit applies privacy.update).

        A fresh job (not ``resume``) clears the site's old state at round 0. ``state=False``: a task outside the
        rounds' state (FedSM-extra's selector rounds, FT's fine-tuning): no previous state (``prev`` = {}), nothing
        saved.
        """
        r = msg.current_round
        if state and r == 0 and not self.cfg["resume"]:
            self.store.clear()
            self.best_path.unlink(missing_ok=True)
        seed = derive_seed(self.cfg["seed"], self.name, r)
        seed_everything(seed)
        prev = self.previous(r) if state else {}
        self._train_s = 0.0
        out = step(msg, prev, seed)
        if state:
            self.store.save(r, {"round": r, **out.keep})
        metrics = {**out.metrics, "train_seconds": self._train_s}
        peak = peak_gpu_memory(self.device)  # since the round's last local training began; None on a CPU: no key
        if peak is not None:
            metrics["peak_gpu_mib"] = peak / 2**20
        return self.reply(out.send, metrics, out.n_samples, received=msg)

    @contextmanager
    def training_time(self) -> Iterator[None]:
        """The time spent inside counts as the round's training (``train_seconds``, reported by ``run_round``)."""
        t0 = time.time()
        try:
            yield
        finally:
            self._train_s += time.time() - t0

    def previous(self, r: int) -> dict:
        """The site's latest completed state before round ``r`` (``latest_state``; {} in round 0).

        A site that ``keeps`` part of its model there and finds no state in a later round either ``joins_late``
        ({}: it starts from what it receives) or, in a resumed job, raises the error naming its state folder.
        """
        if r <= 0:
            return {}
        state = self.latest_state(r)[1]
        if self.keeps and not state and not self.joins_late(r):
            raise RuntimeError(
                f"site {self.name}: no state before round {r} in {self.store.root} (it keeps {self.keeps} there); "
                "the site state was removed or the job was resumed at another site"
            )
        return state

    def latest_state(self, r: int) -> tuple[int | None, dict]:
        """``(round, state)`` of the site's latest completed round before round ``r``; ``(None, {})`` when none.

        Normally round ``r - 1``; an earlier one when the site was left out of rounds (its state stays as it
        last was). A file that cannot be read (``StateError``, e.g. truncated) is named in the log and the round
        before it is used; when none before it can be read, that StateError is raised.
        """
        error = None
        for done in sorted((x for x in self.store.rounds() if x < r), reverse=True):
            try:
                state = self.store.load(done)
            except StateError as exc:
                if ("bad", r, done) not in self._told:
                    log.warning("site %s: %s; falling back to the round before it", self.name,
                                public_text(str(exc), self.store.root.parent, self.pseudonyms))
                    self._told.add(("bad", r, done))
                error = error or exc
                continue
            if done < r - 1 and ("from", r, done) not in self._told:
                log.info("site %s: round %d continues from the site's state of round %d (its latest completed one)",
                         self.name, r, done)
                self._told.add(("from", r, done))
            return done, state
        if error is not None:
            raise error
        return None, {}

    def joins_late(self, r: int) -> bool:
        """Whether the site starts round ``r > 0`` as if it were round 0: it has completed no round of this job
        (left out of every round so far, e.g. it timed out in round 0), so it has no own state yet and takes
        what the server sends, with a log line. Never in a resumed job (its state must be there)."""
        if r <= 0 or self.cfg["resume"] or self.store.rounds():
            return False
        if ("late", r) not in self._told:
            log.warning("site %s: round %d is its first completed round in this job (left out of every earlier one): "
                        "it starts from what the server sends, as in round 0", self.name, r)
            self._told.add(("late", r))
        return True

    def model_for_round(self, received: dict, prev: dict) -> torch.nn.Module:
        """The method's model for this site now, from the ``received`` params and the site's state ``prev``
        (``previous``; {}: what was received alone); default: the received global model."""
        self.net.load_state_dict({**self.net.state_dict(), **unprefixed(GLOBAL, received)})
        return self.net

    def track(self, model, round_num: int) -> dict:
        """Validation metrics of ``model``; it becomes the site's best model (``best.pt``: ``best_state``) if it
        scores higher. ``round_num``: the rounds the model has seen (0: the initial model, k: the model after round
        k, counted from 1: the received model of 0-based round r is r, the one trained in it r + 1), which the
        final test reports as ``selected_round``."""
        metrics = self.evaluate(model)
        best = self.best_score()
        if best is None or metrics["dice"] > best:
            save_file(self.best_path, {"round": round_num, "score": metrics["dice"], **self.best_state(model)})
            self._best = (file_stamp(self.best_path), metrics["dice"])
        return metrics

    def best_score(self) -> float | None:
        """The validation Dice ``best.pt`` holds (None: no best model yet); read from the file only when it is not
        the one this site last read or wrote."""
        stamp = file_stamp(self.best_path)
        if stamp is None:
            return None
        if self._best[0] != stamp:
            self._best = (stamp, load_file(self.best_path)["score"])
        return self._best[1]

    def best_state(self, model) -> dict:
        """What ``best.pt`` keeps of ``model`` besides its round and score: its weights (``model.``)."""
        return prefixed("model", cpu_state(model))

    def score_before(self, model, round_num: int) -> dict:
        """Before local training: the received model is a candidate for the site's best."""
        return self.track(model, round_num)

    def score_after(self, model, round_num: int) -> dict:
        """After local training: scored only."""
        return self.evaluate(model)

    def round_hooks(self, model, prev: dict) -> tuple[Hooks | None, torch.nn.Module | None]:
        """The method's plug-ins to the loop, and a module trained alongside (kept in the site state)."""
        return None, None

    def upload(self, trained: dict) -> dict:
        """What the site sends after training; default: the whole trained model as the global update."""
        return prefixed(GLOBAL, trained)

    def fit(self, model, name: str, prev: dict, seed: int, hooks: Hooks | None = None, lr: float | None = None,
            loss=None, batch_size: int | None = None, extra: torch.nn.Module | None = None,
            epochs: int | None = None) -> tuple[dict, dict]:
        """Train ``model`` with the one loop; Adam state ``optim.<name>`` carried over from ``prev``; ``extra``
        (e.g. GRACE's domain discriminator) trains in a second parameter group. Returns (loop stats, optimizer
        state)."""
        cfg = self.cfg["train"]
        state = prev.get(f"optim.{name}") if cfg["keep_optimizer_state"] else None
        if extra is not None:
            extra.to(self.device)
        optimizer = build_optimizer(model, self.device, lr or cfg["lr"], state,
                                    extra=list(extra.parameters()) if extra is not None else None)
        loader = make_loader(self.data("training"), batch_size or cfg["batch_size"], shuffle=True, seed=seed,
                             device=self.device)
        stats = train_epochs(model, loader, optimizer, loss or build_loss(cfg["loss"]), epochs or cfg["epochs"],
                             self.device, hooks, amp=cfg["amp"], channels_last=cfg["channels_last"])
        return stats, optimizer.state_dict()

    def reply(self, params: dict, metrics: dict, n_samples: int | None = None, received: FLModel | None = None,
              **meta) -> Outgoing:
        """What the site would send: ``params`` (the method's tensors), ``metrics`` and ``meta`` as an ``Outgoing``,
        which leaves through the site's one exit (``pflseg.flare.outbox.leave``: the site's policy, public metrics,
        ``privacy.update``; the error-text rule). A model update gives ``n_samples`` (its weight n_k) and
        ``received``, the task message it answers (``privacy.update``'s diff, clip and noise are taken against it).
        """
        return Outgoing(params, metrics, n_samples, received, meta)

    #: Prefixes of the model weights the server aggregates (the global model; FedSM's personalized models, mixed by
    #: SoftPull): the keys ``privacy.update.dp`` clips and noises (``pflseg.flare.privacy.private_update``). Anything
    #: else a method sends (FedSM's selector, its Adam moments, gradients or LDA statistics; LC-Fed's coarse head)
    #: goes as it is.
    dp_prefixes: tuple[str, ...] = (GLOBAL + ".", PERSON + ".")

    def running_variances(self) -> list[str]:
        """Keys of batch norm's running variances under every ``dp_prefixes`` prefix (found by module type)."""
        names = [n for n, m in self.net.named_modules() if m in batch_norms(self.net)]
        return [f"{p}{n}.running_var" for p in self.dp_prefixes for n in names]

    def step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """A FedAvg-like round: the method's model (``model_for_round``) scored, trained with the one loop and the
        method's hooks, scored again; sends ``upload(trained)``, keeps the trained model, its optimizer state and
        the module trained alongside (``disc.``)."""
        r = received.current_round
        model = self.model_for_round(received.params, prev)
        before = self.score_before(model, r)
        with self.training_time():
            hooks, extra = self.round_hooks(model, prev)
            stats, optim = self.fit(model, "model", prev, seed, hooks, extra=extra)
        trained = cpu_state(model)
        kept = prefixed("disc", cpu_state(extra)) if extra is not None else {}
        after = self.score_after(model, r)
        metrics = trained_metrics({"val_dice": before["dice"], "val_dice_local": after["dice"]}, stats,
                                  extra=self.round_metrics())
        return Step(self.upload(trained), {"optim.model": optim, **prefixed("model", trained), **kept}, metrics,
                    stats["samples"])

    def round_metrics(self) -> dict:
        """Method-specific numbers of the round, added to the reply's metrics."""
        return {}

    # ---- after training -------------------------------------------------------------------------
    def validate(self, msg: FLModel) -> Outgoing:
        """Score the model the site would use now (made from the received final global model and, if the site
        ``keeps`` part of it, its latest state) and track it."""
        r = msg.current_round
        model = self.model_for_round(msg.params, self.previous(r) if self.keeps else {})
        return self.reply({}, {"val_dice": self.track(model, r)["dice"]})

    def test(self, msg: FLModel) -> Outgoing:
        """Test metrics of the server's selected global model (if the method has one; with ``train.adabn`` also
        ``global_adabn``, see ``adabn``) and of the site's best own model; overlays of the best and worst test
        cases of the model the tables report for this site (own best if ``personalized``, else the global model)
        in ``<state>/overlays/`` (they stay at the site)."""
        metrics, shown = {}, None
        if unprefixed(GLOBAL, msg.params or {}):
            self.net.load_state_dict({**self.net.state_dict(), **unprefixed(GLOBAL, msg.params)})
            metrics["global"] = self.evaluate(self.net, "testing", surface=True)
            if not self.personalized:
                shown = self.draw_overlays(self.net, metrics["global"])
            if self.cfg["train"]["adabn"] and self.adabn(self.net):
                metrics["global_adabn"] = self.evaluate(self.net, "testing", surface=True)
        best = load_file(self.best_path)
        self.net.load_state_dict(unprefixed("model", best))
        metrics["site"] = {**self.evaluate(self.net, "testing", surface=True), "selected_round": best["round"]}
        if shown is None:
            self.draw_overlays(self.net, metrics["site"])
        return self.reply({}, {"test": metrics})

    def adabn(self, model) -> bool:
        """AdaBN (``pflseg.train.evaluate.adabn``): ``model``'s batch-norm running statistics re-estimated, in place,
        on the site's own training images (a pooling site's too: its own). False, with a log line, when the net
        has no batch-norm statistics (instance norm): nothing to re-estimate."""
        if not batch_norms(model):
            log.info("site %s: no global_adabn: net.norm=%s keeps no batch-norm statistics to re-estimate",
                     self.name, self.cfg["net"]["norm"])
            return False
        train = self.cfg["train"]
        loader = make_loader(self.data("training", own=True), train["eval_batch_size"], shuffle=False,
                             device=self.device)
        adabn(model, loader, self.device, amp=train["amp"], channels_last=train["channels_last"])
        return True

    def draw_overlays(self, model, scored: dict) -> list:
        """Overlays of ``model`` on the test split, cases ranked by ``scored["per_case"]`` (its test metrics),
        into ``<state>/overlays/``; returns the paths. A failure is logged, never fatal to the test task."""
        try:
            return write_overlays(model, self.data("testing"), self.device, self.store.root / "overlays",
                                  scored["per_case"], site=self.name, amp=self.cfg["train"]["amp"])
        except Exception as exc:  # noqa: BLE001 - the test metrics matter more than the pictures
            public = report_local(exc, self.name, "overlays", self.store.root.parent, self.pseudonyms)
            logging.getLogger("pflseg.site").warning("site %s: no overlays written (%s)", self.name, public)
            return []
