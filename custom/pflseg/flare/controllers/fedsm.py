"""FedSM workflow (Xu et al., CVPR 2022): global model, one personalized model per site, model selector.

Per round, site k receives the global model, ITS OWN personalized model only, the selector (with the
selector's averaged Adam moments in ``softmax`` / ``batch`` mode) and its selector label k (meta
``selector_label``); it returns the two trained models, its part of the selector's fit and n_k. The server then

    w_g <- sum_k p_k w_g,k                                                        (fedavg)
    {w_p,k} <- SoftPull({w_p,k}, lam)                                            (softpull)
    selector, by fedsm.selector_fit / selector_steps (pflseg.algorithms.fedsm):
      lda            head <- lda_head(sum over sites of the feature statistics)  (conv stack fixed)
      softmax epoch  w_s <- one Adam step on sum_k grad_k, moments kept here     (pooled_adam_step)
      softmax batch  w_s <- sum_k p_k w_s,k ;  moments <- sum_k p_k m_k          (fedavg / fedsm)

The selector used at inference is the best one by n_k-weighted validation accuracy of the selector the sites
RECEIVED (each round's, and the final one, scored at every site before it is fitted on), with the
temperature of lowest summed validation NLL (``best_selector`` in the checkpoints, ``final.pt`` and
``results.json``; ``bestselect.*`` its weights). FedSM-extra's selector rounds start a fresh (K+1)-class
selector and a fresh best. A site that drops out of a round (or whose answer is refused) keeps its personalized
model unchanged and stays out of that round's SoftPull mix (lam at least 1 / the sites mixed); with ``lda`` its
latest accepted statistics stay in the sum. Every
round's checkpoint holds all K personalized models, the selector, the moments, the statistics and the best
selector.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from nvflare.app_common.abstract.fl_model import FLMetaKey

from pflseg.algorithms.fedsm import (
    MIXINGS,
    SELECTOR_FITS,
    SELECTOR_INPUTS,
    SELECTOR_STEPS,
    TEMPERATURES,
    add_statistics,
    average_moments,
    best_temperature,
    check_statistics,
    lda_gaussians,
    lda_head,
    pooled_adam_step,
    scale_statistics,
)
from pflseg.algorithms.robust import bound_moments, check_moments, clip_statistics, clip_updates
from pflseg.algorithms.softpull import check_lam, lam_for, softpull
from pflseg.config import ConfigError, check_choice, check_lr
from pflseg.flare import guard
from pflseg.flare.checks import is_number
from pflseg.flare.columns import Score, score
from pflseg.flare.controllers.base import PostTrainingController, RoundController, RoundOutput
from pflseg.flare.server_state import BY_SITE, NET, ServerState
from pflseg.flare.state import RoundStore
from pflseg.flare.wire import (
    BEST,
    BEST_PERSON,
    BEST_SELECT,
    FAMILIAR,
    GLOBAL,
    GRAD,
    LDA_STATS,
    MOMENT,
    PERSON,
    SELECT,
    STATS,
    by_site,
    only,
    prefixed,
    sites_in,
    split_by_site,
    unprefixed,
)
from pflseg.markdown import markdown_table
from pflseg.nets.selector import SELECTOR_DEFAULTS, build_selector, selector_cfg


def moment_reference(selector) -> dict:
    """Expected keys and shapes of the selector's flattened Adam moments in a site's answer."""
    ref = {}
    for i, (_, p) in enumerate(selector.named_parameters()):
        ref.update(prefixed(f"{MOMENT}.{i}", {"exp_avg": p, "exp_avg_sq": p, "step": torch.zeros(())}))
    return ref


def selector_reference(selector, fedsm: dict) -> dict:
    """Expected keys, shapes and dtypes of the selector part of a site's answer (see the module docstring)."""
    if fedsm["selector_fit"] == "lda":
        d, c = selector.classifier.in_features, selector.classifier.out_features
        f64 = dict(dtype=torch.float64)
        return prefixed(STATS, {"gram": torch.zeros(d, d, **f64), "sum": torch.zeros(c, d, **f64),
                                "count": torch.zeros(c, **f64)})
    if fedsm["selector_steps"] == "epoch":
        return prefixed(GRAD, dict(selector.named_parameters()))
    return {**prefixed(SELECT, selector.state_dict()), **moment_reference(selector)}


