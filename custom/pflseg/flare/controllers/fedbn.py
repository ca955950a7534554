"""FedBN workflow: FedAvg over everything but the normalisation layers, which stay at each site.

The local keys come from ``pflseg.algorithms.fedbn.shared_keys`` (found by module type); the sites merge
the shared part they receive with their own normalisation layers kept in their state on disk. A net without
batch norm (``net.norm: instance``) is refused: it has no statistics to keep, so FedBN would be FedAvg.
"""

from __future__ import annotations

from pflseg.algorithms.fedbn import shared_keys
from pflseg.config import ConfigError
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.nets import build_net


class FedBNController(FedAvgController):
    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        if cfg["net"]["norm"] != "batch":
            raise ConfigError(f"{source}: method fedbn keeps each site's batch-norm layers at the site, but net.norm="
                              f"{cfg['net']['norm']!r} gives the net none (FedBN would be FedAvg): set net.norm: "
                              "batch, "
                              "or run method fedavg")

    def shared_keys(self) -> list[str]:
        return shared_keys(build_net(self.cfg["net"]))
