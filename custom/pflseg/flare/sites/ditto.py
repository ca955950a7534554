"""Ditto, the site's side (Li, Hu, Beirami and Smith, ICML 2021).

A Ditto site trains two models every round, for the same local budget each (``train.epochs``, batch size, learning
rate: the one loop, ``fit``):

- the global model w, as in FedAvg: the received w_t is trained on the task loss alone and sent back;
- its own model v_k, which never leaves the site (its state folder, ``person.*``): it continues from the site's
  latest completed round (in the site's first round it starts as the received w_t) and is trained on

      task loss(v_k) + lam / 2 * || v_k - w_t ||^2,        lam = ``ditto.lam``

  where w_t is the global model as it arrived this round, before the site trained its copy of it (the anchor is
  taken first). The penalty is FedProx's proximal term (``pflseg.algorithms.fedprox.proximal_term``) on another
  model: lam = 0 leaves v_k to train on the site's data alone; a large lam holds it near each round's w_t.

Each round the site reports ``val_dice`` (w_t as received: the server's choice of its best global model) and
``val_dice_person`` (v_k after the round; the best v_k by validation Dice is the site's ``best.pt``). At the end
``test`` scores the server's selected global model under "global" and the best v_k under "site".
"""

from __future__ import annotations

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.fedprox import proximal_term
from pflseg.flare.sites.base import Site, Step, cpu_state, trained_metrics
from pflseg.flare.wire import PERSON, prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.train import Hooks, derive_seed, seed_everything


class DittoSite(Site):
    keeps = "its personalized model v_k"

    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        super().__init__(name, cfg, sites, job_id)
        self.person = build_net(cfg["net"])  # v_k (self.net holds the global model)

    def step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """w_t scored, trained and sent; v_k (from ``prev``, else w_t) trained towards w_t, scored and tracked; v_k
        and both optimizer states kept."""
        r = received.current_round
        model = self.model_for_round(received.params, prev)  # w_t
        anchor = {k: v.detach().to(self.device).clone() for k, v in model.named_parameters()}
        self.person.load_state_dict(unprefixed(PERSON, prev) or model.state_dict())
        val_global = self.evaluate(model)
        lam = self.cfg["ditto"]["lam"]
        hooks = Hooks(extra_loss=lambda m, batch, logits: proximal_term(m, anchor, lam))
        person_seed = derive_seed(self.cfg["seed"], self.name, r, PERSON)  # v_k's data order and randomness
        with self.training_time():
            stats, optim = self.fit(model, "model", prev, seed)
            seed_everything(person_seed)
            person_stats, person_optim = self.fit(self.person, PERSON, prev, person_seed, hooks)
        val_person = self.track(self.person, r + 1)  # best.pt: the best v_k (v_k after round r + 1)
        metrics = trained_metrics({"val_dice": val_global["dice"], "val_dice_person": val_person["dice"]}, stats,
                                  {"person_loss": person_stats["loss"]})
        keep = {"optim.model": optim, f"optim.{PERSON}": person_optim, **prefixed(PERSON, cpu_state(self.person))}
        return Step(self.upload(cpu_state(model)), keep, metrics, stats["samples"])

    def validate(self, msg: FLModel):
        """The final global model, scored for the server's choice only: the site's own model is v_k, tracked every
        round."""
        return self.reply({}, {"val_dice": self.evaluate(self.model_for_round(msg.params, {}))["dice"]})