class FedSMSection:
    """The ``fedsm`` section's rules, for every method that reads it (fedsm, fedsm_infer): put first among the bases
    of its controller, before the ``RoundController`` whose ``check_config`` it extends."""

    ranges = {"fedsm.extra_rounds": (0, 10_000), "fedsm.selector_epochs": (1, 1000)}

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)  # type: ignore[misc]  # the controller's (ranges)
        fedsm = cfg["fedsm"]
        check_lr(cfg, "fedsm.selector_lr", source)
        if not 0.0 <= fedsm["lam"] <= 1.0 or not 0.0 <= fedsm["gamma"] <= 1.0:
            raise ConfigError(f"{source}: fedsm.lam and fedsm.gamma must lie in [0, 1], got {fedsm['lam']}, "
                              f"{fedsm['gamma']}")
        if fedsm["selector"] not in SELECTOR_DEFAULTS or fedsm["selector_steps"] not in SELECTOR_STEPS:
            raise ConfigError(f"{source}: fedsm.selector must be compact|vgg11 and fedsm.selector_steps epoch|batch")
        check_choice(cfg, "fedsm.selector_fit", SELECTOR_FITS, source)
        check_choice(cfg, "fedsm.selector_input", SELECTOR_INPUTS, source)
        check_choice(cfg, "fedsm.mixing", MIXINGS, source)
        if not 0.0 < fedsm["lda_shrinkage"] <= 1.0:
            raise ConfigError(f"{source}: fedsm.lda_shrinkage must lie in (0, 1], got {fedsm['lda_shrinkage']}")
        if fedsm["selector_steps"] == "epoch" and fedsm["selector_epochs"] != 1:
            raise ConfigError(f"{source}: fedsm.selector_epochs={fedsm['selector_epochs']} needs "
                              "fedsm.selector_steps: batch; epoch mode takes exactly one full-batch step per round, on "
                              "the server, on the pooled gradient")
        if any(not 0.0 <= g <= 1.0 for g in fedsm["gammas"]):
            raise ConfigError(f"{source}: every fedsm.gammas value must lie in [0, 1], got {fedsm['gammas']}")
        if not 0.0 < fedsm["familiar_quantile"] <= 1.0:
            raise ConfigError(f"{source}: fedsm.familiar_quantile must lie in (0, 1] (1 = the largest inside "
                              f"validation distance), got {fedsm['familiar_quantile']}")
        cls.check_amp(cfg, source)

    @staticmethod
    def check_amp(cfg: dict, source: str = "config") -> None:
        """fp16 with the epoch-mode selector gradient is refused: the gradient leaves the site unscaled, without an
        optimizer step for a gradient scaler to skip (the sites check it again before any work)."""
        fedsm = cfg["fedsm"]
        if cfg["train"]["amp"] == "fp16" and fedsm["selector_fit"] == "softmax" and fedsm["selector_steps"] == "epoch":
            raise ConfigError(f"{source}: train.amp=fp16 needs a gradient scaler around each backward pass, and "
                              "FedSM's epoch-mode selector gradient (fedsm.selector_fit: softmax, selector_steps: "
                              "epoch) is sent unscaled, without an optimizer step to skip; use train.amp: bf16 (or "
                              "off), or fedsm.selector_steps: batch, or fedsm.selector_fit: lda")


