"""FedAvg workflow (also FedProx, whose difference lives at the sites: the proximal term).

Per round: every site gets the global model, trains, returns its model and n_k; the server takes the
n_k-weighted mean of the full state (``pflseg.algorithms.fedavg.weighted_average``), or the robust rule of
``robust.aggregation`` (``pflseg.flare.guard.aggregate``).
"""

from __future__ import annotations

from nvflare.app_common.abstract.fl_model import FLMetaKey

from pflseg.flare import guard
from pflseg.flare.controllers.base import RoundController, RoundOutput
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed


class FedAvgController(RoundController):
    def shared_keys(self) -> list[str]:
        """Keys that travel and are averaged (all of them for FedAvg)."""
        return list(self.state.global_state)

    def round(self, r: int) -> RoundOutput:
        keys = self.shared_keys()
        sent = prefixed(GLOBAL, {k: self.state.global_state[k] for k in keys})
        results = self.send_each("train", {s: self.message(r, sent) for s in self.sites}, reference=sent)
        metrics = self.track_best(r, results, self.state.global_state)
        self.state.global_state, more = self.aggregate(results, self.state.global_state, r)
        return RoundOutput.of(results, {**metrics, **more})

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        """Round ``r``'s new global model from the sites' answers and the current one ``state``: w <- sum_k p_k w_k
        over the shared keys (or ``robust.aggregation``'s rule), the other keys kept. Returns (the new global model,
        the round's entries: none)."""
        states = [unprefixed(GLOBAL, res.params) for res in results.values()]
        weights = [res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] for res in results.values()]
        return {**state, **guard.aggregate(self.cfg, states, weights, self.shared_keys(), r)}, {}
