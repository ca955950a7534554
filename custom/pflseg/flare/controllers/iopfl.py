"""IOP-FL workflows (Jiang et al., IEEE TMI 2023; pflseg/algorithms/METHODS.md, section "IOP-FL").

``IOPFLController`` (job ``iopfl``): FedAvg over the full state; each site keeps its local adapted model
P_k on its own disk (``pflseg.flare.sites.iopfl``). After the final test, when ``iopfl.publish`` is true,
every site submits its best P_k and the server writes the routing bundle ``bundle.pt`` into its state
folder: {"sites", "global.*" (the best global model by validation), "person.<site>.*"}. Publishing shares
the personalized models beyond the federation; the job config says so.

``IOPFLRoutingController`` (job ``iopfl_route``): a post-training job. It reads ``<iopfl.bundle>/bundle.pt``
(``iopfl.bundle`` must lie inside the server's state root, ``PostTrainingController.bundle_folder``),
sends it to the outside sites ``iopfl.targets`` (default: every connected site not in the bundle; an
inside site is refused) and collects each site's routing and comparator Dice into ``results.json``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pflseg.algorithms.iopfl import RULES
from pflseg.algorithms.robust import clip_updates
from pflseg.algorithms.routing import LOSS_WEIGHTS, RESTS, ROUTERS, SHAPE_REDUCTIONS
from pflseg.config import ConfigError, check_choice
from pflseg.flare.columns import Score, score
from pflseg.flare.controllers.base import PostTrainingController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.state import load_file, save_file
from pflseg.flare.wire import GLOBAL, PERSON, SITE, by_site, only, prefixed, unprefixed
from pflseg.infer.routing import COMPARATORS as ROUTE_SCORED
from pflseg.infer.routing import LABELS as ROUTE_LABELS
from pflseg.infer.routing import METHODS as ROUTE_METHODS
from pflseg.infer.routing import NORM as ROUTE_NORM
from pflseg.markdown import markdown_table

BUNDLE = "bundle.pt"


class IOPFLSection:
    """The ``iopfl`` section's rules, for every method that reads it (iopfl, iopfl_route): put first among the bases
    of its controller, before the ``RoundController`` whose ``check_config`` it extends."""

    ranges = {"iopfl.epochs": (1, 1000), "iopfl.steps": (0, 1_000_000), "iopfl.lr_trial_steps": (0, 1_000_000),
              "iopfl.batch_size": (1, 1024), "iopfl.shape_radius": (1, 64)}

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)  # type: ignore[misc]  # the controller's (ranges)
        iopfl = cfg["iopfl"]
        check_choice(cfg, "iopfl.rule", RULES, source)
        check_choice(cfg, "iopfl.router", ROUTERS, source)
        check_choice(cfg, "iopfl.loss_weights", (None, *LOSS_WEIGHTS), source)  # null = the router variant's own
        check_choice(cfg, "iopfl.rest", (None, *RESTS), source)
        check_choice(cfg, "iopfl.shape_reduction", SHAPE_REDUCTIONS, source)
        prior = iopfl["size_prior"]
        if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0 <= prior <= 1000:
            raise ConfigError(f"{source}: iopfl.size_prior must be a weight in [0, 1000] (0 = off), got {prior!r}")
        for key in ("norm_affine", "rot_flip"):  # null = the router variant's own
            if iopfl[key] is not None and not isinstance(iopfl[key], bool):
                raise ConfigError(f"{source}: iopfl.{key} must be true, false or null, got {iopfl[key]!r}")
        grid = iopfl["lr_grid"]  # null = the router variant's own
        if grid is not None and (not isinstance(grid, list) or len(grid) > 8 or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in grid)):
            raise ConfigError(f"{source}: iopfl.lr_grid must be null or a list of at most 8 positive learning rates "
                              f"([] = iopfl.lr), got {grid!r}")
        unknown = [m for m in iopfl["comparators"] if m not in ROUTE_SCORED]
        if unknown:
            raise ConfigError(f"{source}: iopfl.comparators: unknown {unknown}; a list of {', '.join(ROUTE_SCORED)} "
                              "([] = routing only)")
        if isinstance(iopfl["lr"], bool) or not iopfl["lr"] >= 0:
            raise ConfigError(f"{source}: iopfl.lr must be >= 0, got {iopfl['lr']!r}")
        if not 0.0 <= iopfl["tau"] <= 1.0:
            raise ConfigError(f"{source}: iopfl.tau must lie in [0, 1], got {iopfl['tau']}")


class IOPFLController(IOPFLSection, FedAvgController):
    task_meta = {"submit_model": {"round": "count", "fg_fraction": "fractions"}}

    def after_test(self, results: dict) -> dict:
        """With ``iopfl.publish``: every site submits its best P_k; the server writes the routing bundle. Returns
        results.json's ``bundle`` (its path) and ``person_round`` ({site: the round of its P_k}); nothing without."""
        if not self.cfg["iopfl"]["publish"] or self.abort_signal.triggered:
            return {}
        subs = self.send_each("submit_model", {s: self.message(self.n_rounds()) for s in self.sites},
                              reference=prefixed(SITE, self.state.global_state))
        best = self.state.best_state or self.state.global_state
        person, notes = self.bounded_person(subs, best)
        bundle = {"sites": sorted(subs), "person_round": {s: int(res.meta["round"]) for s, res in subs.items()},
                  "fg_fraction": {s: [float(x) for x in res.meta["fg_fraction"]] for s, res in subs.items()},
                  **prefixed(GLOBAL, best), **by_site(PERSON, person)}
        path = self.store.root / BUNDLE
        save_file(path, bundle)
        self.info(f"routing bundle (global + P_k of {bundle['sites']}) written to {path}")
        return {"bundle": str(path), "person_round": bundle["person_round"], **notes}

    def bounded_person(self, subs: dict, best: dict) -> tuple[dict, dict]:
        """Each published P_k with its difference from the bundle's global model ``best`` clipped at ``robust.clip`` x
        the median of the other sites' (``clip_updates``): routing mixes the experts, and starts from their average,
        so one site's P_k moves every outside site's model by at most that many honest P_k's. Returns ({site: P_k},
        results.json's ``person_update_ratio`` {site: its ratio to the others' median} and, when one was clipped,
        ``person_clipped`` {site: note}, named in the log too)."""
        sites = list(subs)
        ratio = self.cfg["robust"]["clip"]
        person, factors, ratios = clip_updates(best, [unprefixed(SITE, subs[s].params) for s in sites], ratio)
        clipped = {s: f"P_k - w_g clipped from {r:.3g} x to {ratio:g} x the median of the other sites' (robust.clip)"
                   for s, f, r in zip(sites, factors, ratios) if f < 1.0}
        for site, note in clipped.items():
            self.warning(f"submit_model: site {site}: {note}")
        notes = {"person_update_ratio": {s: round(r, 4) for s, r in zip(sites, ratios)}}
        return dict(zip(sites, person)), {**notes, **({"person_clipped": clipped} if clipped else {})}


