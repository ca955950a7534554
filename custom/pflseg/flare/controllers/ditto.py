"""Ditto workflow (Li, Hu, Beirami and Smith, ICML 2021), server side: FedAvg's rounds, unchanged. Each site's
personalized model v_k, trained towards the global model it received (``pflseg.flare.sites.ditto``), stays at the
site; the server aggregates the global model only. This class holds the method's own config rule."""

from __future__ import annotations

import math

from pflseg.config import ConfigError
from pflseg.flare.controllers.fedavg import FedAvgController


class DittoController(FedAvgController):
    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        lam = cfg["ditto"]["lam"]
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
            raise ConfigError(f"{source}: ditto.lam must be a finite number >= 0 (0: each site's personalized model "
                              f"trains alone), got {lam!r}")
