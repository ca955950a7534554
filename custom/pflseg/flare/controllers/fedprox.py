"""FedProx workflow: FedAvg's rounds (the proximal term lives at the sites, ``pflseg.flare.sites.fedprox``); this
class holds the method's own config rule, so that fedavg jobs do not carry it."""

from __future__ import annotations

from pflseg.config import ConfigError
from pflseg.flare.controllers.fedavg import FedAvgController


class FedProxController(FedAvgController):
    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        if cfg["fedprox"]["mu"] < 0:
            raise ConfigError(f"{source}: fedprox.mu must be >= 0, got {cfg['fedprox']['mu']}")
