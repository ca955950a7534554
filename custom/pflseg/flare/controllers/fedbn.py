"""FedBN workflow: FedAvg over everything but the normalisation layers, which stay at each site.

The local keys come from ``pflseg.algorithms.fedbn.shared_keys`` (found by module type); the sites merge
the shared part they receive with their own normalisation layers kept in their state on disk.
"""

from __future__ import annotations

from pflseg.algorithms.fedbn import shared_keys
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.nets import build_net


class FedBNController(FedAvgController):
    def shared_keys(self) -> list[str]:
        keys = shared_keys(build_net(self.cfg["net"]))
        if len(keys) == len(self.global_state):
            self.warning("FedBN: the network has no normalisation layers with state (net.norm); this is FedAvg")
        return keys
