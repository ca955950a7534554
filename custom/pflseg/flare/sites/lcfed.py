"""LC-Fed (Wang, Jin, Wang, ECCV 2022) and FedRep, the site's side.

Every round the site merges the shared part it receives with its own heads (coarse head and HC head,
kept in its round state on disk), scores that model on its validation split, trains it with
``pflseg.algorithms.lcfed.lcfed_step`` as the loop's step, and sends back the shared part and, with HC,
its coarse head. The site's personalized model is the best by validation Dice of its models before
(received shared part + own heads) and after each round's local training, kept in ``best.pt`` with the
other sites' heads it was scored with: the freshly averaged body often does not fit the site's own heads
yet, the locally trained one does. (Scoring both also makes a resumed job choose among exactly the same
models as an uninterrupted one: the final ``validate`` task scores the "before" model of the next round.) The
site's prediction is the calibrated head's (HC on) or the coarse head's (``SitePredictor``). ``lcfed.head_first_iters``
> 0 (a count) or ``lcfed.head_first_fraction`` > 0 (of the round's local iterations, ``head_first_count``) trains the
personal heads alone for that many iterations of the round, then the body alone (FedRep / reference-code schedule).
``lcfed.hc_map`` picks what HC's head is fed: the paper's disagreement of all sites' coarse heads (the only map that
needs the other heads: the site sends its own and receives theirs), or the controls ``zeros`` (no calibration, a second
plain head) and ``self_uncertainty`` (p (1 - p) of its own coarse head), which exchange no head. NMS and Gaussian
windows scale with the image side (``lcfed.window_ref_size``, ``pflseg.algorithms.lcfed.scaled_window``).
"""

from __future__ import annotations

import math

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.lcfed import SitePredictor, exchanges_heads, lcfed_step, set_phase
from pflseg.flare.outbox import Outgoing
from pflseg.flare.sites.base import Site, Step, cpu_state, trained_metrics
from pflseg.flare.state import load_file
from pflseg.flare.wire import GLOBAL, HEAD, HEADS, by_site, prefixed, split_by_site, unprefixed
from pflseg.nets.lcfed import shared_keys
from pflseg.train import Hooks


def head_first_count(lcfed: dict, total: int) -> int:
    """Head-only iterations of a round of ``total`` local iterations: ``lcfed.head_first_iters``, or
    ``lcfed.head_first_fraction`` of ``total`` rounded (at least 1 when the fraction is > 0); 0 = joint training."""
    if lcfed["head_first_fraction"]:
        return min(total, max(1, round(lcfed["head_first_fraction"] * total)))
    return lcfed["head_first_iters"]


class HeadsPredictor(SitePredictor):
    """The site's model as it predicts (``SitePredictor``), with the other sites' coarse heads by site (``heads``:
    what ``best.pt`` keeps beside the net)."""

    def __init__(self, net: torch.nn.Module, site_index: int, heads: dict, cfg: dict):
        super().__init__(net, site_index, list(heads.values()), cfg)
        self.heads = heads


