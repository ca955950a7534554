"""GRACE workflow (Zhang et al., MICCAI 2023), server side: consistency-enhanced re-weighting.

Per round every site trains from the global model (with the GRACE meta step when ``grace.client``);
the server takes all updates of the round together and applies ``pflseg.algorithms.grace.grace_step``
(cosine similarity of the updates from one Gram matrix, consistency, p'_k, global step with eta_g,
normalisation buffers averaged with p'). With ``grace.server: false`` it aggregates by FedAvg (the
client-only ablation). The per-site weights p' and the similarity matrix of every round go into the
round checkpoint and results.json. ``grace.self_similarity`` picks the paper's consistency (``include``) or the
reference code's (``exclude``, job ``grace_refcode``); see ``pflseg.algorithms.grace``.
"""

from __future__ import annotations

from pflseg.algorithms.grace import grace_keys, grace_step
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.guard import robust_args
from pflseg.flare.state import unprefixed
from pflseg.nets import build_net


class GraceController(FedAvgController):
    def restore(self) -> int:
        if len(self.sites) < 2:
            raise ValueError(f"GRACE compares the updates of several sites: it needs at least 2, got {self.sites}")
        return super().restore()

    def aggregate(self, results: dict, r: int) -> None:
        grace = self.cfg["grace"]
        if not grace["server"]:
            return super().aggregate(results, r)
        trainable, buffers = grace_keys(build_net(self.cfg["net"]))
        states = [unprefixed("global", res.params) for res in results.values()]
        weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
        self.global_state, info = grace_step(
            self.global_state, states, weights, eta_g=grace["eta_g"], mode=grace["similarity"],
            self_mode=grace["self_similarity"], trainable_keys=trainable, buffer_keys=buffers, **robust_args(self.cfg))
        sites = list(results)
        self.round_metrics["grace_weights"] = dict(zip(sites, info["p_prime"].tolist()))
        self.round_metrics["similarity"] = {"sites": sites, "matrix": info["sim"].tolist()}
        self.log_scalars("grace_weight", self.round_metrics["grace_weights"], r)
        self.info(f"GRACE weights: {self.round_metrics['grace_weights']}")