class IOPFLRoutingController(IOPFLSection, PostTrainingController):
    task_metrics = {"route": {"route": "dict"}}

    def post_training(self) -> dict:
        iopfl = self.cfg["iopfl"]
        path = self.bundle_folder("iopfl.bundle") / BUNDLE
        if not iopfl["bundle"] or not path.is_file():
            raise ValueError(f"iopfl.bundle={iopfl['bundle']!r} holds no {BUNDLE}; set it to the trained IOP-FL run's "
                             "server "
                             "state folder (e.g. runs/iopfl/state/server/iopfl), trained with iopfl.publish: true")
        bundle = load_file(path)
        inside = list(bundle["sites"])
        targets = list(iopfl["targets"]) or [s for s in self.sites if s not in inside]
        problems = [f"{t} is an inside site (trained in the federation)" for t in targets if t in inside]
        problems += [f"{t} is not connected (connected: {self.sites})" for t in targets if t not in inside
                     and t not in self.sites]
        if problems or not targets:
            raise ValueError("iopfl.targets: "
                             + ("; ".join(problems) or f"no outside site connected (inside: {inside})")
                             + ". Test-time routing runs at outside sites only: list those in iopfl.targets")
        payload = only(bundle, GLOBAL, PERSON)
        fractions = bundle.get("fg_fraction")  # bundles written before the size prior have none
        prior = [sum(col) / len(col) for col in zip(*fractions.values())] if fractions else None
        self.info(f"routing bundle {path}: experts P_k of {inside} + global; size prior {prior}; sending to {targets}")
        res = self.send_each("route", {t: self.message(0, payload, inside_sites=inside, prior=prior)
                                       for t in targets})
        return {"inside_sites": inside, "targets": targets, "bundle": str(path), "prior": prior,
                "route": {s: r.metrics["route"] for s, r in res.items()}}