class FedSMController(FedSMSection, RoundController):
    task_metrics = {**RoundController.task_metrics, "train_selector": {"selector_loss": "number"}}
    weighted_tasks = (*RoundController.weighted_tasks, "train_selector")
    def declare(self, state: ServerState) -> None:
        """FedSM's parts of the server state: the selector, its Adam moments and each site's personalized model
        (guarded with the global model), each site's best personalized model and its record, each site's latest LDA
        statistics (lda), the best selector and its record."""
        super().declare(state)
        check_lam(self.cfg["fedsm"]["lam"], len(self.sites))
        torch.manual_seed(self.cfg["seed"])
        state.add("selector", self.use_selector(len(self.sites)), NET, SELECT, guarded=True)
        state.add("moments", {}, NET, MOMENT, guarded=True)
        state.add("person", {s: dict(state.global_state) for s in self.sites}, BY_SITE, PERSON, guarded=True)
        state.add("best_person_state", {s: dict(state.global_state) for s in self.sites}, BY_SITE, BEST_PERSON)
        state.add("best_person", {s: {"round": -1, "score": -1.0} for s in self.sites})
        state.add("lda_stats", {}, BY_SITE, LDA_STATS)
        state.add("best_selector_state", {}, NET, BEST_SELECT)
        state.add("best_selector", {"round": -1, "score": -1.0})

    def restore(self) -> int:
        start = super().restore()
        if start > self.cfg["rounds"]:  # resumed inside the extra phase: the saved selector has K + 1 classes
            self.use_selector(len(self.sites) + 1)
        return start

    def use_selector(self, classes: int) -> dict:
        """A fresh selector of ``classes`` outputs: what the sites' answers about it must look like (``moment_ref``,
        ``selector_ref``); returns its initial weights (seeded by the caller)."""
        selector = build_selector(selector_cfg(self.cfg, classes))
        self.moment_ref = moment_reference(selector)
        self.selector_ref = selector_reference(selector, self.cfg["fedsm"])
        return {k: v.detach().clone() for k, v in selector.state_dict().items()}

    def track_best(self, r: int, results: dict, state: dict, selector: dict | None = None) -> dict:
        """Best global as in every method; for each site the personalized model it sent with the best validation
        Dice at that site; the best selector of those the sites received (what the inference job hands out):
        ``selector``, the one this task sent (default: the final validate task's, ``final_selector``). Returns the
        round's entries (``val_dice``, ``val_dice_mean``, ``selector_val_acc_mean``)."""
        metrics = super().track_best(r, results, state)
        for site, res in results.items():
            score = res.metrics.get("val_dice_person")
            if score is not None and score > self.state.best_person[site]["score"]:
                self.state.best_person[site] = {"round": r, "score": score}
                self.state.best_person_state[site] = dict(self.state.person[site])
        return {**metrics, **self.track_selector(r, results, self.final_selector() if selector is None else selector)}

    def track_selector(self, r: int, results: dict, sent: dict) -> dict:
        """Keep ``sent`` (the selector the sites received and scored) when its validation accuracy, weighted by
        the sites' n_k, is the best so far; its temperature is the one of lowest summed validation NLL. Sites
        whose answer carries no usable accuracy (or NLL list) are left out of the mean (of the sum). Returns the
        round's entry ``selector_val_acc_mean`` (none when no site scored it)."""
        acc = {s: res.metrics.get("selector_val_acc") for s, res in results.items()}
        acc = {s: float(a) for s, a in acc.items() if is_number(a) and 0.0 <= a <= 1.0}
        if not acc:
            return {}
        weight = {s: self.state.n_first.get(s, 1) for s in acc}  # first accepted n_k, capped by guard.screen
        score = guard.validation_score([(acc[s], weight[s]) for s in acc], self.cfg)
        if score <= self.state.best_selector["score"]:
            return {"selector_val_acc_mean": score}
        nll = [res.metrics.get("selector_val_nll") for res in results.values()]
        nll = [v for v in nll if isinstance(v, list) and len(v) == len(TEMPERATURES)
               and all(is_number(x) and math.isfinite(x) for x in v)]
        temperature = best_temperature([sum(col) for col in zip(*nll)]) if nll else 1.0
        fedsm = self.cfg["fedsm"]
        self.state.best_selector = {"round": r, "score": score, "temperature": temperature,
                                    "input": fedsm["selector_input"],
                                    "head": "linear" if fedsm["selector_fit"] == "lda" else "mlp"}
        self.state.best_selector_state = dict(sent)
        return {"selector_val_acc_mean": score}

    def n_rounds(self) -> int:
        return self.cfg["rounds"] + self.cfg["fedsm"]["extra_rounds"]

    def check_result(self, task: str, site: str, res, reference: dict | None) -> str | None:
        """The base checks; for lda statistics also that they are statistics of the site's n_k images
        (``check_statistics``: whole counts summing to n_k, in FedSM's rounds for the site's own class only, a Gram
        matrix consistent with the class sums); for the selector's Adam moments (softmax, batch) ``check_moments``:
        exp_avg_sq >= 0, |exp_avg| within Adam's bound, each step at least the one sent + 1 and at most it + n_k x
        ``fedsm.selector_epochs`` (one image per step at least)."""
        reason = super().check_result(task, site, res, reference)
        if reason or task not in self.weighted_tasks:
            return reason
        fedsm = self.cfg["fedsm"]
        if fedsm["selector_fit"] == "softmax" and fedsm["selector_steps"] == "batch":
            n_k = res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND]
            sent = self.state.moments
            reason = check_moments(unprefixed(MOMENT, res.params), sent, n_k * fedsm["selector_epochs"])
            return f"selector moments: {reason}" if reason else None
        if fedsm["selector_fit"] != "lda":
            return None
        own = self.sites.index(site) if task == "train" and site in self.sites else None  # FedSM: class k = site k
        reason = check_statistics(unprefixed(STATS, res.params), res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND], own)
        return f"selector statistics of site {site}: {reason}" if reason else None

    def selector_payload(self) -> dict:
        """The selector as the sites receive it (with the averaged moments in batch mode)."""
        batch = self.cfg["fedsm"]["selector_fit"] == "softmax" and self.cfg["fedsm"]["selector_steps"] == "batch"
        return {**prefixed(SELECT, self.state.selector), **(prefixed(MOMENT, self.state.moments) if batch else {})}

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        """The new global model: w_g <- sum_k p_k w_g,k over every key (or ``robust.aggregation``'s rule), so no key
        of the current ``state`` stays. Returns (the new global model, the round's entries: none)."""
        weights = [res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] for res in results.values()]
        return guard.aggregate(self.cfg, [unprefixed(GLOBAL, res.params) for res in results.values()], weights,
                               r=r), {}

    def fit_selector(self, results: dict, selector: dict, moments: dict, lda_stats: dict) -> tuple[dict, dict, dict]:
        """The new selector from the sites' answers and the current ``selector``, its Adam ``moments`` and each
        site's latest LDA statistics ``lda_stats`` (see the module docstring). Returns the three, new."""
        fedsm = self.cfg["fedsm"]
        if fedsm["selector_fit"] == "lda":  # each site's statistics weighed as its n_k (capped by guard.screen)
            fresh = {s: unprefixed(STATS, res.params) for s, res in results.items()}
            fresh = {s: scale_statistics(st, min(1.0, results[s].meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND]
                                                 / max(float(st["count"].sum()), 1.0)))
                     for s, st in fresh.items()}
            # each fresh site's statistics clipped: its feature mean and spread at robust.clip x the others'
            # (clip_statistics); a site that did not answer keeps its statistics as they were judged when they came
            merged = {**lda_stats, **fresh}
            sites = list(merged)
            stats, factors, ratios = clip_statistics([merged[s] for s in sites], self.cfg["robust"]["clip"])
            guard.note_clips(self, results, "selector statistics", sites, factors, ratios)
            lda_stats = {**lda_stats, **{s: st for s, st in zip(sites, stats) if s in fresh}}
            weight, bias = lda_head(add_statistics(list(lda_stats.values())), fedsm["lda_shrinkage"])
            return {**selector, "classifier.weight": weight, "classifier.bias": bias}, moments, lda_stats
        if fedsm["selector_steps"] == "epoch":
            grads = [unprefixed(GRAD, res.params) for res in results.values()]
            # each site's summed gradient clipped at robust.clip x the others' median norm (clip_updates from zero)
            zero = {k: torch.zeros_like(v) for k, v in grads[0].items()}
            grads, factors, ratios = clip_updates(zero, grads, self.cfg["robust"]["clip"])
            guard.note_clips(self, results, "selector gradient", list(results), factors, ratios)
            if self.cfg["robust"]["aggregation"] != "mean":  # the sum = K x the robust combination (unweighted)
                combined = guard.aggregate(self.cfg, grads, [1.0] * len(grads))
                grads = [{k: v * len(results) for k, v in combined.items()}]
            selector, moments = pooled_adam_step(selector, grads, moments, fedsm["selector_lr"])
            return selector, moments, lda_stats
        weights = [res.meta[FLMetaKey.NUM_STEPS_CURRENT_ROUND] for res in results.values()]
        selector = guard.aggregate(self.cfg, [unprefixed(SELECT, res.params) for res in results.values()], weights)
        sent = [unprefixed(MOMENT, res.params) for res in results.values()]
        moments = bound_moments(average_moments(sent, weights, **guard.robust_args(self.cfg)), sent)
        return selector, moments, lda_stats

    def softpull_step(self, results: dict, person: dict) -> dict:
        """SoftPull ({w_p,k} <- SoftPull({w_p,k}, lam)) over the personalized models the sites sent back this round
        (``lam_for``: lam at least 1 / their number); a site that did not answer, or whose answer was refused, keeps
        its model ``person[site]`` and stays out of the others' mix (issue 39: a refused site's stale model, its
        initial one when it never got in, entered every honest site's mix: the honest sites' Dice -0.035 at K = 5,
        5 seeds, and -0.172 at K = 3, 2 seeds, against honest runs; docs/privacy.md). Returns the new {site:
        personalized model}."""
        trained = {s: unprefixed(PERSON, res.params) for s, res in results.items()}
        sites = [s for s in self.sites if s in trained]
        lam = lam_for(self.cfg["fedsm"]["lam"], len(sites)) if sites else 1.0
        mixed = dict(zip(sites, softpull([trained[s] for s in sites], lam))) if sites else {}
        return {s: mixed.get(s, person[s]) for s in self.sites}

    def round(self, r: int) -> RoundOutput:
        if r >= self.cfg["rounds"]:
            return self.extra_round(r)
        sent_selector = dict(self.state.selector)
        common = {**prefixed(GLOBAL, self.state.global_state), **self.selector_payload()}
        payloads = {s: self.message(r, {**common, **prefixed(PERSON, self.state.person[s])}, selector_label=k)
                    for k, s in enumerate(self.sites)}
        reference = {**prefixed(GLOBAL, self.state.global_state), **prefixed(PERSON, self.state.global_state),
                     **self.selector_ref}
        results = self.send_each("train", payloads, reference=reference)
        metrics = self.track_best(r, results, self.state.global_state, sent_selector)
        self.state.global_state, more = self.aggregate(results, self.state.global_state, r)
        self.state.selector, self.state.moments, self.state.lda_stats = self.fit_selector(
            results, self.state.selector, self.state.moments, self.state.lda_stats)
        self.state.person = self.softpull_step(results, self.state.person)
        return RoundOutput.of(results, {**metrics, **more})

    def extra_round(self, r: int) -> RoundOutput:
        """FedSM-extra: only the (K+1)-class selector trains; every site gets all personalized models."""
        # a fresh selector over {global, personalized 1..K}: fresh moments, statistics, best
        if r == self.cfg["rounds"]:
            torch.manual_seed(self.cfg["seed"] + 1)
            self.state.selector = self.use_selector(len(self.sites) + 1)
            self.state.moments, self.state.lda_stats = {}, {}
            self.state.best_selector, self.state.best_selector_state = {"round": -1, "score": -1.0}, {}
        sent_selector = dict(self.state.selector)
        person = by_site(PERSON, {s: self.state.person[s] for s in self.sites})
        payload = {**prefixed(GLOBAL, self.state.global_state), **person, **self.selector_payload()}
        results = self.send_each("train_selector", {s: self.message(r, payload) for s in self.sites},
                                 reference=self.selector_ref)
        metrics = {"selector_loss": {s: res.metrics["selector_loss"] for s, res in results.items()},
                   **self.track_selector(r, results, sent_selector)}
        self.state.selector, self.state.moments, self.state.lda_stats = self.fit_selector(
            results, self.state.selector, self.state.moments, self.state.lda_stats)
        return RoundOutput.of(results, metrics)

    def final_selector(self) -> dict:
        """The selector the final validate (and test) task sends, which the sites score as a candidate for the best
        selector (``track_best``): the last one; none after FedSM-extra rounds (the (K+1)-class selector's labels need
        every site's models)."""
        return {} if self.cfg["fedsm"]["extra_rounds"] else dict(self.state.selector)

    def final_params(self, site: str) -> dict:
        """The final validate (and test) task: global and own personalized model and the ``final_selector``."""
        return {**prefixed(GLOBAL, self.state.global_state), **prefixed(PERSON, self.state.person[site]),
                **prefixed(SELECT, self.final_selector())}

    def extra_results(self) -> dict:
        """The selector that inference uses: its round (``rounds`` = the final selector after the last round),
        n_k-weighted validation accuracy, temperature, input rule and head."""
        return {"best_selector_round": self.state.best_selector["round"], "best_selector": self.state.best_selector}


