"""Centralized training, the upper bound: one site (the first by name) trains on the pooled training
data of all the federation's sites; every site then scores the pooled model on its own test data.

Only meaningful where pooling is allowed (simulation, or one data root that holds all sites).
"""

from __future__ import annotations

from pflseg.flare.controllers.base import RoundController
from pflseg.flare.state import prefixed, unprefixed


class CentralizedController(RoundController):
    def round(self, r: int) -> dict:
        pool = self.sites[0]
        sent = prefixed("global", self.global_state)
        results = self.send_each("train", {pool: self.message(r, sent)}, reference=sent)
        self.track_best(r, results, self.global_state)
        self.global_state = {**self.global_state, **unprefixed("global", results[pool].params)}
        return {pool: results[pool].metrics.get("compute_seconds", 0.0)}
