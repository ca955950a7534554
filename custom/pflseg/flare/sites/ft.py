"""FT, the site's side: FedAvg's rounds, then the ``finetune`` task: the received final global model
trained ``ft.epochs`` more epochs on the site's training split; the site's model (``best.pt``) is the best
by validation Dice of the global model (epoch 0) and every fine-tuned epoch."""

from __future__ import annotations

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.outbox import Outgoing
from pflseg.flare.sites.base import Step
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.train import derive_seed, seed_everything


class FTSite(FedAvgSite):
    personalized = True

    def tasks(self) -> dict:
        return {**super().tasks(), "finetune": self.finetune}

    def finetune(self, msg: FLModel) -> Outgoing:
        """Task ``finetune``: the round skeleton, outside the rounds' state, with ``finetune_step``."""
        return self.run_round(msg, self.finetune_step, state=False)

    def finetune_step(self, received: FLModel, prev: dict, seed: int) -> Step:
        """The received global model (epoch 0) and every fine-tuned epoch (each seeded from (seed, site, "ft",
        epoch)) scored and tracked; only metrics leave."""
        r = received.current_round
        model = self.model_for_round(received.params, {})
        self.best_path.unlink(missing_ok=True)
        scores = [self.track(model, r)["dice"]]
        with self.training_time():
            for epoch in range(self.cfg["ft"]["epochs"]):
                seed = derive_seed(self.cfg["seed"], self.name, "ft", epoch)
                seed_everything(seed)
                _, optim = self.fit(model, "ft", prev, seed, epochs=1)
                prev = {"optim.ft": optim}
                scores.append(self.track(model, r)["dice"])
        best = max(range(len(scores)), key=lambda e: (scores[e], -e))
        return Step({}, {}, {"ft_val_dice": scores, "ft_best_epoch": best}, None)
