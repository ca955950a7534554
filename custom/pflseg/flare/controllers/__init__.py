"""Server workflows, one per method (FedProx uses the FedAvg workflow)."""

from pflseg.flare.controllers.centralized import CentralizedController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.controllers.fedbn import FedBNController
from pflseg.flare.controllers.fedsm import FedSMController, FedSMInferenceController
from pflseg.flare.controllers.grace import GraceController
from pflseg.flare.controllers.ft import FTController
from pflseg.flare.controllers.iopfl import IOPFLController, IOPFLRoutingController
from pflseg.flare.controllers.lcfed import LCFedController
from pflseg.flare.controllers.local import LocalController

CONTROLLERS = {
    "fedavg": FedAvgController,
    "fedprox": FedAvgController,
    "fedbn": FedBNController,
    "local": LocalController,
    "centralized": CentralizedController,
    "fedsm": FedSMController,
    "fedsm_infer": FedSMInferenceController,
    "grace": GraceController,
    "iopfl": IOPFLController,
    "iopfl_route": IOPFLRoutingController,
    "lcfed": LCFedController,
    "fedrep": LCFedController,
    "ft": FTController,
}

__all__ = ["CONTROLLERS", "CentralizedController", "FedAvgController", "FedBNController", "FedSMController", "GraceController", "LocalController"]
