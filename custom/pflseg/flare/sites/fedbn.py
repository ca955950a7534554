"""FedBN, the site's side: the received shared part with the site's own normalisation layers (found by
module type, ``pflseg.algorithms.fedbn.norm_keys``, kept in its round state); only the shared part is sent."""

from __future__ import annotations

from pflseg.algorithms.fedbn import norm_keys
from pflseg.flare.sites.base import Site
from pflseg.flare.wire import GLOBAL, prefixed, unprefixed


class FedBNSite(Site):
    keeps = "its normalisation layers"

    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        super().__init__(name, cfg, sites, job_id)
        self.norm = norm_keys(self.net)

    def model_for_round(self, received: dict, prev: dict):
        own = unprefixed("model", prev)
        self.net.load_state_dict({**self.net.state_dict(), **unprefixed(GLOBAL, received),
                                  **{k: v for k, v in own.items() if k in self.norm}})
        return self.net

    def upload(self, trained: dict) -> dict:
        return prefixed(GLOBAL, {k: v for k, v in trained.items() if k not in self.norm})