class FedSMInferenceController(FedSMSection, PostTrainingController):
    """Post-training job: hand the trained super model to every connected site (inside sites and sites that
    never trained) and collect, per site, the test Dice of the global, own personalized (inside sites only)
    and super model for every gamma, with how many images each model got (the selection histogram).
    The selector is the bundle's best by validation (``bestselect.*``, with its temperature, input rule and
    head from ``best_selector``; a bundle without them: its last selector, T = 1, z-scored input, mlp head).
    ``fedsm.bundle`` must lie inside the server's state root (``PostTrainingController.bundle_folder``).

    Familiarity fallback (``fedsm.familiar_fallback``, lda selectors: the bundle's pooled ``ldastats``): two
    phases. The inside sites are sent ``infer`` first, with the LDA Gaussians of the selector's features
    (``lda_gaussians``); each returns its validation images' d2_min (``min_mahalanobis``) beside its scores. The
    threshold tau is the ``fedsm.familiar_quantile`` quantile of the pooled inside-validation d2_min; the sites
    outside the bundle are then sent ``infer`` with tau (meta ``familiar_tau``): an image farther than tau from
    every class goes to the global model whatever the selector says. A bundle without statistics (softmax
    selector) or with statistics of other features than its selector's: no fallback, said in the log."""

    task_metrics = {"infer": {"infer": "dict"}}

    def post_training(self) -> dict:
        bundle = RoundStore(self.bundle_folder("fedsm.bundle"), clean=False)  # another job's folder: read only
        if not self.cfg["fedsm"]["bundle"] or bundle.latest() is None:
            raise ValueError(f"fedsm.bundle={self.cfg['fedsm']['bundle']!r} holds no FedSM checkpoint (round_NNNN.pt); "
                             "set it to the trained run's server state folder, e.g. runs/fedsm/state/server/fedsm")
        source = bundle.final_path if bundle.final_path.is_file() else bundle.path(bundle.latest())
        ckpt = bundle.final()
        inside = sites_in(PERSON, ckpt)
        chosen = BEST_PERSON if only(ckpt, BEST_PERSON) else PERSON
        person = prefixed(PERSON, unprefixed(chosen, ckpt))
        best = unprefixed(BEST, ckpt) or unprefixed(GLOBAL, ckpt)
        selector = unprefixed(BEST_SELECT, ckpt) or unprefixed(SELECT, ckpt)
        info = dict(ckpt.get("best_selector") or {}) if unprefixed(BEST_SELECT, ckpt) else {}
        meta = {"selector_temperature": float(info.get("temperature", 1.0)),
                "selector_input": info.get("input", "zscore")}
        familiar, why_not = self.familiarity(ckpt, inside, selector)
        payload = {**prefixed(GLOBAL, best), **person, **prefixed(SELECT, selector)}
        self.info(f"super model from {source}: inside sites {inside}; selector of round {info.get('round', 'last')} "
                  f"(T = {meta['selector_temperature']:.3g}, input {meta['selector_input']}); sending to {self.sites}")
        send = lambda sites, params, **more: self.send_each(  # noqa: E731
            "infer", {s: self.message(0, params, inside_sites=inside, **meta, **more) for s in sites}) if sites else {}
        if not familiar:  # one phase, every site at once
            self.info(f"familiarity fallback: none ({why_not})")
            res, report = send(self.sites, payload), {"enabled": False, "reason": why_not}
        else:  # the inside sites first: their validation distances set tau for the sites outside the bundle
            res = send([s for s in self.sites if s in inside], {**payload, **prefixed(FAMILIAR, familiar)})
            tau, report = self.familiar_threshold({s: r.metrics["infer"] for s, r in res.items()})
            outside = [s for s in self.sites if s not in inside]
            if tau is None:
                res = {**res, **send(outside, payload)}
            else:
                res = {**res, **send(outside, {**payload, **prefixed(FAMILIAR, familiar)}, familiar_tau=tau)}
        infer = {s: r.metrics["infer"] for s, r in sorted(res.items())}
        for r in infer.values():
            r.pop("validation_d2_min", None)  # consumed: tau and the number of values are in the report
        gamma = choose_gamma(infer)
        if report.get("enabled"):
            report = {**report, **familiar_report(infer, gamma.get("gamma_selected"))}
        return {"inside_sites": inside, "bundle": str(source), "infer": infer, "selector": {**info, **meta}, **gamma,
                "familiarity": report,
                **selection_report(infer, inside, self.cfg["fedsm"]["gamma"], gamma.get("gamma_selected"))}

    def familiarity(self, ckpt: dict, inside: list[str], selector: dict) -> tuple[dict, str]:
        """``({"mean", "precision"}, "")`` of the selector's features (``lda_gaussians`` of the bundle's pooled
        ``ldastats``, ``fedsm.lda_shrinkage``), or ``({}, why there is no fallback)``."""
        fedsm = self.cfg["fedsm"]
        if not fedsm["familiar_fallback"]:
            return {}, "fedsm.familiar_fallback is false: the selector alone routes every image"
        stats = [st for st in split_by_site(LDA_STATS, ckpt, inside).values() if st]
        if not stats:
            return {}, ("the bundle holds no LDA statistics (ldastats.*: a softmax selector): the selector alone "
                        "routes every image")
        pooled, weight = add_statistics(stats), selector.get("classifier.weight")
        if weight is None or tuple(pooled["sum"].shape) != tuple(weight.shape):
            shape = None if weight is None else tuple(weight.shape)
            return {}, (f"the bundle's LDA statistics (classes x features {tuple(pooled['sum'].shape)}) do not "
                        "describe "
                        f"its selector's head ({shape}): the selector alone routes every image")
        return lda_gaussians(pooled, fedsm["lda_shrinkage"]), ""

    def familiar_threshold(self, inside: dict) -> tuple[float | None, dict]:
        """tau = the ``fedsm.familiar_quantile`` quantile of the inside sites' pooled validation d2_min, and the report
        ``{"enabled", "quantile", "tau", "n_validation"}``; values that are not finite numbers >= 0 are left out.
        No usable value: ``(None, {"enabled": False, "reason"})``, said in the log."""
        sent = {s: r.get("validation_d2_min") for s, r in inside.items()}
        values = [float(v) for d in sent.values() if isinstance(d, list) for v in d
                  if is_number(v) and math.isfinite(v) and v >= 0]
        if not values:
            why = f"no inside site (of {sorted(sent)}) sent usable validation distances (validation_d2_min)"
            self.info(f"familiarity fallback: none ({why})")
            return None, {"enabled": False, "reason": why}
        q = self.cfg["fedsm"]["familiar_quantile"]
        tau = float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))
        self.info(f"familiarity fallback: tau = {tau:.4g}, the {q} quantile of {len(values)} inside validation d2_min "
                  f"values; an outside image farther than tau from every site's class mean goes to the global model")
        return tau, {"enabled": True, "quantile": q, "tau": tau, "n_validation": len(values)}


