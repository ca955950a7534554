"""FedAvg workflow (also FedProx, whose difference lives at the sites: the proximal term).

Per round: every site gets the global model, trains, returns its model and n_k; the server takes the
n_k-weighted mean of the full state (``pflseg.algorithms.fedavg.weighted_average``), or the robust rule of
``robust.aggregation`` (``pflseg.flare.guard.aggregate``).
"""

from __future__ import annotations

from pflseg.flare import guard
from pflseg.flare.controllers.base import RoundController
from pflseg.flare.state import prefixed, unprefixed


class FedAvgController(RoundController):
    def shared_keys(self) -> list[str]:
        """Keys that travel and are averaged (all of them for FedAvg)."""
        return list(self.global_state)

    def round(self, r: int) -> dict:
        keys = self.shared_keys()
        sent = prefixed("global", {k: self.global_state[k] for k in keys})
        results = self.send_each("train", {s: self.message(r, sent) for s in self.sites}, reference=sent)
        self.track_best(r, results, self.global_state)
        self.aggregate(results, r)
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def aggregate(self, results: dict, r: int) -> None:
        """Round ``r``: w <- sum_k p_k w_k over the shared keys (or ``robust.aggregation``'s rule)."""
        states = [unprefixed("global", res.params) for res in results.values()]
        weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
        self.global_state = {**self.global_state, **guard.aggregate(self.cfg, states, weights, self.shared_keys())}
