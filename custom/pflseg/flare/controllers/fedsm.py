"""FedSM workflow (Xu et al., CVPR 2022): global model, one personalized model per site, model selector.

Per round, site k receives the global model, ITS OWN personalized model only, the selector, the selector's
averaged Adam moments and its selector label k (meta ``selector_label``); it returns the three trained
models, its selector moments and n_k. The server then

    w_g <- sum_k p_k w_g,k ;  w_s <- sum_k p_k w_s,k ;  moments <- sum_k p_k m_k   (fedavg / fedsm)
    {w_p,k} <- SoftPull({w_p,k}, lam)                                            (softpull)

A site that drops out of a round keeps its personalized model unchanged (and it still enters the others'
SoftPull mix as it was). Every round's checkpoint holds all K personalized models, the selector and the
moments. See ../shared/reference/ALGORITHMS.md section 1.
"""

from __future__ import annotations

import torch

from pflseg.algorithms.fedavg import weighted_average
from pflseg.algorithms.fedsm import average_moments
from pflseg.algorithms.softpull import check_lam, softpull
from pflseg.flare.controllers.base import PostTrainingController, RoundController
from pflseg.flare.state import RoundStore, prefixed, unprefixed
from pflseg.nets.selector import build_selector, selector_cfg


def moment_reference(selector) -> dict:
    """Expected keys and shapes of the selector's flattened Adam moments in a site's answer."""
    ref = {}
    for i, (_, p) in enumerate(selector.named_parameters()):
        ref.update({f"moment.{i}.exp_avg": p, f"moment.{i}.exp_avg_sq": p, f"moment.{i}.step": torch.zeros(())})
    return ref


class FedSMController(RoundController):
    task_metrics = {**RoundController.task_metrics, "train_selector": {"selector_loss": "number"}}

    def restore(self) -> int:
        start = super().restore()
        check_lam(self.cfg["fedsm"]["lam"], len(self.sites))
        torch.manual_seed(self.cfg["seed"])
        selector = build_selector(selector_cfg(self.cfg, len(self.sites)))
        self.selector = {k: v.detach().clone() for k, v in selector.state_dict().items()}
        self.moment_ref = moment_reference(selector)
        self.person = {s: dict(self.global_state) for s in self.sites}
        self.moments: dict = {}
        if start > self.cfg["rounds"]:  # resuming inside the extra phase: the selector has K + 1 classes
            self.moment_ref = moment_reference(build_selector(selector_cfg(self.cfg, len(self.sites) + 1)))
        if start > 0:
            ckpt = self.store.load(start - 1)
            self.selector = unprefixed("select", ckpt)
            self.moments = unprefixed("moment", ckpt)
            self.person = {s: unprefixed(f"person.{s}", ckpt) for s in self.sites}
        self.best_person = {s: {"round": -1, "score": -1.0} for s in self.sites}
        self.best_person_state = {s: dict(self.person[s]) for s in self.sites}
        if start > 0:
            self.best_person = dict(ckpt["best_person"])
            self.best_person_state = {s: unprefixed(f"bestperson.{s}", ckpt) for s in self.sites}
        return start

    def checkpoint(self, r: int) -> dict:
        flat = lambda name, states: {k: v for s in self.sites for k, v in prefixed(f"{name}.{s}", states[s]).items()}  # noqa: E731
        return {**super().checkpoint(r), **prefixed("select", self.selector), **prefixed("moment", self.moments),
                **flat("person", self.person), **flat("bestperson", self.best_person_state), "best_person": self.best_person}

    def track_best(self, r: int, results: dict, state: dict) -> None:
        """Best global as in every method, and for each site the personalized model it sent with the best
        validation Dice at that site (what the inference job hands out)."""
        super().track_best(r, results, state)
        for site, res in results.items():
            score = res.metrics.get("val_dice_person")
            if score is not None and score > self.best_person[site]["score"]:
                self.best_person[site] = {"round": r, "score": score}
                self.best_person_state[site] = dict(self.person[site])

    def n_rounds(self) -> int:
        return self.cfg["rounds"] + self.cfg["fedsm"]["extra_rounds"]

    def round(self, r: int) -> dict:
        if r >= self.cfg["rounds"]:
            return self.extra_round(r)
        common = {**prefixed("global", self.global_state), **prefixed("select", self.selector), **prefixed("moment", self.moments)}
        payloads = {s: self.message(r, {**common, **prefixed("person", self.person[s])}, selector_label=k)
                    for k, s in enumerate(self.sites)}
        reference = {**prefixed("global", self.global_state), **prefixed("person", self.global_state),
                     **prefixed("select", self.selector), **self.moment_ref}
        results = self.send_each("train", payloads, reference=reference)
        self.track_best(r, results, self.global_state)
        weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
        self.global_state = weighted_average([unprefixed("global", res.params) for res in results.values()], weights)
        self.selector = weighted_average([unprefixed("select", res.params) for res in results.values()], weights)
        self.moments = average_moments([unprefixed("moment", res.params) for res in results.values()], weights)
        trained = {s: unprefixed("person", res.params) for s, res in results.items()}
        mixed = softpull([trained.get(s, self.person[s]) for s in self.sites], self.cfg["fedsm"]["lam"])
        self.person = {s: (mixed[k] if s in trained else self.person[s]) for k, s in enumerate(self.sites)}
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def extra_round(self, r: int) -> dict:
        """FedSM-extra: only the (K+1)-class selector trains; every site gets all personalized models."""
        if r == self.cfg["rounds"]:  # a fresh selector over {global, personalized 1..K}, fresh moments
            torch.manual_seed(self.cfg["seed"] + 1)
            selector = build_selector(selector_cfg(self.cfg, len(self.sites) + 1))
            self.selector, self.moments = {k: v.detach().clone() for k, v in selector.state_dict().items()}, {}
            self.moment_ref = moment_reference(selector)
        person = {k: v for s in self.sites for k, v in prefixed(f"person.{s}", self.person[s]).items()}
        payload = {**prefixed("global", self.global_state), **person, **prefixed("select", self.selector),
                   **prefixed("moment", self.moments)}
        results = self.send_each("train_selector", {s: self.message(r, payload) for s in self.sites},
                                 reference={**prefixed("select", self.selector), **self.moment_ref})
        weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
        self.selector = weighted_average([unprefixed("select", res.params) for res in results.values()], weights)
        self.moments = average_moments([unprefixed("moment", res.params) for res in results.values()], weights)
        self.round_metrics = {"selector_loss": {s: res.metrics["selector_loss"] for s, res in results.items()}}
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def final_params(self, site: str) -> dict:
        return {**prefixed("global", self.global_state), **prefixed("person", self.person[site])}


