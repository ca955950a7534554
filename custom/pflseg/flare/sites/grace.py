"""GRACE, the site's side (client part; Zhang et al., MICCAI 2023): with ``grace.client`` every batch takes
the first-order meta step ``pflseg.algorithms.grace_meta.meta_step`` as the loop's step, aligning the
site's features with those of the round's global model, frozen. With ``align: adv`` the site's domain
discriminator trains in the same optimizer and stays in the site's state (it never leaves the site).

The site's personalized model is its local model after the round's training (best by validation); the
received global model is scored, not kept (also the final one, unless ``grace.final_global_candidate``).
Every round the site reports the mean size of its meta-train step, ||theta' - theta|| (``inner_step_norm``),
and of the outer step beside it (``outer_step_norm``), and the means over the round's batches of the two
terms of the meta loss L_meta = L_task + beta * L_align: ``task_loss`` (L_task(theta'; B2), the task loss on
the meta-test half) and ``align_loss`` (L_align unweighted, before beta; only when beta > 0). ``train_loss``
is L_meta itself. With ``grace.client: false`` (server-only ablation) there is no meta step and none of these.
"""

from __future__ import annotations

import functools

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.alignment import DomainDiscriminator, adversarial_alignment, coral, mmd
from pflseg.algorithms.grace_meta import feature_layer, meta_step, unet_features
from pflseg.flare.outbox import Outgoing
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.flare.state import unprefixed
from pflseg.nets import build_net
from pflseg.train import Hooks


class GraceSite(FedAvgSite):
    personalized = True

    def __init__(self, name: str, cfg: dict, sites: list[str], job_id: str | None = None):
        super().__init__(name, cfg, sites, job_id)
        self.inner: dict = {}

    def score_before(self, model, round_num: int) -> dict:
        return self.evaluate(model)

    def score_after(self, model, round_num: int) -> dict:
        return self.track(model, round_num + 1)  # the model after this round's (0-based round_num's) training

    def round_hooks(self, model, prev: dict):
        grace = self.cfg["grace"]
        if not grace["client"]:
            return None, None
        frozen = build_net(self.cfg["net"])
        frozen.load_state_dict(model.state_dict())
        frozen.to(self.device).eval().requires_grad_(False)
        disc = None
        if grace["align"] == "adv":
            disc = DomainDiscriminator(feature_layer(model).in_channels)
            if unprefixed("disc", prev):
                disc.load_state_dict(unprefixed("disc", prev))
            disc.to(self.device)
            align = functools.partial(adversarial_alignment, disc)
        else:
            align = {"coral": coral, "mmd": mmd}[grace["align"]]
        self.inner = {"inner_norm_sum": 0.0, "outer_norm_sum": 0.0, "inner_steps": 0, "task_loss_sum": 0.0}
        step = functools.partial(meta_step, inner_lr=grace["inner_lr"], beta=grace["beta"], align_fn=align,
                                 global_model=frozen, feature_fn=unet_features, split=grace["split"],
                                 inner=grace["inner_step"], record=self.inner, meta_grad=grace["meta_grad"])
        return Hooks(step=step), disc

    def round_metrics(self) -> dict:
        if not self.inner.get("inner_steps"):
            return {}
        n = self.inner["inner_steps"]
        out = {"inner_step_norm": self.inner["inner_norm_sum"] / n, "outer_step_norm": self.inner["outer_norm_sum"] / n,
               "task_loss": self.inner["task_loss_sum"] / n}
        if "align_loss_sum" in self.inner:
            out["align_loss"] = self.inner["align_loss_sum"] / n
        return out

    def validate(self, msg: FLModel) -> Outgoing:
        """The final global model, scored for the server's choice; a candidate for the site's personalized model
        only with ``grace.final_global_candidate``."""
        if self.cfg["grace"]["final_global_candidate"]:
            return super().validate(msg)
        return self.reply({}, {"val_dice": self.evaluate(self.model_for_round(msg.params, {}))["dice"]})
