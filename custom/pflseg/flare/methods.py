"""The one registry of methods: name -> ``Method`` (server workflow, site class, config sections, table label,
bench and demo columns, the training job a post-training method reads).

Config validation, the allow list of package-mode deployments, the result tables, the bench, the demo, the CLI
and every runner read it. Adding a method = ``algorithms/<m>.py`` + ``flare/controllers/<m>.py`` +
``flare/sites/<m>.py`` + one entry here + ``app_configs/<m>.yaml`` (+ its section in ``defaults.yaml``, whose
rules and bounds are its controller's ``check_config`` and ``ranges``: ``method`` runs them; ``pflseg.config`` checks
the common keys only). tests/unit/flare/test_new_method.py adds one at test time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pflseg.config import ConfigError
from pflseg.flare.controllers.centralized import CentralizedController
from pflseg.flare.controllers.cross_site import CrossSiteController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.controllers.fedbn import FedBNController
from pflseg.flare.controllers.fedprox import FedProxController
from pflseg.flare.controllers.fedsm import FedSMController, FedSMInferenceController
from pflseg.flare.controllers.ft import FTController
from pflseg.flare.controllers.grace import GraceController
from pflseg.flare.controllers.iopfl import IOPFLController, IOPFLRoutingController
from pflseg.flare.controllers.lcfed import FedRepController, LCFedController
from pflseg.flare.controllers.local import LocalController
from pflseg.flare.sites.base import Site
from pflseg.flare.sites.centralized import CentralizedSite
from pflseg.flare.sites.cross_site import CrossSiteSite
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.flare.sites.fedbn import FedBNSite
from pflseg.flare.sites.fedprox import FedProxSite
from pflseg.flare.sites.fedsm import FedSMInferenceSite, FedSMSite
from pflseg.flare.sites.ft import FTSite
from pflseg.flare.sites.grace import GraceSite
from pflseg.flare.sites.iopfl import IOPFLRoutingSite, IOPFLSite
from pflseg.flare.sites.lcfed import FedRepSite, LCFedSite
from pflseg.flare.sites.local import LocalSite
from pflseg.infer.routing import LABELS as ROUTING_LABELS


class Method(NamedTuple):
    """Everything that describes one method; the runners, the bench, the demo, the tables and the CLI read it."""

    controller: type
    site: type[Site]
    #: the method's own config sections (defaults.yaml) that its controller and sites read; a run's identity
    #: (run.json) ignores every OTHER method's section, so a new key of one method does not void other runs
    sections: tuple[str, ...] = ()
    #: its name in the result tables (``pflseg run``); None: the job's name
    label: str | None = None
    #: ``pflseg bench --methods`` names this method serves (its own name: a default of the bench; others: runs of it
    #: under another job config, e.g. ``grace_server``) -> the inside table's columns: (label, job, key of the site's
    #: test metrics, backbone); key "super" is FedSM's super model. Every label is compared with the FedAvg of its own
    #: backbone (``pflseg.eval.bench.REFERENCE``).
    inside: Mapping[str, tuple] = {}
    #: the same names -> the outside table's columns: (label, job, source, normalisation treatment); sources: see
    #: ``pflseg.eval.bench.Bench.outside_dice``
    outside: Mapping[str, tuple] = {}
    #: a post-training method: (the training job whose models it uses, the config section whose ``bundle`` key takes
    #: that job's bundle, more keys of that section)
    after: tuple[str, str, Mapping] | None = None
    #: rows of ``pflseg demo``'s inside table: (label, job, key of the site's test metrics, backbone), and of its
    #: outside tables: (label, job, method of the routing job or "super", treatment); the demo's order is the registry's
    demo_inside: tuple = ()
    demo_outside: tuple = ()
    #: run by ``pflseg iopfl loso`` (every site held out once, the outside table)
    loso: bool = False


#: the order is the tables' row order
METHODS: dict[str, Method] = {
    "local": Method(LocalController, LocalSite, label="Local",
                    inside={"local": (("Local", "local", "site", "unet"),)}),
    "fedavg": Method(
        FedAvgController, FedAvgSite, label="FedAvg",
        inside={"fedavg": (("FedAvg", "fedavg", "global", "unet"),
                           ("FedAvg + AdaBN", "fedavg", "global_adabn", "unet"))},
        outside={"fedavg": (("FedAvg", "fedavg", "global", "running"),)},
        # the demo's FedAvg is the IOP-FL run's global model (bit for bit a FedAvg run at the same seed)
        demo_inside=(("FedAvg", "iopfl", "global", "unet"), ("FedAvg + AdaBN", "iopfl", "global_adabn", "unet")),
        demo_outside=(("FedAvg", "iopfl_route", "global", "running"), ("FedAvg", "iopfl_route", "global_bn", "batch"))),
    "fedprox": Method(FedProxController, FedProxSite, ("fedprox",), label="FedProx",
                      inside={"fedprox": (("FedProx", "fedprox", "global", "unet"),)}),
    "fedbn": Method(FedBNController, FedBNSite, label="FedBN", inside={"fedbn": (("FedBN", "fedbn", "site", "unet"),)},
                    demo_inside=(("FedBN", "fedbn", "site", "unet"),)),
    "ft": Method(FTController, FTSite, ("ft",), label="FT",
                 inside={"ft": (("FedAvg (LC-Fed net)", "ft", "global", "lcnet"), ("FT", "ft", "site", "lcnet"))}),
    "fedrep": Method(FedRepController, FedRepSite, ("lcfed",), label="FedRep",
                     inside={"fedrep": (("FedRep", "fedrep", "site", "lcnet"),)}),
    "fedsm": Method(
        FedSMController, FedSMSite, ("fedsm",), label="FedSM",
        inside={"fedsm": (("FedSM personalized", "fedsm", "site", "unet"),
                          ("FedSM super", "fedsm_infer", "super", "unet"))},
        outside={"fedsm": (("FedSM super", "fedsm_infer", "super", "running"),)},
        demo_inside=(("FedSM personalized", "fedsm", "site", "unet"),)),
    "grace": Method(
        GraceController, GraceSite, ("grace",), label="GRACE",
        inside={"grace": (("GRACE global", "grace", "global", "unet"), ("GRACE personalized", "grace", "site", "unet")),
                "grace_server": (("GRACE server-only global", "grace_server", "global", "unet"),),
                "grace_client": (("GRACE client-only personalized", "grace_client", "site", "unet"),),
                "grace_refcode": (("GRACE ref-code weights global", "grace_refcode", "global", "unet"),
                                  ("GRACE ref-code weights personalized", "grace_refcode", "site", "unet"))},
        outside={"grace": (("GRACE global", "grace", "global", "running"),),
                 "grace_server": (("GRACE server-only global", "grace_server", "global", "running"),),
                 "grace_client": (("GRACE client-only global", "grace_client", "global", "running"),),
                 "grace_refcode": (("GRACE ref-code weights global", "grace_refcode", "global", "running"),)},
        demo_inside=(("GRACE global", "grace", "global", "unet"), ("GRACE personalized", "grace", "site", "unet"))),
    "iopfl": Method(
        IOPFLController, IOPFLSite, ("iopfl",), label="IOP-FL", loso=True,
        inside={"iopfl": (("IOP-FL global", "iopfl", "global", "unet"), ("IOP-FL P_k", "iopfl", "site", "unet"))},
        # "route:<m>": method m of the routing job, which scores its static comparators under both treatments in the
        # very batches routing and Tent adapt on (the IOP-FL run's global model is FedAvg's, bit for bit, at one seed)
        outside={"iopfl": (("FedAvg (IOP-FL run)", "iopfl_route", "route:global", "running"),
                           ("FedAvg", "iopfl_route", "route:global_bn", "batch"),
                           ("Average", "iopfl_route", "route:average", "running"),
                           ("Average", "iopfl_route", "route:average_bn", "batch"),
                           ("Ensemble", "iopfl_route", "route:ensemble", "running"),
                           ("Ensemble", "iopfl_route", "route:ensemble_bn", "batch"),
                           ("Tent (online)", "iopfl_route", "route:tent", "batch"),
                           ("Tent (10 epochs, min-entropy)", "iopfl_route", "route:tent_epochs", "batch"),
                           ("Tent from Average (online)", "iopfl_route", "route:tent_average", "batch"),
                           (ROUTING_LABELS["routing_global"], "iopfl_route", "route:routing_global", "batch"),
                           (ROUTING_LABELS["routing_layer"], "iopfl_route", "route:routing_layer", "batch"),
                           (ROUTING_LABELS["routing"], "iopfl_route", "route:routing", "batch"),
                           (ROUTING_LABELS["routing_final"], "iopfl_route", "route:routing_final", "batch"))},
        demo_inside=(("IOP-FL P_k", "iopfl", "site", "unet"),)),
    # the routing job reaches every site outside the bundle: no targets
    "iopfl_route": Method(
        IOPFLRoutingController, IOPFLRoutingSite, ("iopfl",), after=("iopfl", "iopfl", {"targets": []}),
        demo_outside=(("Average", "iopfl_route", "average", "running"),
                      ("Ensemble", "iopfl_route", "ensemble", "running"),
                      ("Average", "iopfl_route", "average_bn", "batch"),
                      ("Ensemble", "iopfl_route", "ensemble_bn", "batch"),
                      ("Tent (online)", "iopfl_route", "tent", "batch"),
                      ("Tent from Average (online)", "iopfl_route", "tent_average", "batch"),
                      (ROUTING_LABELS["routing"], "iopfl_route", "routing", "batch"))),
    "fedsm_infer": Method(FedSMInferenceController, FedSMInferenceSite, ("fedsm",), after=("fedsm", "fedsm", {}),
                          demo_outside=(("FedSM super", "fedsm_infer", "super", "running"),)),
    "lcfed": Method(
        LCFedController, LCFedSite, ("lcfed",), label="LC-Fed",
        inside={"lcfed": (("LC-Fed w/o HC", "lcfed_nohc", "site", "lcnet"), ("LC-Fed", "lcfed", "site", "lcnet")),
                "lcfed_hczero": (("LC-Fed, HC on a zero map", "lcfed_hczero", "site", "lcnet"),),
                "lcfed_hcself": (("LC-Fed, HC on its own p(1-p)", "lcfed_hcself", "site", "lcnet"),)},
        demo_inside=(("LC-Fed", "lcfed", "site", "lcnet"),)),
    "centralized": Method(
        CentralizedController, CentralizedSite, label="Centralized",
        inside={"centralized": (("Centralized", "centralized", "global", "unet"),
                                ("Centralized (LC-Fed net)", "centralized_lcnet", "global", "lcnet"))}),
    # every final model of a training run at every site (any training job: cross_site.bundle; FedAvg's by default)
    "cross_site": Method(CrossSiteController, CrossSiteSite, ("cross_site",), after=("fedavg", "cross_site", {})),
}


#: config sections owned by some method (the rest: common to every run)
METHOD_SECTIONS = frozenset(s for entry in METHODS.values() for s in entry.sections)


def own_config(cfg: Mapping) -> dict:
    """``cfg`` without the sections of every OTHER method (an unregistered method: all of ``cfg``, as it is):
    what an exported job carries (``pflseg.flare.jobs.build_job``) and what decides a run's identity
    (``pflseg.deploy.simulator.run_record``). Nothing is lost: no method reads another's section, and the server's and
    the site's ``pflseg.config.check_effective`` merge the received config into defaults.yaml again."""
    entry = METHODS.get(cfg.get("method"))
    drop = METHOD_SECTIONS - set(entry.sections) if entry else frozenset()
    return {k: v for k, v in cfg.items() if k not in drop}


def method(cfg: dict, source: str | None = None) -> Method:
    """The registry entry of ``cfg["method"]``, after the method's own config checks (its controller's
    ``check_config``: ranges and rules of its sections; ``pflseg.config.validate`` checks the common keys only).

    Every path that loads or receives a config runs it: ``pflseg.flare.jobs.build_job`` (export, the CLI, the
    simulator, POC, the bench), the server's ``setup`` (``check_config``) and the site's first message
    (``pflseg.flare.client.answer``). ``source`` names the config in an error (default: the job's name)."""
    name = cfg["method"]
    source = source or f"job {cfg.get('name', 'config')}"
    if name not in METHODS:
        raise ConfigError(f"{cfg.get('name', 'job')}: method '{name}' is not one of {', '.join(METHODS)}")
    entry = METHODS[name]
    entry.controller.check_config(cfg, source)
    return entry
