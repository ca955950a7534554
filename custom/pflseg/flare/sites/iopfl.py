"""IOP-FL, the site's side (pflseg/algorithms/METHODS.md, section "IOP-FL").

Training (job ``iopfl``): every round the site receives the global model w_g^t, scores it on its
validation split, trains it with the one loop (plain FedAvg local training) into w_k, updates its local
adapted model P_k (``pflseg.algorithms.iopfl.update_person``, from the site's latest completed state), scores
P_k on validation next to the global model, keeps the best P_k by validation Dice (``best.pt``) and sends
w_k back. With ``privacy.round_test: true`` it also scores both on its test split every round and sends
``test_dice_global`` / ``test_dice_person`` (default: the test split is scored once, at the end). P_k, the
Adam moments and w_g^t (for the ``paper_eq4`` rule) are in the round's state file on disk: P_k never leaves
the site during training. At the end ``submit_model`` hands out the best P_k (only when
the job publishes the routing bundle, ``iopfl.publish``); ``test`` scores the server's best global model
and the best P_k on the test split.

Routing (job ``iopfl_route``, ``IOPFLRoutingSite``, task ``route``): an outside site receives the bundle
{P_1..P_K, w_g}, adapts on all of its images without labels, writes the routed predictions into its state folder
(``predictions/``) and returns the Dice of routing and of its comparators where labels exist.
"""

from __future__ import annotations

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.iopfl import update_person
from pflseg.data import load_dataset_info, site_dataset
from pflseg.flare.outbox import Outgoing
from pflseg.flare.policy import check_publish
from pflseg.flare.settings import site_settings
from pflseg.flare.sites.base import Site, Step, cpu_state, trained_metrics
from pflseg.flare.state import load_file
from pflseg.flare.wire import GLOBAL, PERSON, SITE, prefixed, split_by_site, unprefixed
from pflseg.infer.routing import route_site
from pflseg.nets import build_net
from pflseg.train import derive_seed


class IOPFLSite(Site):
    keeps = "P_k"

    @classmethod
    def personal_models_sent(cls, cfg: dict) -> str | None:
        if cfg["iopfl"]["publish"]:
            return "IOP-FL's best P_k at the end (iopfl.publish: true, for the routing bundle)"
        return None

    def tasks(self) -> dict:
        return {**super().tasks(), "submit_model": self.submit_model}

    def step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """w_g^t scored and trained into w_k (sent); P_k updated from it (``update_person``), scored and tracked;
        P_k, the optimizer state and w_g^t kept."""
        r, cfg = received.current_round, self.cfg
        model = self.model_for_round(received.params, prev)
        glob = cpu_state(model)
        val_g = self.evaluate(model)
        round_test = cfg["privacy"]["round_test"]
        test_g = self.evaluate(model, "testing") if round_test else None
        with self.training_time():
            stats, optim = self.fit(model, "model", prev, seed)
        local = cpu_state(model)
        iopfl = cfg["iopfl"]
        person = update_person(iopfl["rule"], unprefixed(PERSON, prev) or None, local, glob,
                               unprefixed("globalin", prev) or None, iopfl["tau"])
        net = build_net(cfg["net"])
        net.load_state_dict(person)
        val_p = self.track(net, r + 1)  # best.pt = the best P_k by validation Dice (P_k after round r + 1)
        tested = ({"test_dice_global": test_g["dice"], "test_dice_person": self.evaluate(net, "testing")["dice"]}
                  if round_test else None)
        metrics = trained_metrics({"val_dice": val_g["dice"], "val_dice_person": val_p["dice"]}, stats, extra=tested)
        keep = {"optim.model": optim, **prefixed(PERSON, person), **prefixed("globalin", glob)}
        return Step(prefixed(GLOBAL, local), keep, metrics, stats["samples"])

    def validate(self, msg: FLModel) -> Outgoing:
        """Score the global model only (the best P_k is tracked during training, by validation Dice)."""
        return self.reply({}, {"val_dice": self.evaluate(self.model_for_round(msg.params, {}))["dice"]})

    def submit_model(self, msg: FLModel) -> Outgoing:
        """The site's best P_k (by validation Dice), for the routing bundle: only when the job publishes it
        (``iopfl.publish``) and the site's policy lets it leave (``pflseg.flare.policy.check_publish``)."""
        check_publish(self.name, self.cfg, site_settings(self.name))
        best = load_file(self.best_path)
        return self.reply(prefixed(SITE, unprefixed("model", best)), {}, round=best["round"],
                          fg_fraction=self.label_fraction())

    def label_fraction(self) -> list[float]:
        """Per class, the foreground fraction of the site's training labels (every slice of its training cases):
        one number per class, the size prior of routing at outside sites (``pflseg.algorithms.routing``)."""
        labels = site_dataset(self.root, self.data_site, "training", size=self.cfg["data"]["size"])
        stacked = torch.stack([torch.as_tensor(x["label"]).float() for x in labels])  # (N, C, H, W)
        return stacked.transpose(0, 1).flatten(1).mean(1).tolist()


class IOPFLRoutingSite(Site):
    """Test-time routing at a site that never trained (job ``iopfl_route``)."""

    def tasks(self) -> dict:
        return {"route": self.route}

    def route(self, msg: FLModel) -> Outgoing:
        inside = list(msg.meta["inside_sites"])
        if self.name in inside:
            raise ValueError(f"site {self.name} trained in the federation: test-time routing is for outside sites; "
                             f"remove it from iopfl.targets")
        experts = []  # P_1..P_K, then w_g
        for state in [*split_by_site(PERSON, msg.params, inside).values(), unprefixed(GLOBAL, msg.params)]:
            net = build_net(self.cfg["net"])
            net.load_state_dict(state)
            experts.append(net)
        data = self.all_images()  # used without labels
        result = route_site(experts[:-1], experts[-1], data, self.device, self.cfg["iopfl"],
                            seed=derive_seed(self.cfg["seed"], self.name, "route"),
                            out_dir=self.store.root / "predictions",
                            label_encoding=load_dataset_info(self.root)["label_encoding"],
                            comparators=self.cfg["iopfl"]["comparators"],
                            batch_size=self.cfg["train"]["eval_batch_size"], amp=self.cfg["train"]["amp"],
                            prior=msg.meta.get("prior"))
        return self.reply({}, {"route": result})
