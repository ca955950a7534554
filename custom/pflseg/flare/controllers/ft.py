"""FT baseline: FedAvg rounds, then every site fine-tunes the final global model on its own data.

The global model chosen by validation (as for FedAvg) goes to each site with a ``finetune`` task; the
site trains it ``ft.epochs`` more epochs and keeps, as its own model, the best by validation Dice of the
global model and every fine-tuned epoch. The final test reports both: ``global`` (FedAvg) and ``site`` (FT).
"""

from __future__ import annotations

from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.wire import GLOBAL, prefixed


class FTController(FedAvgController):
    task_metrics = {**FedAvgController.task_metrics, "finetune": {"ft_best_epoch": "count", "ft_val_dice": "list"}}
    ranges = {"ft.epochs": (0, 1000)}

    def personalize(self, last: int, best: dict) -> dict:
        """Every site fine-tunes ``best`` (the final global model without one). Returns results.json's ``ft``:
        {site: {"best_epoch", "val_dice": per epoch}}."""
        model = best or prefixed(GLOBAL, self.state.global_state)
        done = self.send_each("finetune", {s: self.message(last, model) for s in self.sites})
        ft = {s: {"best_epoch": res.metrics["ft_best_epoch"], "val_dice": res.metrics["ft_val_dice"]}
              for s, res in done.items()}
        self.info(f"fine-tuned: best epoch per site {({s: v['best_epoch'] for s, v in ft.items()})}")
        return {"ft": ft}
