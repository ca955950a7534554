"""The single FLARE Client API script of pflseg: every job's sites run this file.

    flare.init(); while flare.is_running(): model = flare.receive(); dispatch on the task name; flare.send()

Tasks: ``train`` (one round of local training with the method's hook), ``validate`` (score the model the
site would use now on its validation split), ``test`` (score the selected models on the test split),
``submit_model`` (return the site's best own model). The job's configuration arrives from the server
in ``meta["pflseg"]``; the site's data, device and state folder come from its own local settings
(``pflseg.flare.site``). Everything kept between rounds is on disk (``pflseg.flare.state``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import time

import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from pflseg.algorithms.alignment import DomainDiscriminator, adversarial_alignment, coral, mmd
from pflseg.algorithms.fedbn import norm_keys
from pflseg.algorithms.fedprox import proximal_term
from pflseg.algorithms.grace_meta import feature_layer, meta_step, unet_features
from pflseg.algorithms.fedsm import (
    flatten_optimizer_state,
    selector_labels_extra,
    selector_labels_fedsm,
    unflatten_optimizer_state,
)
from pflseg.config import check_effective
from pflseg.data import DataError, load_dataset_info, pooled_dataset, site_dataset
from pflseg.eval.fedsm_inference import evaluate_super_model
from pflseg.flare.site import resolve_data, site_settings
from pflseg.flare.state import RoundStore, load_file, prefixed, save_file, state_dir, unprefixed
from pflseg.nets import build_net
from pflseg.nets.selector import build_selector, selector_cfg
from pflseg.train import Hooks, build_loss, derive_seed, evaluate, make_loader, pick_device, seed_everything, train_epochs

log = logging.getLogger("pflseg.client")


class Site:
    """One site's side of a pflseg job: data, model and state on disk."""

    def __init__(self, name: str, cfg: dict, sites: list[str]):
        self.name, self.cfg, self.sites = name, cfg, sites
        self.method = cfg["method"]
        self.settings = site_settings(name)
        self.device = pick_device(self.settings["device"])
        if self.settings["threads"]:
            torch.set_num_threads(self.settings["threads"])
        pool = self.method == "centralized" and name == sorted(sites)[0]
        self.root, self.data_site = resolve_data(name, self.settings, cfg["data"], sites=sites if pool else None)
        info = load_dataset_info(self.root)
        if len(info["classes"]) != cfg["net"]["out_channels"] or info["in_channels"] != cfg["net"]["in_channels"]:
            raise DataError(
                f"site {name}: data {self.root} has {info['in_channels']} image channel(s) and classes {info['classes']}, "
                f"but the job's network takes net.in_channels={cfg['net']['in_channels']} and predicts "
                f"net.out_channels={cfg['net']['out_channels']}; use a job config made for this data"
            )
        self.store = RoundStore(state_dir(name, cfg["name"], self.settings["state_dir"]))
        self.best_path = self.store.root / "best.pt"
        self.net = build_net(cfg["net"])
        if hasattr(self.net, "site"):  # LC-Fed's net: PCS uses this site's embedding
            self.net.site = sorted(sites).index(name)
        self.norm = norm_keys(self.net)
        self._data: dict = {}
        self.pool_sites = sites if pool else None
        log.info("site %s: data %s (folder %s), device %s, state %s", name, self.root, self.data_site, self.device, self.store.root)

    # ---- data -----------------------------------------------------------------------------------
    def data(self, split: str):
        if split not in self._data:
            size, fg = self.cfg["data"]["size"], self.cfg["data"]["foreground_only"] and split == "training"
            if self.pool_sites and split in ("training", "validation"):
                self._data[split] = pooled_dataset(self.root, self.pool_sites, split, size=size, foreground_only=fg)
            else:
                self._data[split] = site_dataset(self.root, self.data_site, split, size=size, foreground_only=fg)
            if len(self._data[split]) == 0:
                raise DataError(f"site {self.name}: split '{split}' of {self.root / self.data_site} is empty; "
                                f"re-split the data set so every site has {split} cases")
        return self._data[split]

    # ---- the model the site uses ----------------------------------------------------------------
    def own_state(self, round_num: int) -> dict | None:
        """The site's own model after round ``round_num`` (None before its first round)."""
        if round_num < 0:
            return None
        return unprefixed("model", self.store.load(round_num)) if round_num in self.store.rounds() else None

    def current_model(self, received: dict, round_num: int) -> torch.nn.Module:
        """The method's model for this site now: global (FedAvg...), global + own norm layers (FedBN), own (Local)."""
        state = dict(self.net.state_dict())
        glob = unprefixed("global", received)
        own = self.own_state(round_num - 1)
        if round_num > 0 and own is None and self.method in ("local", "fedbn"):
            raise RuntimeError(
                f"site {self.name}: no state for round {round_num - 1} in {self.store.root}; "
                "the site state was removed or the job was resumed at another site"
            )
        if self.method == "local" and own is not None:
            state.update(own)
        else:
            state.update(glob)
            if self.method == "fedbn" and own is not None:
                state.update({k: v for k, v in own.items() if k in self.norm})
        self.net.load_state_dict(state)
        return self.net

    def _validate_and_track(self, model, round_num: int) -> dict:
        metrics = evaluate(model, self.data("validation"), self.device, self.cfg["train"]["eval_batch_size"])
        best = load_file(self.best_path) if self.best_path.is_file() else None
        if best is None or metrics["dice"] > best["score"]:
            save_file(self.best_path, {"round": round_num, "score": metrics["dice"],
                                       **prefixed("model", {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})})
        return metrics

    # ---- tasks ----------------------------------------------------------------------------------
    def tasks(self) -> dict:
        """Task name -> handler; a method's Site subclass adds its own."""
        return {"train": self.train, "validate": self.validate, "test": self.test, "submit_model": self.submit_model,
                "train_selector": self.train_selector, "infer": self.infer, "finetune": self.finetune}

    def _fit(self, model, name: str, prev: dict, seed: int, hooks: Hooks | None = None,
             lr: float | None = None, loss=None, batch_size: int | None = None, extra: list | None = None,
             epochs: int | None = None) -> tuple[dict, dict]:
        """Train ``model`` with the one loop; Adam state ``optim.<name>`` carried over from ``prev``; ``extra``
        parameters (e.g. GRACE's domain discriminator) are a second group of the same optimizer.
        Returns (loop stats, optimizer state_dict)."""
        cfg = self.cfg["train"]
        groups = [{"params": list(model.parameters())}] + ([{"params": extra}] if extra else [])
        optimizer = torch.optim.Adam(groups, lr=lr or cfg["lr"])
        if cfg["keep_optimizer_state"] and f"optim.{name}" in prev:
            optimizer.load_state_dict(prev[f"optim.{name}"])
        loader = make_loader(self.data("training"), batch_size or cfg["batch_size"], shuffle=True, seed=seed)
        stats = train_epochs(model, loader, optimizer, loss or build_loss(cfg["loss"]), epochs or cfg["epochs"], self.device, hooks)
        return stats, optimizer.state_dict()

    def train(self, msg: FLModel) -> FLModel:
        r, cfg = msg.current_round, self.cfg
        if r == 0 and not cfg["resume"]:
            self.store.clear()
            self.best_path.unlink(missing_ok=True)
        seed = derive_seed(cfg["seed"], self.name, r)
        seed_everything(seed)
        prev = self.store.load(r - 1) if r > 0 and r - 1 in self.store.rounds() else {}
        if self.method == "fedsm":
            return self.train_fedsm(msg, r, seed, prev)
        model = self.current_model(msg.params, r)
        if self.method == "grace":
            val = evaluate(model, self.data("validation"), self.device, cfg["train"]["eval_batch_size"])
        else:
            val = self._validate_and_track(model, r)
        t0 = time.time()
        hooks, extra, saved = Hooks(), None, {}
        if self.method == "fedprox":
            anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
            mu = cfg["fedprox"]["mu"]
            hooks.extra_loss = lambda m, batch, logits: proximal_term(m, anchor, mu)
        if self.method == "grace" and cfg["grace"]["client"]:
            hooks.step, disc = self.grace_step(model, prev)
            if disc is not None:  # adversarial alignment: the discriminator trains with the model, stays at the site
                extra, saved = list(disc.parameters()), disc
        stats, optim = self._fit(model, "model", prev, seed, hooks, extra=extra)
        train_s = time.time() - t0
        trained = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        disc_state = prefixed("disc", _cpu(saved)) if extra else {}
        self.store.save(r, {"round": r, "optim.model": optim, **prefixed("model", trained), **disc_state})
        if self.method == "local":
            params = {}
        elif self.method == "fedbn":
            params = prefixed("global", {k: v for k, v in trained.items() if k not in self.norm})
        else:
            params = prefixed("global", trained)
        if self.method == "grace":  # GRACE's personalized model is the local model after training
            after = self._validate_and_track(model, r)
        else:
            after = evaluate(model, self.data("validation"), self.device, cfg["train"]["eval_batch_size"])
        metrics = {"val_dice": val["dice"], "val_dice_local": after["dice"], "train_loss": stats["loss"],
                   "train_seconds": train_s, "n_samples": stats["samples"]}
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=metrics,
                       meta={"NUM_STEPS_CURRENT_ROUND": stats["samples"], "site": self.name})

    def grace_step(self, model, prev: dict):
        """The GRACE meta step as the loop's custom step; the round's global model is frozen for alignment.
        Returns (step, discriminator or None); with ``align: adv`` the site's domain discriminator (kept in
        its state between rounds) is returned so that it joins the optimizer."""
        grace = self.cfg["grace"]
        frozen = build_net(self.cfg["net"])
        frozen.load_state_dict(model.state_dict())
        frozen.to(self.device).eval().requires_grad_(False)
        disc = None
        if grace["align"] == "adv":
            disc = DomainDiscriminator(feature_layer(model).in_channels)
            if unprefixed("disc", prev):
                disc.load_state_dict(unprefixed("disc", prev))
            disc.to(self.device)
            align = functools.partial(adversarial_alignment, disc)
        else:
            align = {"coral": coral, "mmd": mmd}[grace["align"]]
        step = functools.partial(meta_step, inner_lr=grace["inner_lr"], beta=grace["beta"], align_fn=align,
                                 global_model=frozen, feature_fn=unet_features, split=grace["split"])
        return step, disc

    def train_fedsm(self, msg: FLModel, r: int, seed: int, prev: dict) -> FLModel:
        """FedSM: train the global model, this site's personalized model and the selector (label k)."""
        cfg, bs = self.cfg, self.cfg["train"]["eval_batch_size"]
        person = build_net(cfg["net"])
        person.load_state_dict(unprefixed("person", msg.params))
        val_p = self._validate_and_track(person, r)  # the site's own best model is its personalized one
        glob = self.current_model(msg.params, r)
        val_g = evaluate(glob, self.data("validation"), self.device, bs)
        t0 = time.time()
        stats, optim_g = self._fit(glob, "global", prev, seed)
        _, optim_p = self._fit(person, "person", prev, seed)
        selector = build_selector(selector_cfg(cfg, len(self.sites)))
        label = int(msg.meta["selector_label"])
        sel_stats, sel_params = self._train_selector(
            selector, lambda batch: selector_labels_fedsm(label, batch["image"].shape[0], len(self.sites)), msg, seed)
        train_s = time.time() - t0
        self.store.save(r, {"round": r, "optim.global": optim_g, "optim.person": optim_p})
        params = {**prefixed("global", _cpu(glob)), **prefixed("person", _cpu(person)), **sel_params}
        metrics = {"val_dice": val_g["dice"], "val_dice_person": val_p["dice"], "train_loss": stats["loss"],
                   "selector_loss": sel_stats["loss"], "train_seconds": train_s, "n_samples": stats["samples"]}
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=metrics,
                       meta={"NUM_STEPS_CURRENT_ROUND": stats["samples"], "site": self.name})

    def _train_selector(self, selector, labels_of, msg: FLModel, seed: int) -> tuple[dict, dict]:
        """Train ``selector`` with cross-entropy against ``labels_of(batch)``, Adam moments from the server's
        average; full-batch (one step per epoch over summed gradients) or per-batch steps."""
        cfg = self.cfg
        selector.load_state_dict(unprefixed("select", msg.params))
        optimizer = torch.optim.Adam(selector.parameters(), lr=cfg["fedsm"]["selector_lr"])
        moments = unprefixed("moment", msg.params)
        if moments:
            optimizer.load_state_dict(unflatten_optimizer_state(moments, optimizer.state_dict()["param_groups"]))
        per_epoch = cfg["fedsm"]["selector_steps"] == "epoch"
        ce = torch.nn.CrossEntropyLoss(reduction="sum" if per_epoch else "mean")

        def step(model, batch, opt, _):
            if not per_epoch:
                opt.zero_grad(set_to_none=True)
            loss = ce(model(batch["image"]), labels_of(batch).to(batch["image"].device))
            loss.backward()
            if not per_epoch:
                opt.step()
            return float(loss.detach())

        def full_batch_step(model, opt):
            opt.step()
            opt.zero_grad(set_to_none=True)

        optimizer.zero_grad(set_to_none=True)
        loader = make_loader(self.data("training"), cfg["train"]["batch_size"], shuffle=True, seed=seed)
        hooks = Hooks(step=step, epoch_end=full_batch_step if per_epoch else None)
        stats = train_epochs(selector, loader, optimizer, None, cfg["train"]["epochs"], self.device, hooks)
        return stats, {**prefixed("select", _cpu(selector)), **prefixed("moment", flatten_optimizer_state(optimizer.state_dict()))}

    def train_selector(self, msg: FLModel) -> FLModel:
        """FedSM-extra round: label each training sample with the candidate model (0 = global, k + 1 =
        personalized model of site k) of lowest segmentation loss on it, and train the (K+1)-class selector."""
        seed = derive_seed(self.cfg["seed"], self.name, msg.current_round)
        seed_everything(seed)
        candidates = []  # 0 = global, k + 1 = personalized model of site k
        for prefix in ["global"] + [f"person.{site}" for site in self.sites]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(unprefixed(prefix, msg.params))
            candidates.append(net.to(self.device).eval())
        per_sample = build_loss(self.cfg["train"]["loss"], reduction="none")

        @torch.no_grad()
        def labels_of(batch):
            losses = [per_sample(m(batch["image"]), batch["label"]).flatten(1).mean(1) for m in candidates]
            return selector_labels_extra(torch.stack(losses, dim=1).cpu())

        t0 = time.time()
        selector = build_selector(selector_cfg(self.cfg, len(self.sites) + 1))
        stats, params = self._train_selector(selector, labels_of, msg, seed)
        metrics = {"selector_loss": stats["loss"], "train_seconds": time.time() - t0}
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=metrics,
                       meta={"NUM_STEPS_CURRENT_ROUND": stats["samples"], "site": self.name})

    def infer(self, msg: FLModel) -> FLModel:
        """FedSM super model at this site (inside or outside the federation): route every test image through
        the selector, score global / own personalized / super model for every gamma, write predictions."""
        inside = list(msg.meta["inside_sites"])
        models = []
        for prefix in ["global"] + [f"person.{site}" for site in inside]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(unprefixed(prefix, msg.params))
            models.append(net)
        select = unprefixed("select", msg.params)
        classes = [v for v in select.values() if v.ndim == 2][-1].shape[0]  # the head's output size
        extra = classes == len(inside) + 1
        selector = build_selector(selector_cfg(self.cfg, classes))
        selector.load_state_dict(select)
        fedsm = self.cfg["fedsm"]
        result = evaluate_super_model(
            models[0], models[1:], selector, self.data("testing"), self.device, gammas=fedsm["gammas"],
            own_index=inside.index(self.name) if self.name in inside else None, extra=extra,
            batch_size=self.cfg["train"]["eval_batch_size"], out_dir=self.store.root / "predictions",
            save_gamma=fedsm["gamma"], label_encoding=load_dataset_info(self.root)["label_encoding"])
        result["inside"] = self.name in inside
        return FLModel(params={}, metrics={"infer": result}, meta={"site": self.name})

    def finetune(self, msg: FLModel) -> FLModel:
        """FT: fine-tune the received final global model on the site's training split for ``ft.epochs``
        epochs; the site's model (``best.pt``) becomes the best by validation Dice of the global model
        (epoch 0) and every fine-tuned epoch."""
        r = msg.current_round
        model = self.current_model(msg.params, r)
        self.best_path.unlink(missing_ok=True)
        scores = [self._validate_and_track(model, r)["dice"]]
        prev = {}
        t0 = time.time()
        for epoch in range(self.cfg["ft"]["epochs"]):
            seed = derive_seed(self.cfg["seed"], self.name, "ft", epoch)
            seed_everything(seed)
            _, optim = self._fit(model, "ft", prev, seed, epochs=1)
            prev = {"optim.ft": optim}
            scores.append(self._validate_and_track(model, r)["dice"])
        best = max(range(len(scores)), key=lambda e: (scores[e], -e))
        return FLModel(params={}, metrics={"ft_val_dice": scores, "ft_best_epoch": best, "train_seconds": time.time() - t0},
                       meta={"site": self.name})

    def validate(self, msg: FLModel) -> FLModel:
        model = self.current_model(msg.params, msg.current_round)
        if self.method == "fedsm":  # global scored for the server's choice, personalized tracked as the site's own
            val = evaluate(model, self.data("validation"), self.device, self.cfg["train"]["eval_batch_size"])
            person = build_net(self.cfg["net"])
            person.load_state_dict(unprefixed("person", msg.params))
            val_p = self._validate_and_track(person, msg.current_round)
            return FLModel(params={}, metrics={"val_dice": val["dice"], "val_dice_person": val_p["dice"]}, meta={"site": self.name})
        val = self._validate_and_track(model, msg.current_round)
        return FLModel(params={}, metrics={"val_dice": val["dice"]}, meta={"site": self.name})

    def test(self, msg: FLModel) -> FLModel:
        """Test Dice of the server's selected global model (if the method has one) and of the site's best own model."""
        data, bs = self.data("testing"), self.cfg["train"]["eval_batch_size"]
        metrics = {}
        if unprefixed("global", msg.params or {}):
            self.net.load_state_dict({**self.net.state_dict(), **unprefixed("global", msg.params)})
            metrics["global"] = evaluate(self.net, data, self.device, bs, surface=True)
        best = load_file(self.best_path)
        self.net.load_state_dict(unprefixed("model", best))
        metrics["site"] = evaluate(self.net, data, self.device, bs, surface=True)
        metrics["site"]["selected_round"] = best["round"]
        return FLModel(params={}, metrics={"test": metrics}, meta={"site": self.name})

    def submit_model(self, msg: FLModel) -> FLModel:
        best = load_file(self.best_path)
        return FLModel(params=prefixed("site", unprefixed("model", best)), meta={"site": self.name, "round": best["round"]})


