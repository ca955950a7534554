"""FedProx, the site's side: FedAvg's local training plus the proximal term mu/2 ||w - w_global||^2
(``pflseg.algorithms.fedprox.proximal_term``) against the model received this round."""

from __future__ import annotations

from pflseg.algorithms.fedprox import proximal_term
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.train import Hooks


class FedProxSite(FedAvgSite):
    def round_hooks(self, model, prev: dict):
        anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
        mu = self.cfg["fedprox"]["mu"]
        return Hooks(extra_loss=lambda m, batch, logits: proximal_term(m, anchor, mu)), None
