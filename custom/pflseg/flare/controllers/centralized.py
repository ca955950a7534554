"""Centralized training, the upper bound: one site (the first by name) trains on the pooled training
data of all the federation's sites; every site then scores the pooled model on its own test data.

Only meaningful where pooling is allowed (simulation, or one data root that holds all sites).
"""

from __future__ import annotations

from pflseg.flare.controllers.base import RoundController, RoundOutput
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed


class CentralizedController(RoundController):
    def round(self, r: int) -> RoundOutput:
        pool = self.sites[0]
        sent = prefixed(GLOBAL, self.state.global_state)
        results = self.send_each("train", {pool: self.message(r, sent)}, reference=sent)
        metrics = self.track_best(r, results, self.state.global_state)
        self.state.global_state = {**self.state.global_state, **unprefixed(GLOBAL, results[pool].params)}
        return RoundOutput.of(results, metrics)
