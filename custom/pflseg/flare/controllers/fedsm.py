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
selector and a fresh best. A site that drops out of a round keeps its personalized model unchanged (and it
still enters the others' SoftPull mix as it was); with ``lda`` its latest statistics stay in the sum. Every
round's checkpoint holds all K personalized models, the selector, the moments, the statistics and the best
selector.
"""

from __future__ import annotations

import math

import torch

from pflseg.algorithms.fedsm import (
    TEMPERATURES,
    add_statistics,
    average_moments,
    best_temperature,
    lda_gaussians,
    lda_head,
    pooled_adam_step,
)
from pflseg.algorithms.robust import check_moments
from pflseg.algorithms.softpull import check_lam, softpull
from pflseg.flare import guard
from pflseg.flare.controllers.base import PostTrainingController, RoundController, is_number
from pflseg.flare.state import RoundStore, prefixed, unprefixed
from pflseg.nets.selector import build_selector, selector_cfg


def moment_reference(selector) -> dict:
    """Expected keys and shapes of the selector's flattened Adam moments in a site's answer."""
    ref = {}
    for i, (_, p) in enumerate(selector.named_parameters()):
        ref.update({f"moment.{i}.exp_avg": p, f"moment.{i}.exp_avg_sq": p, f"moment.{i}.step": torch.zeros(())})
    return ref


def selector_reference(selector, fedsm: dict) -> dict:
    """Expected keys, shapes and dtypes of the selector part of a site's answer (see the module docstring)."""
    if fedsm["selector_fit"] == "lda":
        d, c = selector.classifier.in_features, selector.classifier.out_features
        f64 = dict(dtype=torch.float64)
        return {"stats.gram": torch.zeros(d, d, **f64), "stats.sum": torch.zeros(c, d, **f64),
                "stats.count": torch.zeros(c, **f64)}
    if fedsm["selector_steps"] == "epoch":
        return {f"grad.{name}": p for name, p in selector.named_parameters()}
    return {**prefixed("select", selector.state_dict()), **moment_reference(selector)}


class FedSMController(RoundController):
    task_metrics = {**RoundController.task_metrics, "train_selector": {"selector_loss": "number"}}
    weighted_tasks = (*RoundController.weighted_tasks, "train_selector")
    #: the server state a non-finite aggregate must not replace (``pflseg.flare.guard.keep_finite``)
    guarded_states = ("global_state", "selector", "moments", "person")

    def restore(self) -> int:
        start = super().restore()
        check_lam(self.cfg["fedsm"]["lam"], len(self.sites))
        torch.manual_seed(self.cfg["seed"])
        self.use_selector(build_selector(selector_cfg(self.cfg, len(self.sites))))
        self.person = {s: dict(self.global_state) for s in self.sites}
        self.moments: dict = {}
        self.lda_stats: dict = {}  # lda: each site's latest feature statistics
        self.best_selector = {"round": -1, "score": -1.0}
        self.best_selector_state: dict = {}
        if start > self.cfg["rounds"]:  # resuming inside the extra phase: the selector has K + 1 classes
            self.use_selector(build_selector(selector_cfg(self.cfg, len(self.sites) + 1)))
        if start > 0:
            ckpt = self.store.load(start - 1)
            self.selector = unprefixed("select", ckpt)
            self.moments = unprefixed("moment", ckpt)
            self.person = {s: unprefixed(f"person.{s}", ckpt) for s in self.sites}
            self.lda_stats = {s: unprefixed(f"ldastats.{s}", ckpt) for s in self.sites
                              if unprefixed(f"ldastats.{s}", ckpt)}
            self.best_selector = dict(ckpt.get("best_selector", self.best_selector))
            self.best_selector_state = unprefixed("bestselect", ckpt)
        self.best_person = {s: {"round": -1, "score": -1.0} for s in self.sites}
        self.best_person_state = {s: dict(self.person[s]) for s in self.sites}
        if start > 0:
            self.best_person = dict(ckpt["best_person"])
            self.best_person_state = {s: unprefixed(f"bestperson.{s}", ckpt) for s in self.sites}
        return start

    def use_selector(self, selector) -> None:
        """A fresh selector (its seeded initial weights) and what the sites' answers about it must look like."""
        self.selector = {k: v.detach().clone() for k, v in selector.state_dict().items()}
        self.moment_ref = moment_reference(selector)
        self.selector_ref = selector_reference(selector, self.cfg["fedsm"])

    def checkpoint(self, r: int) -> dict:
        flat = lambda name, states: {k: v for s in states  # noqa: E731
                                     for k, v in prefixed(f"{name}.{s}", states[s]).items()}
        return {**super().checkpoint(r), **prefixed("select", self.selector), **prefixed("moment", self.moments),
                **flat("person", self.person), **flat("bestperson", self.best_person_state),
                "best_person": self.best_person,
                **flat("ldastats", self.lda_stats), **prefixed("bestselect", self.best_selector_state),
                "best_selector": self.best_selector}

    def track_best(self, r: int, results: dict, state: dict) -> None:
        """Best global as in every method; for each site the personalized model it sent with the best validation
        Dice at that site; the best selector of those the sites received (what the inference job hands out)."""
        super().track_best(r, results, state)
        for site, res in results.items():
            score = res.metrics.get("val_dice_person")
            if score is not None and score > self.best_person[site]["score"]:
                self.best_person[site] = {"round": r, "score": score}
                self.best_person_state[site] = dict(self.person[site])
        self.track_selector(r, results, self.sent_selector)

    def track_selector(self, r: int, results: dict, sent: dict) -> None:
        """Keep ``sent`` (the selector the sites received and scored) when its validation accuracy, weighted by
        the sites' n_k, is the best so far; its temperature is the one of lowest summed validation NLL. Sites
        whose answer carries no usable accuracy (or NLL list) are left out of the mean (of the sum)."""
        acc = {s: res.metrics.get("selector_val_acc") for s, res in results.items()}
        acc = {s: float(a) for s, a in acc.items() if is_number(a) and 0.0 <= a <= 1.0}
        if not acc:
            return
        weight = {s: self.n_first.get(s, 1) for s in acc}  # first accepted n_k, capped by guard.screen
        score = guard.validation_score([(acc[s], weight[s]) for s in acc], self.cfg)
        self.round_metrics = {**getattr(self, "round_metrics", {}), "selector_val_acc_mean": score}
        if score <= self.best_selector["score"]:
            return
        nll = [res.metrics.get("selector_val_nll") for res in results.values()]
        nll = [v for v in nll if isinstance(v, list) and len(v) == len(TEMPERATURES)
               and all(is_number(x) and math.isfinite(x) for x in v)]
        temperature = best_temperature([sum(col) for col in zip(*nll)]) if nll else 1.0
        fedsm = self.cfg["fedsm"]
        self.best_selector = {"round": r, "score": score, "temperature": temperature, "input": fedsm["selector_input"],
                              "head": "linear" if fedsm["selector_fit"] == "lda" else "mlp"}
        self.best_selector_state = dict(sent)

    def n_rounds(self) -> int:
        return self.cfg["rounds"] + self.cfg["fedsm"]["extra_rounds"]

    def check_result(self, task: str, site: str, res, reference: dict | None) -> str | None:
        """The base checks; for lda statistics also that they are statistics of the site's n_k images: whole,
        non-negative class counts summing to n_k, a symmetric Gram matrix with a non-negative diagonal; for the
        selector's Adam moments (softmax, batch) ``check_moments``: exp_avg_sq >= 0, each step at least the one
        sent + 1 and at most it + n_k x ``fedsm.selector_epochs`` (one image per step at least)."""
        reason = super().check_result(task, site, res, reference)
        if reason or task not in self.weighted_tasks:
            return reason
        fedsm = self.cfg["fedsm"]
        if fedsm["selector_fit"] == "softmax" and fedsm["selector_steps"] == "batch":
            n_k = res.meta["NUM_STEPS_CURRENT_ROUND"]
            reason = check_moments(unprefixed("moment", res.params), self.moments, n_k * fedsm["selector_epochs"])
            return f"selector moments: {reason}" if reason else None
        if fedsm["selector_fit"] != "lda":
            return None
        stats = unprefixed("stats", res.params)
        count, gram, n_k = stats["count"], stats["gram"], res.meta["NUM_STEPS_CURRENT_ROUND"]
        if (count < 0).any() or not torch.equal(count, count.round()) or int(count.sum()) != n_k:
            return (f"selector statistics: class counts {count.tolist()} are not whole, non-negative and summing to "
                    f"n_k = {n_k}")
        if not torch.allclose(gram, gram.T) or (gram.diagonal() < 0).any():
            return "selector statistics: the Gram matrix is not symmetric with a non-negative diagonal"
        return None

    def selector_payload(self) -> dict:
        """The selector as the sites receive it (with the averaged moments in batch mode)."""
        batch = self.cfg["fedsm"]["selector_fit"] == "softmax" and self.cfg["fedsm"]["selector_steps"] == "batch"
        return {**prefixed("select", self.selector), **(prefixed("moment", self.moments) if batch else {})}

    def fit_selector(self, results: dict) -> None:
        """The new selector from the sites' answers (see the module docstring)."""
        fedsm = self.cfg["fedsm"]
        if fedsm["selector_fit"] == "lda":
            self.lda_stats.update({s: unprefixed("stats", res.params) for s, res in results.items()})
            weight, bias = lda_head(add_statistics(list(self.lda_stats.values())), fedsm["lda_shrinkage"])
            self.selector = {**self.selector, "classifier.weight": weight, "classifier.bias": bias}
        elif fedsm["selector_steps"] == "epoch":
            grads = [unprefixed("grad", res.params) for res in results.values()]
            if self.cfg["robust"]["aggregation"] != "mean":  # the sum = K x the robust combination (unweighted)
                combined = guard.aggregate(self.cfg, grads, [1.0] * len(grads))
                grads = [{k: v * len(results) for k, v in combined.items()}]
            self.selector, self.moments = pooled_adam_step(self.selector, grads, self.moments, fedsm["selector_lr"])
        else:
            weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
            self.selector = guard.aggregate(self.cfg, [unprefixed("select", res.params) for res in results.values()],
                                            weights)
            self.moments = average_moments([unprefixed("moment", res.params) for res in results.values()], weights,
                                           **guard.robust_args(self.cfg))

    def round(self, r: int) -> dict:
        if r >= self.cfg["rounds"]:
            return self.extra_round(r)
        self.sent_selector = dict(self.selector)
        common = {**prefixed("global", self.global_state), **self.selector_payload()}
        payloads = {s: self.message(r, {**common, **prefixed("person", self.person[s])}, selector_label=k)
                    for k, s in enumerate(self.sites)}
        reference = {**prefixed("global", self.global_state), **prefixed("person", self.global_state),
                     **self.selector_ref}
        results = self.send_each("train", payloads, reference=reference)
        self.track_best(r, results, self.global_state)
        weights = [res.meta["NUM_STEPS_CURRENT_ROUND"] for res in results.values()]
        self.global_state = guard.aggregate(self.cfg, [unprefixed("global", res.params) for res in results.values()],
                                            weights)
        self.fit_selector(results)
        trained = {s: unprefixed("person", res.params) for s, res in results.items()}
        mixed = softpull([trained.get(s, self.person[s]) for s in self.sites], self.cfg["fedsm"]["lam"])
        self.person = {s: (mixed[k] if s in trained else self.person[s]) for k, s in enumerate(self.sites)}
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def extra_round(self, r: int) -> dict:
        """FedSM-extra: only the (K+1)-class selector trains; every site gets all personalized models."""
        # a fresh selector over {global, personalized 1..K}: fresh moments, statistics, best
        if r == self.cfg["rounds"]:
            torch.manual_seed(self.cfg["seed"] + 1)
            self.use_selector(build_selector(selector_cfg(self.cfg, len(self.sites) + 1)))
            self.moments, self.lda_stats = {}, {}
            self.best_selector, self.best_selector_state = {"round": -1, "score": -1.0}, {}
        self.sent_selector = dict(self.selector)
        person = {k: v for s in self.sites for k, v in prefixed(f"person.{s}", self.person[s]).items()}
        payload = {**prefixed("global", self.global_state), **person, **self.selector_payload()}
        results = self.send_each("train_selector", {s: self.message(r, payload) for s in self.sites},
                                 reference=self.selector_ref)
        self.round_metrics = {"selector_loss": {s: res.metrics["selector_loss"] for s, res in results.items()}}
        self.track_selector(r, results, self.sent_selector)
        self.fit_selector(results)
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def final_params(self, site: str) -> dict:
        """The final validate (and test) task: global and own personalized model; without FedSM-extra also the
        final selector, so the sites score it as a candidate for the best selector (``track_best``)."""
        if self.cfg["fedsm"]["extra_rounds"]:  # the (K+1)-class selector's labels need every site's models
            self.sent_selector = {}
            return {**prefixed("global", self.global_state), **prefixed("person", self.person[site])}
        self.sent_selector = dict(self.selector)
        return {**prefixed("global", self.global_state), **prefixed("person", self.person[site]),
                **prefixed("select", self.selector)}

    def extra_results(self) -> dict:
        """The selector that inference uses: its round (``rounds`` = the final selector after the last round),
        n_k-weighted validation accuracy, temperature, input rule and head."""
        return {"best_selector_round": self.best_selector["round"], "best_selector": self.best_selector}


class FedSMInferenceController(PostTrainingController):
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
        inside = sorted({k.split(".")[1] for k in ckpt if k.startswith("person.")})
        chosen = "bestperson" if any(k.startswith("bestperson.") for k in ckpt) else "person"
        person = {"person." + k[len(chosen) + 1:]: v for k, v in ckpt.items() if k.startswith(chosen + ".")}
        best = unprefixed("best", ckpt) or unprefixed("global", ckpt)
        selector = unprefixed("bestselect", ckpt) or unprefixed("select", ckpt)
        info = dict(ckpt.get("best_selector") or {}) if unprefixed("bestselect", ckpt) else {}
        meta = {"selector_temperature": float(info.get("temperature", 1.0)),
                "selector_input": info.get("input", "zscore")}
        familiar, why_not = self.familiarity(ckpt, inside, selector)
        payload = {**prefixed("global", best), **person, **prefixed("select", selector)}
        self.info(f"super model from {source}: inside sites {inside}; selector of round {info.get('round', 'last')} "
                  f"(T = {meta['selector_temperature']:.3g}, input {meta['selector_input']}); sending to {self.sites}")
        send = lambda sites, params, **more: self.send_each(  # noqa: E731
            "infer", {s: self.message(0, params, inside_sites=inside, **meta, **more) for s in sites}) if sites else {}
        if not familiar:  # one phase, every site at once
            self.info(f"familiarity fallback: none ({why_not})")
            res, report = send(self.sites, payload), {"enabled": False, "reason": why_not}
        else:  # the inside sites first: their validation distances set tau for the sites outside the bundle
            res = send([s for s in self.sites if s in inside], {**payload, **prefixed("familiar", familiar)})
            tau, report = self.familiar_threshold({s: r.metrics["infer"] for s, r in res.items()})
            outside = [s for s in self.sites if s not in inside]
            if tau is None:
                res = {**res, **send(outside, payload)}
            else:
                res = {**res, **send(outside, {**payload, **prefixed("familiar", familiar)}, familiar_tau=tau)}
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
        stats = [st for st in (unprefixed(f"ldastats.{s}", ckpt) for s in inside) if st]
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
