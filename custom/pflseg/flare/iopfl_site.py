"""IOP-FL, the site's side (a ``Site`` subclass; ALGORITHMS.md section 3).

Training (job ``iopfl``): every round the site receives the global model w_g^t, scores it on its
validation and test splits, trains it with the one loop (plain FedAvg local training) into w_k, updates
its local adapted model P_k (``pflseg.algorithms.iopfl.update_person``), scores P_k on validation and
test next to the global model, keeps the best P_k by validation Dice (``best.pt``) and sends w_k back.
P_k, the Adam moments and w_g^t (for the ``paper_eq4`` rule) are in the round's state file on disk:
P_k never leaves the site during training. At the end ``submit_model`` hands out the best P_k (only when
the job publishes the routing bundle, ``iopfl.publish``); ``test`` scores the server's best global model
and the best P_k on the test split.

Routing (job ``iopfl_route``, task ``route``): an outside site receives the bundle {P_1..P_K, w_g},
adapts on all of its images without labels, writes the routed predictions into its state folder
(``predictions/``) and returns the Dice of routing and of its comparators where labels exist.
"""

from __future__ import annotations

import logging
import time

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from torch.utils.data import ConcatDataset

from pflseg.algorithms.iopfl import update_person
from pflseg.data import DataError, load_dataset_info
from pflseg.eval.iopfl_routing import route_site
from pflseg.flare.client import Site, _cpu
from pflseg.flare.state import prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.train import derive_seed, evaluate, seed_everything

SPLITS = ("training", "validation", "testing")
log = logging.getLogger("pflseg.client")


class IOPFLSite(Site):
    def tasks(self) -> dict:
        return {**super().tasks(), "train": self.train, "validate": self.validate, "route": self.route}

    def train(self, msg: FLModel) -> FLModel:
        r, cfg, bs = msg.current_round, self.cfg, self.cfg["train"]["eval_batch_size"]
        if r == 0 and not cfg["resume"]:
            self.store.clear()
            self.best_path.unlink(missing_ok=True)
        seed = derive_seed(cfg["seed"], self.name, r)
        seed_everything(seed)
        prev = self.store.load(r - 1) if r > 0 and r - 1 in self.store.rounds() else {}
        if r > 0 and not prev:
            raise RuntimeError(f"site {self.name}: no state for round {r - 1} in {self.store.root} (P_k lives there); "
                               "the site state was removed or the job was resumed at another site")
        model = self.current_model(msg.params, r)
        glob = _cpu(model)
        val_g = evaluate(model, self.data("validation"), self.device, bs)
        test_g = evaluate(model, self.data("testing"), self.device, bs)
        t0 = time.time()
        stats, optim = self._fit(model, "model", prev, seed)
        train_s = time.time() - t0
        local = _cpu(model)
        iopfl = cfg["iopfl"]
        person = update_person(iopfl["rule"], unprefixed("person", prev) or None, local, glob,
                               unprefixed("globalin", prev) or None, iopfl["tau"])
        net = build_net(cfg["net"])
        net.load_state_dict(person)
        val_p = self._validate_and_track(net, r)  # best.pt = the best P_k by validation Dice
        test_p = evaluate(net, self.data("testing"), self.device, bs)
        self.store.save(r, {"round": r, "optim.model": optim, **prefixed("person", person), **prefixed("globalin", glob)})
        metrics = {"val_dice": val_g["dice"], "val_dice_person": val_p["dice"], "test_dice_global": test_g["dice"],
                   "test_dice_person": test_p["dice"], "train_loss": stats["loss"], "train_seconds": train_s,
                   "n_samples": stats["samples"]}
        return FLModel(params=prefixed("global", local), params_type=ParamsType.FULL, metrics=metrics,
                       meta={"NUM_STEPS_CURRENT_ROUND": stats["samples"], "site": self.name})

    def validate(self, msg: FLModel) -> FLModel:
        """Score the global model only (the best P_k is tracked during training, by validation Dice)."""
        model = self.current_model(msg.params, msg.current_round)
        val = evaluate(model, self.data("validation"), self.device, self.cfg["train"]["eval_batch_size"])
        return FLModel(params={}, metrics={"val_dice": val["dice"]}, meta={"site": self.name})

    def route(self, msg: FLModel) -> FLModel:
        inside = list(msg.meta["inside_sites"])
        if self.name in inside:
            raise ValueError(f"site {self.name} trained in the federation: test-time routing is for outside sites; "
                             f"remove it from iopfl.targets")
        experts = []
        for prefix in [f"person.{s}" for s in inside] + ["global"]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(unprefixed(prefix, msg.params))
            experts.append(net)
        parts = []  # every image of the site (used without labels); empty splits are named in the log
        for split in SPLITS:
            try:
                parts.append(self.data(split))
            except DataError as exc:
                log.info("site %s: routing without split %s (%s)", self.name, split, exc)
        if not parts:
            raise DataError(f"site {self.name}: no images in {self.root / self.data_site} to route; add the site's images")
        data = ConcatDataset(parts)
        result = route_site(experts[:-1], experts[-1], data, self.device, self.cfg["iopfl"],
                            seed=derive_seed(self.cfg["seed"], self.name, "route"),
                            out_dir=self.store.root / "predictions",
                            label_encoding=load_dataset_info(self.root)["label_encoding"],
                            comparators=self.cfg["iopfl"]["comparators"], batch_size=self.cfg["train"]["eval_batch_size"])
        return FLModel(params={}, metrics={"route": result}, meta={"site": self.name})