class LCFedSite(Site):
    #: PCS site contrast and head calibration (FedRep: neither)
    calibrated = True
    keeps = "its heads"

    @classmethod
    def personal_models_sent(cls, cfg: dict) -> str | None:
        if cls.calibrated and exchanges_heads(cfg["lcfed"]):
            return "LC-Fed's coarse head every round (HC's disagreement map sends it to every other site)"
        return None

    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        super().__init__(name, cfg, sites, job_id)
        self.k = sorted(sites).index(name)
        self.net.site = self.k  # PCS uses this site's embedding
        self.step_cfg = self.step_config()
        self.shared = shared_keys(self.net)

    def step_config(self) -> dict:
        """The step's settings for this job."""
        lc, on = self.cfg["lcfed"], self.calibrated
        return {"lam": lc["lam"] if on else 0.0, "hc": on and lc["hc"], "hc_map": lc["hc_map"],
                "nms_window": lc["nms_window"],
                "nms_threshold": lc["nms_threshold"], "gauss_size": lc["gauss_size"],
                "gauss_sigma": lc["gauss_sigma"] or None,
                "window_ref_size": lc["window_ref_size"], "contrast_on": lc["contrast_on"]}

    def model_for_round(self, received: dict, prev: dict) -> HeadsPredictor:
        """Own model (heads from ``prev``) with the received shared part, predicting with the other sites' heads
        received (by site)."""
        state = dict(self.net.state_dict())
        state.update(unprefixed("model", prev))
        state.update(unprefixed(GLOBAL, received))
        self.net.load_state_dict(state)
        heads = split_by_site(HEADS, received, [s for s in self.sites if s != self.name])
        return self.predictor({s: h for s, h in heads.items() if h})

    def predictor(self, heads: dict) -> HeadsPredictor:
        return HeadsPredictor(self.net, self.k, heads, self.step_cfg)

    def best_state(self, model) -> dict:
        """The site's net (``model.``) and the other sites' heads it predicted with (``heads.<site>.``)."""
        return {**prefixed("model", cpu_state(model.model)), **by_site(HEADS, model.heads)}

    def schedule(self, heads: dict, total: int) -> Hooks:
        """The loop's step: ``lcfed_step``; of a round of ``total`` iterations the first ``head_first_count`` train
        the heads alone, the rest the body alone (none: everything jointly)."""
        n_head, done = head_first_count(self.cfg["lcfed"], total), [0]
        n_sites = self.cfg["net"]["n_sites"]

        def step(model, batch, optimizer, loss_fn):
            if n_head:
                set_phase(model, "head" if done[0] < n_head else "body")
            done[0] += 1
            return lcfed_step(model, batch, optimizer, loss_fn, list(heads.values()), self.k, n_sites,
                              self.step_cfg)["loss"]

        return Hooks(step=step)

    def step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """The site's model scored and tracked, its net trained with ``lcfed_step`` (``schedule``), tracked again;
        sends the shared part (and with HC its coarse head), keeps the whole net and its optimizer state."""
        r, net, train = received.current_round, self.net, self.cfg["train"]
        model = self.model_for_round(received.params, prev)
        val = self.track(model, r)  # the received shared part with the site's heads is a candidate too
        with self.training_time():
            try:
                total = math.ceil(len(self.data("training")) / train["batch_size"]) * train["epochs"]
                stats, optim = self.fit(net, "model", prev, seed, self.schedule(model.heads, total))
            finally:
                set_phase(net, "all")
        trained = cpu_state(net)
        send = prefixed(GLOBAL, {k: trained[k] for k in self.shared})
        if exchanges_heads(self.step_cfg):  # the other sites' disagreement maps need this site's coarse head
            send.update(prefixed(HEAD, cpu_state(net.head)))
        after = self.track(model, r + 1)  # the personalized model: after local training (of round r + 1)
        metrics = trained_metrics({"val_dice": val["dice"], "val_dice_local": after["dice"]}, stats)
        return Step(send, {"optim.model": optim, **prefixed("model", trained)}, metrics, stats["samples"])

    def test(self, msg: FLModel) -> Outgoing:
        """The site's best model by validation (with the other sites' heads it was chosen with) on its test
        split; with HC also its coarse head alone (``site_coarse``). Overlays of its best and worst test cases (the
        reported model, calibrated heads included) go to ``<state>/overlays/``, as for every other method."""
        best = load_file(self.best_path)
        self.net.load_state_dict(unprefixed("model", best))
        heads = {s: head for s, head in split_by_site(HEADS, best, self.sites).items() if head}
        metrics = {"site": {**self.evaluate(self.predictor(heads), "testing", surface=True),
                            "selected_round": best["round"]}}
        self.draw_overlays(self.predictor(heads), metrics["site"])
        if self.step_cfg["hc"]:
            metrics["site_coarse"] = self.evaluate(self.net, "testing", surface=True)
        return self.reply({}, {"test": metrics})


class FedRepSite(LCFedSite):
    """FedRep: LC-Fed's workflow without PCS site contrast and head calibration (shared body, personal head)."""

    calibrated = False