#: methods whose site side lives in its own module ("module:Class", a subclass of Site), imported on use
SITE_CLASSES: dict[str, str] = {}
SITE_CLASSES.update(dict.fromkeys(("iopfl", "iopfl_route"), "pflseg.flare.iopfl_site:IOPFLSite"))
SITE_CLASSES.update(dict.fromkeys(("lcfed", "fedrep"), "pflseg.flare.lcfed_site:LCFedSite"))


def site_class(method: str) -> type[Site]:
    if method not in SITE_CLASSES:
        return Site
    module, cls = SITE_CLASSES[method].split(":")
    return getattr(importlib.import_module(module), cls)


def _cpu(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def main() -> None:
    import nvflare.client as flare
    from nvflare.client.tracking import SummaryWriter

    flare.init()
    name = flare.get_site_name()
    writer = SummaryWriter()
    site = None
    while flare.is_running():
        msg = flare.receive()
        if msg is None:
            break
        task = flare.get_task_name()
        try:
            if site is None:
                cfg = check_effective(msg.meta["pflseg"], "job config sent by the server")
                site = site_class(cfg["method"])(name, cfg, msg.meta["sites"])
            handler = site.tasks().get(task)
            if handler is None:
                raise ValueError(f"site {name}: unknown task '{task}'")
            t0 = time.time()
            out = handler(msg)
            out.metrics = {**(out.metrics or {}), "compute_seconds": time.time() - t0}
        except (DataError, ValueError, RuntimeError, OSError, FloatingPointError) as exc:
            log.error("site %s: %s", name, exc)
            out = FLModel(params={}, meta={"pflseg_error": str(exc), "site": name})
            site = None if isinstance(exc, DataError) else site
        for key, value in out.metrics.items() if out.metrics else []:
            if isinstance(value, (int, float)):
                writer.add_scalar(f"{name}/{key}", value, msg.current_round or 0)
        flare.send(out)


if __name__ == "__main__":
    main()
