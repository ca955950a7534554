"""Local training: every site trains alone from the same initial model; nothing is aggregated.

The server only orchestrates rounds and collects metrics; each site's model lives in its state on disk.
"""

from __future__ import annotations

from pflseg.flare.controllers.base import RoundController, RoundOutput
from pflseg.flare.wire import GLOBAL, prefixed


class LocalController(RoundController):
    def round(self, r: int) -> RoundOutput:
        params = prefixed(GLOBAL, self.state.global_state) if r == 0 else {}
        results = self.send_each("train", {s: self.message(r, params) for s in self.sites}, reference={})
        return RoundOutput.of(results, {"val_dice": {s: res.metrics["val_dice"] for s, res in results.items()}})

    def final_params(self, site: str) -> dict:
        return {}