def choose_gamma(infer: dict) -> dict:
    """The gamma with the best mean super-model Dice on the inside sites' VALIDATION splits (never test), and
    every site's test Dice at it:
    ``{"gamma_selected", "gamma_validation": {gamma: mean}, "test_at_gamma": {site: dice}}``. FedSM-extra has no gamma
    (empty dict)."""
    val = [r["validation"] for r in infer.values() if r.get("validation")]
    gammas = [g for g in (val[0] if val else {}) if g != "extra"]
    if not gammas:
        return {}
    means = {g: sum(v[g]["dice"] for v in val) / len(val) for g in gammas}
    best = max(gammas, key=lambda g: (means[g], -gammas.index(g)))
    return {"gamma_selected": float(best), "gamma_validation": means,
            "test_at_gamma": {s: r["super"][best]["dice"] for s, r in infer.items()}}


def selection_report(infer: dict, inside: list[str], reference: float, selected: float | None) -> dict:
    """The super model at the reference gamma (``fedsm.gamma``, 0.9 by default) and at the validation-chosen one,
    per site: test Dice and the selection histogram (images per model, named ``global`` and by inside site).
    ``{"super_at_gamma": {"reference" | "selected": {"gamma", "sites": {site: {"dice", "selected": {model: n}}}}}}``;
    a gamma the sites did not score (not in ``fedsm.gammas``) is left out, FedSM-extra gives ``{}``."""
    names = ["global"] + list(inside)
    out = {}
    for which, gamma in (("reference", reference), ("selected", selected)):
        key = str(float(gamma)) if gamma is not None else None
        sites = {s: r["super"][key] for s, r in infer.items() if key in r.get("super", {})}
        if sites:
            out[which] = {"gamma": float(gamma),
                          "sites": {s: {"dice": e["dice"], "selected": dict(zip(names, e["selected"]))}
                                    for s, e in sites.items()}}
    return {"super_at_gamma": out} if out else {}


