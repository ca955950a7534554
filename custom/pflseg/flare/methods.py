"""The one registry of methods: name -> (server workflow, site class).

Config validation, the allow list of package-mode deployments, the result tables and every runner read
it. Adding a method = ``algorithms/<m>.py`` + ``flare/controllers/<m>.py`` + ``flare/sites/<m>.py`` + one
line here + ``app_configs/<m>.yaml``.
"""

from __future__ import annotations

from typing import NamedTuple

from pflseg.config import ConfigError
from pflseg.flare.controllers.centralized import CentralizedController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.controllers.fedbn import FedBNController
from pflseg.flare.controllers.fedsm import FedSMController, FedSMInferenceController
from pflseg.flare.controllers.ft import FTController
from pflseg.flare.controllers.grace import GraceController
from pflseg.flare.controllers.iopfl import IOPFLController, IOPFLRoutingController
from pflseg.flare.controllers.lcfed import FedRepController, LCFedController
from pflseg.flare.controllers.local import LocalController
from pflseg.flare.sites.base import Site
from pflseg.flare.sites.centralized import CentralizedSite
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.flare.sites.fedbn import FedBNSite
from pflseg.flare.sites.fedprox import FedProxSite
from pflseg.flare.sites.fedsm import FedSMInferenceSite, FedSMSite
from pflseg.flare.sites.ft import FTSite
from pflseg.flare.sites.grace import GraceSite
from pflseg.flare.sites.iopfl import IOPFLRoutingSite, IOPFLSite
from pflseg.flare.sites.lcfed import FedRepSite, LCFedSite
from pflseg.flare.sites.local import LocalSite


class Method(NamedTuple):
    controller: type
    site: type[Site]


METHODS: dict[str, Method] = {
    "local": Method(LocalController, LocalSite),
    "fedavg": Method(FedAvgController, FedAvgSite),
    "fedprox": Method(FedAvgController, FedProxSite),
    "fedbn": Method(FedBNController, FedBNSite),
    "centralized": Method(CentralizedController, CentralizedSite),
    "ft": Method(FTController, FTSite),
    "fedsm": Method(FedSMController, FedSMSite),
    "fedsm_infer": Method(FedSMInferenceController, FedSMInferenceSite),
    "grace": Method(GraceController, GraceSite),
    "iopfl": Method(IOPFLController, IOPFLSite),
    "iopfl_route": Method(IOPFLRoutingController, IOPFLRoutingSite),
    "lcfed": Method(LCFedController, LCFedSite),
    "fedrep": Method(FedRepController, FedRepSite),
}


def method(cfg: dict) -> Method:
    """The registry entry of ``cfg["method"]``, after the method's own config checks."""
    name = cfg["method"]
    if name not in METHODS:
        raise ConfigError(f"{cfg.get('name', 'job')}: method '{name}' is not one of {', '.join(METHODS)}")
    entry = METHODS[name]
    entry.controller.check_config(cfg)
    return entry
