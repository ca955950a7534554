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
    #: the method's own config sections (defaults.yaml) that its controller and sites read; a run's identity
    #: (run.json) ignores every OTHER method's section, so a new key of one method does not void other runs
    sections: tuple[str, ...] = ()


METHODS: dict[str, Method] = {
    "local": Method(LocalController, LocalSite),
    "fedavg": Method(FedAvgController, FedAvgSite),
    "fedprox": Method(FedAvgController, FedProxSite, ("fedprox",)),
    "fedbn": Method(FedBNController, FedBNSite),
    "centralized": Method(CentralizedController, CentralizedSite),
    "ft": Method(FTController, FTSite, ("ft",)),
    "fedsm": Method(FedSMController, FedSMSite, ("fedsm",)),
    "fedsm_infer": Method(FedSMInferenceController, FedSMInferenceSite, ("fedsm",)),
    "grace": Method(GraceController, GraceSite, ("grace",)),
    "iopfl": Method(IOPFLController, IOPFLSite, ("iopfl",)),
    "iopfl_route": Method(IOPFLRoutingController, IOPFLRoutingSite, ("iopfl",)),
    "lcfed": Method(LCFedController, LCFedSite, ("lcfed",)),
    "fedrep": Method(FedRepController, FedRepSite, ("lcfed",)),
}


#: config sections owned by some method (the rest: common to every run)
METHOD_SECTIONS = frozenset(s for entry in METHODS.values() for s in entry.sections)


def method(cfg: dict) -> Method:
    """The registry entry of ``cfg["method"]``, after the method's own config checks."""
    name = cfg["method"]
    if name not in METHODS:
        raise ConfigError(f"{cfg.get('name', 'job')}: method '{name}' is not one of {', '.join(METHODS)}")
    entry = METHODS[name]
    entry.controller.check_config(cfg)
    return entry
