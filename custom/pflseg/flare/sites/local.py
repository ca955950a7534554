"""Local, the site's side: every site trains its own model alone (from the common initial model sent in
round 0, then from its own previous round on disk); nothing leaves the site but metrics."""

from __future__ import annotations

from pflseg.flare.sites.base import Site
from pflseg.flare.wire import GLOBAL, unprefixed


class LocalSite(Site):
    exchanges_models = False
    keeps = "its model"

    def model_for_round(self, received: dict, prev: dict):
        own = unprefixed("model", prev)  # none in round 0 (or when the site joins late): the common initial model
        self.net.load_state_dict({**self.net.state_dict(), **(own or unprefixed(GLOBAL, received))})
        return self.net

    def upload(self, trained: dict) -> dict:
        return {}