def familiar_report(infer: dict, gamma: float | None) -> dict:
    """Per site that ran the fallback: how many images fell back, and its test Dice at ``gamma`` without the
    fallback (``super`` holds the fallback's): ``{"sites": {site: {"n_fallback", "n_images", "dice_nofallback"}}}``."""
    key = str(float(gamma)) if gamma is not None else "extra"
    sites = {}
    for s, r in infer.items():
        if "fallback" in r:
            raw = r.get("super_nofallback", {}).get(key, {})
            sites[s] = {"n_fallback": r["fallback"]["n_fallback"], "n_images": r["fallback"]["n_images"],
                        "dice": r["super"].get(key, {}).get("dice"), "dice_nofallback": raw.get("dice")}
    return {"sites": sites}


# ---- what the inference job's results give the tables (``pflseg.flare.columns``) ----------------------------------
def reported_route(results: Mapping) -> str:
    """The super model the tables report: at the gamma chosen on the inside sites' validation (``choose_gamma``),
    FedSM-extra's route, else at ``fedsm.gamma``."""
    if "gamma_selected" in results:
        return str(float(results["gamma_selected"]))
    first = next(iter(results["infer"].values()))
    return "extra" if "extra" in first["super"] else str(float(results["config"]["fedsm"]["gamma"]))


