"""The one registry of methods: name -> ``Method`` (server workflow, site class, config sections, table label,
bench and demo columns, the training job a post-training method reads).

Config validation, the allow list of package-mode deployments, the result tables, the bench, the demo, the CLI
and every runner read it. Adding a method = ``algorithms/<m>.py`` + ``flare/controllers/<m>.py`` +
``flare/sites/<m>.py`` + one entry here + ``app_configs/<m>.yaml`` (+ its section in ``defaults.yaml``, whose
rules and bounds are its controller's ``check_config`` and ``ranges``: ``method`` runs them; ``pflseg.config`` checks
the common keys only). tests/unit/flare/test_new_method.py adds one at test time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from pflseg.config import ConfigError
from pflseg.flare.columns import Column
from pflseg.flare.controllers.centralized import CentralizedController
from pflseg.flare.controllers.cross_site import CrossSiteController
from pflseg.flare.controllers.ditto import DittoController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.controllers.fedbn import FedBNController
from pflseg.flare.controllers.fedprox import FedProxController
from pflseg.flare.controllers.fedsm import (
    FedSMController,
    FedSMInferenceController,
    infer_table,
    read_global,
    read_super,
    read_super_at,
    read_super_options,
)
from pflseg.flare.controllers.ft import FTController
from pflseg.flare.controllers.grace import GraceController
from pflseg.flare.controllers.iopfl import (
    IOPFLController,
    IOPFLRoutingController,
    read_route,
    read_route_options,
    route_rows,
    route_table,
)
from pflseg.flare.controllers.lcfed import FedRepController, LCFedController
from pflseg.flare.controllers.local import LocalController
from pflseg.flare.sites.base import Site
from pflseg.flare.sites.centralized import CentralizedSite
from pflseg.flare.sites.cross_site import CrossSiteSite
from pflseg.flare.sites.ditto import DittoSite
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

#: backbones of the inside table -> their words; each backbone's reference column (every inside column of that
#: backbone is paired with it)
BACKBONES = {"unet": "MONAI UNet", "lcnet": "LC-Fed's U-shaped net (no PCS unless LC-Fed)"}
REFERENCE = {"unet": "FedAvg", "lcnet": "FedAvg (LC-Fed net)"}
#: normalisation treatments of the outside table; a comparison is only ever made within one
TREATMENTS = {"running": "running statistics (as trained)", "batch": "test-batch statistics",
              "loso": "running or test-batch statistics, chosen by leave-one-inside-site-out"}
#: outside reference per treatment: the first of these labels present
OUTSIDE_REFERENCE = ("FedAvg", "FedAvg (IOP-FL run)")
#: the reference job: what a runner or a report runs when not told which (``pflseg poc``, the heterogeneity report's
#: federated model, the cost reports' baseline, the GPU check's sites and CPU reference, cross-site evaluation's bundle)
REFERENCE_JOB = "fedavg"


class Claim(NamedTuple):
    """An outside claim, declared before any run: ``label`` beats each of ``against`` under ``treatment``; it holds
    only when every interval lies above 0."""

    label: str
    against: tuple[str, ...]
    treatment: str


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
    #: under another job config, e.g. ``grace_server``) -> the inside table's ``Column``s (group: the backbone). Every
    #: label is compared with the FedAvg of its own backbone (``REFERENCE``).
    inside: Mapping[str, tuple[Column, ...]] = {}
    #: the same names -> the outside table's ``Column``s (group: the normalisation treatment)
    outside: Mapping[str, tuple[Column, ...]] = {}
    #: a post-training method: (the training job whose models it uses, the config section whose ``bundle`` key takes
    #: that job's bundle, more keys of that section)
    after: tuple[str, str, Mapping] | None = None
    #: rows of ``pflseg demo``'s inside and outside tables (``Column``s); the demo's order is the registry's
    demo_inside: tuple[Column, ...] = ()
    demo_outside: tuple[Column, ...] = ()
    #: the outside claims this method's paper makes (``Claim``), judged by the bench and the demo
    claims: tuple[Claim, ...] = ()
    #: config overrides of the demo's jobs of this method (merged into the demo's common settings)
    demo_settings: Mapping = {}
    #: a post-training job's own Markdown table of its results.json (``pflseg run``)
    table: Callable[[Mapping], str] | None = None
    #: a post-training job's diagnostics at one outside site (results.json, FLARE site name -> rows), reported by
    #: the bench under its outside claims; scoring only, nothing is chosen from them
    diagnostics: Callable[[Mapping, str], list[dict]] | None = None
    #: the controller's arguments besides ``config`` (``server_controller`` gives them, so an exported job carries
    #: them): what it must know of the other methods, which it does not import (this registry imports it)
    controller_args: Callable[[], Mapping] | None = None
    #: the cost reports that run this method by default (``report_jobs``): ``soak``, ``speed`` (beside
    #: ``REFERENCE_JOB``), ``gpu-dry-run`` (the one method of ``pflseg report gpu --dry-run``)
    reports: tuple[str, ...] = ()
    #: the training job whose whole run (global model, its curves and test scores) this method's run also yields, bit
    #: for bit, when every setting outside the method's own ``sections`` is the same (its sites train the global
    #: model exactly as that job's do; tests/unit/flare/sites/test_fedavg.py): the bench then reads that job's
    #: columns from this run and does not run it
    global_as: str | None = None


C = Column
SUPER_LOSO, SUPER_0 = "FedSM super (gamma by leave-one-site-out)", "FedSM super (gamma = 0)"
#: routing job columns: label, method of the routing job (``pflseg.infer.routing.METHODS``), treatment
_ROUTE = (("FedAvg (IOP-FL run)", "global", "running"), ("FedAvg", "global_bn", "batch"),
          ("Average", "average", "running"), ("Average", "average_bn", "batch"),
          ("Ensemble", "ensemble", "running"), ("Ensemble", "ensemble_bn", "batch"),
          ("Tent (online)", "tent", "batch"), ("Tent (10 epochs, min-entropy)", "tent_epochs", "batch"),
          ("Tent from Average (online)", "tent_average", "batch"),
          *((ROUTING_LABELS[m], m, "batch") for m in ("routing_global", "routing_layer", "routing", "routing_final")))
#: the static comparators with the statistics a new site would use chosen without its labels (bench: --holdout all)
_ROUTE_STATS = tuple(C(label, "iopfl_route", f"{m}_stats", "loso", read_route_options(running=m, batch=f"{m}_bn"))
                     for label, m in (("FedAvg", "global"), ("Average", "average"), ("Ensemble", "ensemble")))


def _routed(label: str, method: str, treatment: str) -> Column:
    return C(label, "iopfl_route", method, treatment, read_route(method))


#: the order is the tables' row order
METHODS: dict[str, Method] = {
    "local": Method(LocalController, LocalSite, label="Local",
                    inside={"local": (C("Local", "local", "site", "unet"),)}),
    "fedavg": Method(
        FedAvgController, FedAvgSite, label="FedAvg",
        inside={"fedavg": (C("FedAvg", "fedavg", "global", "unet"),
                           C("FedAvg + AdaBN", "fedavg", "global_adabn", "unet"))},
        outside={"fedavg": (C("FedAvg", "fedavg", "global", "running"),)},
        # the demo's FedAvg is the IOP-FL run's global model (bit for bit a FedAvg run at the same seed)
        demo_inside=(C("FedAvg", "iopfl", "global", "unet"), C("FedAvg + AdaBN", "iopfl", "global_adabn", "unet")),
        demo_outside=(_routed("FedAvg", "global", "running"), _routed("FedAvg", "global_bn", "batch"))),
    "fedprox": Method(FedProxController, FedProxSite, ("fedprox",), label="FedProx",
                      inside={"fedprox": (C("FedProx", "fedprox", "global", "unet"),)}),
    "ditto": Method(DittoController, DittoSite, ("ditto",), label="Ditto",
                    inside={"ditto": (C("Ditto global", "ditto", "global", "unet"),
                                      C("Ditto personalized", "ditto", "site", "unet"))}),
    "fedbn": Method(FedBNController, FedBNSite, label="FedBN",
                    inside={"fedbn": (C("FedBN", "fedbn", "site", "unet"),)},
                    demo_inside=(C("FedBN", "fedbn", "site", "unet"),),
                    # the GPU check's dry run: a site class of its own (FedBN's hooks) at FedAvg's cost
                    reports=("gpu-dry-run",)),
    "ft": Method(FTController, FTSite, ("ft",), label="FT",
                 inside={"ft": (C("FedAvg (LC-Fed net)", "ft", "global", "lcnet"), C("FT", "ft", "site", "lcnet"))}),
    "fedrep": Method(FedRepController, FedRepSite, ("lcfed",), label="FedRep",
                     inside={"fedrep": (C("FedRep", "fedrep", "site", "lcnet"),)}),
    "fedsm": Method(
        FedSMController, FedSMSite, ("fedsm",), label="FedSM", global_as="fedavg",
        inside={"fedsm": (C("FedSM personalized", "fedsm", "site", "unet"),
                          C("FedSM super", "fedsm_infer", "super", "unet", read_super))},
        # super: gamma chosen on the inside sites' validation (0 as a rule: their own models are best there); the
        # paper's outside claim is a gamma chosen without the unseen site's labels against gamma 0 and the global model
        outside={"fedsm": (C("FedSM super", "fedsm_infer", "super", "running", read_super),
                           C(SUPER_LOSO, "fedsm_infer", "super_loso", "running", read_super_options),
                           C(SUPER_0, "fedsm_infer", "super_0", "running", read_super_at(0.0)),
                           C("FedSM global", "fedsm_infer", "global", "running", read_global))},
        demo_inside=(C("FedSM personalized", "fedsm", "site", "unet"),),
        claims=(Claim(SUPER_LOSO, (SUPER_0, "FedSM global"), "running"),),
        reports=("soak",)),  # the most state per round: two models and the selector with its moments
    "grace": Method(
        GraceController, GraceSite, ("grace",), label="GRACE",
        inside={"grace": (C("GRACE global", "grace", "global", "unet"),
                          C("GRACE personalized", "grace", "site", "unet")),
                "grace_server": (C("GRACE server-only global", "grace_server", "global", "unet"),),
                "grace_client": (C("GRACE client-only personalized", "grace_client", "site", "unet"),),
                "grace_refcode": (C("GRACE ref-code weights global", "grace_refcode", "global", "unet"),
                                  C("GRACE ref-code weights personalized", "grace_refcode", "site", "unet"))},
        outside={"grace": (C("GRACE global", "grace", "global", "running"),),
                 "grace_server": (C("GRACE server-only global", "grace_server", "global", "running"),),
                 "grace_client": (C("GRACE client-only global", "grace_client", "global", "running"),),
                 "grace_refcode": (C("GRACE ref-code weights global", "grace_refcode", "global", "running"),)},
        demo_inside=(C("GRACE global", "grace", "global", "unet"), C("GRACE personalized", "grace", "site", "unet")),
        claims=(Claim("GRACE global", ("FedAvg",), "running"),),
        reports=("speed",)),  # the costliest server step: K x K similarities over every update
    "iopfl": Method(
        IOPFLController, IOPFLSite, ("iopfl",), label="IOP-FL", global_as="fedavg",
        inside={"iopfl": (C("IOP-FL global", "iopfl", "global", "unet"), C("IOP-FL P_k", "iopfl", "site", "unet"))},
        # the routing job scores its static comparators under both treatments in the very batches routing and Tent
        # adapt on (the IOP-FL run's global model is FedAvg's, bit for bit, at one seed)
        outside={"iopfl": (*(_routed(*row) for row in _ROUTE), *_ROUTE_STATS)},
        demo_inside=(C("IOP-FL P_k", "iopfl", "site", "unet"),),
        claims=(Claim(ROUTING_LABELS["routing"], ("FedAvg", "Average", "Tent (online)", "Tent from Average (online)"),
                      "batch"),),
        demo_settings={"iopfl": {"epochs": 3, "comparators": ["global", "average", "ensemble", "global_bn",
                                                              "average_bn", "ensemble_bn", "tent", "tent_average"]}}),
    # the routing job reaches every site outside the bundle: no targets
    "iopfl_route": Method(
        IOPFLRoutingController, IOPFLRoutingSite, ("iopfl",), after=("iopfl", "iopfl", {"targets": []}),
        table=route_table,
        diagnostics=route_rows,
        demo_outside=(_routed("Average", "average", "running"), _routed("Ensemble", "ensemble", "running"),
                      _routed("Average", "average_bn", "batch"), _routed("Ensemble", "ensemble_bn", "batch"),
                      _routed("Tent (online)", "tent", "batch"),
                      _routed("Tent from Average (online)", "tent_average", "batch"),
                      _routed(ROUTING_LABELS["routing"], "routing", "batch"))),
    "fedsm_infer": Method(FedSMInferenceController, FedSMInferenceSite, ("fedsm",), after=("fedsm", "fedsm", {}),
                          table=infer_table,
                          demo_outside=(C("FedSM super", "fedsm_infer", "super", "running", read_super),)),
    "lcfed": Method(
        LCFedController, LCFedSite, ("lcfed",), label="LC-Fed",
        inside={"lcfed": (C("LC-Fed w/o HC", "lcfed_nohc", "site", "lcnet"), C("LC-Fed", "lcfed", "site", "lcnet")),
                "lcfed_hczero": (C("LC-Fed, HC on a zero map", "lcfed_hczero", "site", "lcnet"),),
                "lcfed_hcself": (C("LC-Fed, HC on its own p(1-p)", "lcfed_hcself", "site", "lcnet"),)},
        demo_inside=(C("LC-Fed", "lcfed", "site", "lcnet"),)),
    "centralized": Method(
        CentralizedController, CentralizedSite, label="Centralized",
        inside={"centralized": (C("Centralized", "centralized", "global", "unet"),
                                C("Centralized (LC-Fed net)", "centralized_lcnet", "global", "lcnet"))}),
    # every final model of a training run at every site (any training job: cross_site.bundle; FedAvg's by default)
    "cross_site": Method(CrossSiteController, CrossSiteSite, ("cross_site",), after=(REFERENCE_JOB, "cross_site", {}),
                         controller_args=lambda: {"personalized_methods": personalized_methods()}),
}


#: config sections owned by some method (the rest: common to every run)
METHOD_SECTIONS = frozenset(s for entry in METHODS.values() for s in entry.sections)


def own_config(cfg: Mapping) -> dict:
    """``cfg`` without the sections of every OTHER method (an unregistered method: all of ``cfg``, as it is):
    what an exported job carries (``pflseg.flare.jobs.build_job``) and what decides a run's identity
    (``pflseg.deploy.workspace.run_record``). Nothing is lost: no method reads another's section, and the server's and
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


def report_jobs(report: str) -> tuple[str, ...]:
    """The jobs cost report ``report`` runs by default: the registered methods whose ``reports`` name it, in the
    registry's order (``soak``: FedSM; ``speed``: GRACE; ``gpu-dry-run``: FedBN)."""
    return tuple(name for name, entry in METHODS.items() if report in entry.reports)


def personalized_methods() -> list[str]:
    """The registered methods whose sites keep their own models (their site class's ``personalized``)."""
    return sorted(name for name, entry in METHODS.items() if entry.site.personalized)


def server_controller(cfg: dict):
    """The server's workflow of job config ``cfg`` (``pflseg.flare.jobs.build_job``): its method's controller (after
    the method's own config checks, ``method``) with ``own_config(cfg)`` and the registry's ``controller_args``."""
    entry = method(cfg)
    return entry.controller(config=own_config(cfg), **(entry.controller_args() if entry.controller_args else {}))