class FedSMInferenceController(PostTrainingController):
    """Post-training job: hand the trained super model to every connected site (inside sites and sites that
    never trained) and collect, per site, the test Dice of the global, own personalized (inside sites only)
    and super model for every gamma, with how often each model was chosen. ``fedsm.bundle`` must lie inside
    the server's state root (``PostTrainingController.bundle_folder``)."""

    task_metrics = {"infer": {"infer": "dict"}}

    def post_training(self) -> dict:
        bundle = RoundStore(self.bundle_folder("fedsm.bundle"), clean=False)  # another job's folder: read only
        if not self.cfg["fedsm"]["bundle"] or bundle.latest() is None:
            raise ValueError(f"fedsm.bundle={self.cfg['fedsm']['bundle']!r} holds no FedSM checkpoint (round_NNNN.pt); "
                             "set it to the trained run's server state folder, e.g. runs/fedsm/state/server/fedsm")
        source = bundle.final_path if bundle.final_path.is_file() else bundle.path(bundle.latest())
        ckpt = bundle.final()
        inside = sorted({k.split(".")[1] for k in ckpt if k.startswith("person.")})
        chosen = "bestperson" if any(k.startswith("bestperson.") for k in ckpt) else "person"
        person = {"person." + k[len(chosen) + 1:]: v for k, v in ckpt.items() if k.startswith(chosen + ".")}
        best = unprefixed("best", ckpt) or unprefixed("global", ckpt)
        payload = {**prefixed("global", best), **person, **prefixed("select", unprefixed("select", ckpt))}
        self.info(f"super model from {source}: inside sites {inside}; sending to {self.sites}")
        res = self.send_each("infer", {s: self.message(0, payload, inside_sites=inside) for s in self.sites})
        infer = {s: r.metrics["infer"] for s, r in res.items()}
        return {"inside_sites": inside, "bundle": str(source), "infer": infer,
                **choose_gamma(infer)}


def choose_gamma(infer: dict) -> dict:
    """The gamma with the best mean super-model Dice on the inside sites' VALIDATION splits (never test), and
    every site's test Dice at it: ``{"gamma_selected", "gamma_validation": {gamma: mean}, "test_at_gamma": {site: dice}}``.
    FedSM-extra has no gamma (empty dict)."""
    val = [r["validation"] for r in infer.values() if r.get("validation")]
    gammas = [g for g in (val[0] if val else {}) if g != "extra"]
    if not gammas:
        return {}
    means = {g: sum(v[g]["dice"] for v in val) / len(val) for g in gammas}
    best = max(gammas, key=lambda g: (means[g], -gammas.index(g)))
    return {"gamma_selected": float(best), "gamma_validation": means,
            "test_at_gamma": {s: r["super"][best]["dice"] for s, r in infer.items()}}
