"""Local, the site's side: every site trains its own model alone (from the common initial model sent in
round 0, then from its own previous round on disk); nothing leaves the site but metrics."""

from __future__ import annotations

from pflseg.flare.sites.base import Site
from pflseg.flare.state import unprefixed


class LocalSite(Site):
    exchanges_models = False

    def model_for_round(self, received: dict, round_num: int):
        own = self.require_own(round_num)
        self.net.load_state_dict({**self.net.state_dict(),
                                  **(own if own is not None else unprefixed("global", received))})
        return self.net

    def upload(self, trained: dict) -> dict:
        return {}
