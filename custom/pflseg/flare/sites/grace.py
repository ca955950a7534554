"""GRACE, the site's side (client part; ALGORITHMS.md section 2): with ``grace.client`` every batch takes
the first-order meta step ``pflseg.algorithms.grace_meta.meta_step`` as the loop's step, aligning the
site's features with those of the round's global model, frozen. With ``align: adv`` the site's domain
discriminator trains in the same optimizer and stays in the site's state (it never leaves the site).

The site's personalized model is its local model after the round's training (best by validation); the
received global model is scored, not kept.
"""

from __future__ import annotations

import functools

from pflseg.algorithms.alignment import DomainDiscriminator, adversarial_alignment, coral, mmd
from pflseg.algorithms.grace_meta import feature_layer, meta_step, unet_features
from pflseg.flare.sites.fedavg import FedAvgSite
from pflseg.flare.state import unprefixed
from pflseg.nets import build_net
from pflseg.train import Hooks


class GraceSite(FedAvgSite):
    personalized = True

    def score_before(self, model, round_num: int) -> dict:
        return self.evaluate(model)

    def score_after(self, model, round_num: int) -> dict:
        return self.track(model, round_num)

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
        step = functools.partial(meta_step, inner_lr=grace["inner_lr"], beta=grace["beta"], align_fn=align,
                                 global_model=frozen, feature_fn=unet_features, split=grace["split"])
        return Hooks(step=step), disc
