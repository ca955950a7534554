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

from nvflare.app_common.abstract.fl_model import FLMetaKey

from pflseg.algorithms.alignment import ALIGNMENTS
from pflseg.algorithms.grace import MODES, SELF_MODES, grace_keys, grace_step
from pflseg.algorithms.grace_meta import INNER_STEPS, META_GRADS
from pflseg.config import check_choice, check_lr
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.guard import robust_args
from pflseg.flare.wire import GLOBAL, unprefixed
from pflseg.nets import build_net


class GraceController(FedAvgController):
    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        for key in ("grace.inner_lr", "grace.eta_g"):
            check_lr(cfg, key, source)
        for key, allowed in (("similarity", MODES), ("self_similarity", SELF_MODES), ("align", ALIGNMENTS),
                             ("inner_step", INNER_STEPS), ("meta_grad", META_GRADS)):
            check_choice(cfg, f"grace.{key}", allowed, source)

    def restore(self) -> int:
        if len(self.sites) < 2:
            raise ValueError(f"GRACE compares the updates of several sites: it needs at least 2, got {self.sites}")
        return super().restore()

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        """GRACE's server step (``grace_step``) from the round's updates and the current global model ``state``.
        Returns (the new global model, the round's entries ``grace_weights`` {site: p'_k} and ``similarity``
        {"sites", "matrix"}); with ``grace.server: false``, FedAvg's."""
        grace = self.cfg["grace"]
        if not grace["server"]:
            return super().aggregate(results, state, r)
        if getattr(self, "_grace_keys", None) is None:  # the net is fixed for the job: build it once, not per round
            self._grace_keys = grace_keys(build_net(self.cfg["net"]))
        trainable, buffers = self._grace_keys
        states = [unprefixed(GLOBAL, res.params) for res in results.values()]
        weights = [res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] for res in results.values()]
        new, info = grace_step(
            state, states, weights, eta_g=grace["eta_g"], mode=grace["similarity"],
            self_mode=grace["self_similarity"], trainable_keys=trainable, buffer_keys=buffers,
            **robust_args(self.cfg, r))
        sites = list(results)
        weights_of = dict(zip(sites, info["p_prime"].tolist()))
        self.log_scalars("grace_weight", weights_of, r)
        self.info(f"GRACE weights: {weights_of}")
        return new, {"grace_weights": weights_of, "similarity": {"sites": sites, "matrix": info["sim"].tolist()}}