def read_route(method: str):
    """A reader (``pflseg.flare.columns``) of one method of the routing job (a routing variant or a comparator,
    ``pflseg.infer.routing.METHODS``) at an outside site."""
    def read(results: Mapping, site: str) -> Score:
        route = results["route"][site]
        return score(route["methods"][method], route)
    return read


def read_route_options(**treatments: str):
    """A reader of one comparator under several normalisation treatments (``{treatment: routing job method}``, e.g.
    ``running="global", batch="global_bn"``): ``{treatment: Score}``, for the bench to choose the statistics a new
    site uses by leave-one-inside-site-out, without its labels."""
    def read(results: Mapping, site: str) -> dict[str, Score]:
        route = results["route"][site]
        return {t: score(route["methods"][m], route) for t, m in treatments.items()}
    return read



def _less(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _expert_extremes(experts: Mapping) -> dict:
    """{"best_expert", "worst_expert"}: {"name", "dice"} of the experts with the highest and the lowest Dice with
    test-batch statistics at the site (None each when the run scored no expert)."""
    scored = [(n, d) for n, d in zip(experts.get("names") or [], experts.get("dice_bn") or []) if d is not None]
    if not scored:
        return {"best_expert": None, "worst_expert": None}
    best, worst = max(scored, key=lambda e: e[1]), min(scored, key=lambda e: e[1])
    return {"best_expert": {"name": best[0], "dice": best[1]}, "worst_expert": {"name": worst[0], "dice": worst[1]}}


def route_rows(results: Mapping, site: str) -> list[dict]:
    """The routing job's diagnostics at one outside site (``Method.diagnostics``; scoring only), one row per routing
    variant: its loss change (final - start), the Dice change of its final model (``routing``: ``routing_final``,
    else, in older results, ``routing``) against its start ``average_bn``, its routers' mean movement, its predicted
    foreground change (foreground / start - 1), the size prior, and the site's best and worst expert (Dice,
    test-batch statistics). A value the results lack is None; a site the job did not route, no row."""
    route = (results.get("route") or {}).get(site) or {}
    diag, coefs, methods = route.get("diagnostics") or {}, route.get("coefficients") or {}, route.get("methods") or {}
    start = (methods.get("average_bn") or {}).get("dice")
    experts = _expert_extremes(diag.get("experts") or {})
    prior = (diag.get("settings") or {}).get("prior")
    rows = []
    for variant, a in (diag.get("adaptation") or {}).items():
        final = "routing_final" if variant == "routing" and "routing_final" in methods else variant
        dice = (methods.get(final) or {}).get("dice")
        fg, fg0 = a.get("foreground"), a.get("start_foreground")
        rows.append({"variant": variant, "label": ROUTE_LABELS.get(variant, variant), "steps": a.get("steps"),
                     "loss_change": _less(a.get("final_loss"), a.get("start_loss")),
                     "start_dice": start, "dice": dice, "dice_change": _less(dice, start),
                     "movement": (coefs.get(variant) or {}).get("movement_mean"),
                     "foreground_change": fg / fg0 - 1 if fg is not None and fg0 else None, "prior": prior,
                     **experts})
    return rows

#: the routing job's comparators (``pflseg.infer.routing.NORM``) in the table's words; the routing variants are
#: ``pflseg.infer.routing.LABELS``. key -> (label, what it is)
ROUTE_COMPARATORS = {
    "global": ("Global", "the global model w_g as trained (FedAvg's)"),
    "global_bn": ("Global, test-batch BN", "w_g with the test batch's normalisation statistics"),
    "average": ("Average", "the weight average of the experts (P_1..P_K and w_g)"),
    "average_bn": ("Average, test-batch BN", "the weight average with test-batch statistics: the routed models' "
                                             "starting point"),
    "ensemble": ("Ensemble", "the mean of the experts' probabilities"),
    "ensemble_bn": ("Ensemble, test-batch BN", "the mean of the experts' probabilities, test-batch statistics"),
    "tent": ("Tent", "online Tent on w_g: one pass, the norm layers' affine parameters adapted"),
    "tent_epochs": ("Tent, routing's budget", "Tent for the routing step budget, per image its lowest-entropy "
                                              "prediction"),
    "tent_average": ("Tent from Average", "Tent started from the Average"),
    "routing_global": (None, "one coefficient per expert for the whole model (the paper's Global ablation)"),
    "routing_layer": (None, "one coefficient vector per layer, shared by the images"),
    "routing": (None, "the routed model: per-image, per-layer routers (iopfl.router)"),
    "routing_final": (None, "the routed model at the end of its run"),
}
_NORM_WORDS = {"running": "training's running statistics", "batch": "test-batch statistics"}


def route_label(key: str) -> str:
    """A routing job's column in words: the routing variants' ``LABELS``, the comparators' ``ROUTE_COMPARATORS``."""
    return ROUTE_LABELS.get(key) or (ROUTE_COMPARATORS.get(key, (None, ""))[0] or key)


def route_table(results: Mapping) -> str:
    """Markdown: one row per routed (outside) site, one column per method (test Dice), from the routing job's
    results.json; a line naming the outside and the inside sites above it, a legend of the columns under it."""
    rows = results["route"]
    methods = [m for m in ROUTE_METHODS if all(m in r["methods"] for r in rows.values())]
    table = markdown_table(["outside site", *map(route_label, methods), "routing s/sample/epoch"], [
        [site, *(f"{r['methods'][m]['dice']:.4f}" if r["methods"][m]["dice"] is not None else "-" for m in methods),
         f"{r['seconds_per_sample']:.4f}"] for site, r in sorted(rows.items())])
    inside = results.get("inside_sites")
    head = (f"Test Dice at the outside site(s) {', '.join(sorted(rows))} (never trained: the models were routed "
            "there, unlabeled)" + (f"; experts: P_k of the inside sites {', '.join(inside)} and the global model "
                                    "w_g" if inside else ""))
    legend = [f"- {route_label(m)}: {ROUTE_COMPARATORS.get(m, (None, ''))[1] or m}"
              + (f" [{_NORM_WORDS[ROUTE_NORM[m]]}]" if ROUTE_NORM.get(m) in _NORM_WORDS else "") for m in methods]
    return "\n".join([head, "", table, "", *legend, *route_diagnostics(rows)])


def route_diagnostics(rows: Mapping) -> list[str]:
    """Markdown lines: per outside site and routing variant, what the adaptation did (learning rate, steps, the
    unsupervised loss and the predicted foreground fraction from start to end against the size prior, the
    routers' mean movement from their start), and each expert's Dice there (scoring only: read
    from the site's labels after routing, never used by it). Empty for results without diagnostics."""
    lines, experts = [], []
    for site, r in sorted(rows.items()):
        diag, coefs = r.get("diagnostics") or {}, r.get("coefficients") or {}
        prior = ", ".join(f"{p:.4f}" for p in (diag.get("settings") or {}).get("prior") or []) or "-"
        for variant, a in (diag.get("adaptation") or {}).items():
            moved = (coefs.get(variant) or {}).get("movement_mean")
            lines.append([site, route_label(variant), f"{a['lr']:g}", str(a["steps"]),
                          f"{a['start_loss']:.4g} -> {a['final_loss']:.4g}",
                          f"{a['start_foreground']:.4f} -> {a['foreground']:.4f}", prior,
                          "-" if moved is None else f"{moved:.4f}"])
        if "experts" in diag:
            e = diag["experts"]
            experts.append(f"- {site}: " + ", ".join(f"{n} {d:.4f} / {b:.4f}" for n, d, b in
                                                      zip(e["names"], e["dice"], e["dice_bn"])))
    if not lines:
        return []
    table = markdown_table(["outside site", "routing variant", "lr", "steps", "loss start -> end",
                            "foreground start -> end", "size prior", "router movement"], lines)
    return ["", "Routing diagnostics (foreground: predicted foreground fraction of the test images; router movement: "
            "mean |coefficient - start| over layers):", "", table,
            *(["", "Each expert's test Dice there, running / test-batch statistics (scoring only):", *experts]
              if experts else [])]