def read_super(results: Mapping, site: str) -> Score:
    """The reported super model's Score at ``site``."""
    infer = results["infer"][site]
    return score(infer["super"][reported_route(results)], infer)


def read_super_options(results: Mapping, site: str) -> dict[str, Score]:
    """The super model at every gamma the site scored (``fedsm.gammas``): {"gamma=g": Score}, for a gamma chosen
    elsewhere (the bench: by leave-one-inside-site-out)."""
    infer = results["infer"][site]
    return {f"gamma={g}": score(e, infer) for g, e in infer["super"].items() if g != "extra"}


def read_super_at(gamma: float):
    """A reader of the super model at one fixed ``gamma`` (one of ``fedsm.gammas``)."""
    def read(results: Mapping, site: str) -> Score:
        infer = results["infer"][site]
        if str(float(gamma)) not in infer["super"]:
            raise ValueError(f"FedSM inference at {site} scored gammas {sorted(infer['super'])}, not {gamma}: add it "
                             "to fedsm.gammas")
        return score(infer["super"][str(float(gamma))], infer)
    return read


def read_global(results: Mapping, site: str) -> Score:
    """The FedSM run's global model (the super model's fallback) at ``site``."""
    infer = results["infer"][site]
    return score(infer["global"], infer)


def infer_table(results: Mapping) -> str:
    """FedSM inference job: per site, the global, own personalized (inside sites) and super model Dice at each
    gamma (the selector's confidence threshold), the gamma chosen on the inside sites' validation named, and a
    legend."""
    routes = sorted({r for site in results["infer"].values() for r in site["super"]})
    chosen = results.get("gamma_selected")
    rows = []
    for name, site in sorted(results["infer"].items()):
        person = site["personalized"]
        rows.append([f"{name}{'' if site['inside'] else ' (outside)'}", f"{site['global']['dice']:.4f}",
                     "-" if person is None else f"{person['dice']:.4f}",
                     *(f"{site['super'][r]['dice']:.4f}" if r in site["super"] else "-" for r in routes)])

    def column(r: str) -> str:
        if r == "extra":
            return "super (extra selector)"
        mark = " (chosen)" if chosen is not None and _same(r, chosen) else ""
        return f"super, gamma={r}{mark}"

    table = markdown_table(["site", "global", "personalized", *map(column, routes)], rows)
    inside = results.get("inside_sites")
    legend = ["", "global: the final global model; personalized: the site's own model (inside sites only); super, "
              "gamma=g: FedSM's super model, which uses the personalized model the selector picks for an image when "
              "the selector's confidence is above gamma, else the global model"]
    if chosen is not None:
        legend.append(f"gamma chosen on the inside sites' validation: {chosen:g}")
    if inside:
        outside = [s for s in sorted(results["infer"]) if s not in inside]
        legend.append(f"inside sites (trained): {', '.join(inside)}"
                      + (f"; outside sites (never trained): {', '.join(outside)}" if outside else ""))
    return "\n".join([table, *legend])


def _same(key: str, value: float) -> bool:
    try:
        return float(key) == float(value)
    except ValueError:
        return False
