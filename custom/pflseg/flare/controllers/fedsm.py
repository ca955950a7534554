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
from pflseg.flare.controllers.base import RoundController
from pflseg.flare.state import prefixed, unprefixed
from pflseg.nets.selector import build_selector, selector_cfg


class FedSMController(RoundController):
    def restore(self) -> int:
        start = super().restore()
        check_lam(self.cfg["fedsm"]["lam"], len(self.sites))
        torch.manual_seed(self.cfg["seed"])
        selector = build_selector(selector_cfg(self.cfg, len(self.sites)))
        self.selector = {k: v.detach().clone() for k, v in selector.state_dict().items()}
        self.moment_ref = {}
        for i, (_, p) in enumerate(selector.named_parameters()):
            self.moment_ref.update({f"moment.{i}.exp_avg": p, f"moment.{i}.exp_avg_sq": p, f"moment.{i}.step": torch.zeros(())})
        self.person = {s: dict(self.global_state) for s in self.sites}
        self.moments: dict = {}
        if start > 0:
            ckpt = self.store.load(start - 1)
            self.selector = unprefixed("select", ckpt)
            self.moments = unprefixed("moment", ckpt)
            self.person = {s: unprefixed(f"person.{s}", ckpt) for s in self.sites}
        return start

    def checkpoint(self, r: int) -> dict:
        person = {k: v for s in self.sites for k, v in prefixed(f"person.{s}", self.person[s]).items()}
        return {**super().checkpoint(r), **prefixed("select", self.selector), **prefixed("moment", self.moments), **person}

    def round(self, r: int) -> dict:
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

    def final_params(self, site: str) -> dict:
        return {**prefixed("global", self.global_state), **prefixed("person", self.person[site])}
