"""LC-Fed (Wang, Jin, Wang, ECCV 2022) and FedRep workflows: shared body, personal heads.

Every round each site receives the shared part of the model (PCS included; the full initial model in
round 0), merges it with its own heads kept on its disk, trains and sends back the shared part; the server
takes the plain (equal-weight) average. With HC (``lcfed.hc``, method ``lcfed``) each site also sends its
coarse head, and the next round the server sends every site the coarse heads of all the others for its
disagreement map: every site's coarse head is shared with every other site (HC's own head never leaves
its site). The bytes of that head exchange are recorded per round (``head_bytes``). The HC controls
``lcfed.hc_map: zeros | self_uncertainty`` need no other site's head: no head is exchanged. FedRep runs the same
workflow without HC and site contrast. There is no global model to select: every site selects its own
model on its validation split.
"""

from __future__ import annotations

from pflseg.algorithms.lcfed import average_shared, exchanges_heads
from pflseg.config import ConfigError
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.guard import robust_args
from pflseg.flare.state import prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.nets.lcfed import shared_keys


def nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


class LCFedController(FedAvgController):
    @classmethod
    def check_config(cls, cfg: dict) -> None:
        if cfg["net"]["name"] != "lcfed":
            raise ConfigError(f"method {cfg['method']} needs net.name: lcfed (personal heads), got "
                              f"{cfg['net']['name']!r}")

    def shares_heads(self) -> bool:
        """Whether coarse heads are exchanged: HC on with the paper's disagreement map (``lcfed.hc_map``); the
        ``zeros`` and ``self_uncertainty`` controls use each site's own head only, so no head leaves a site."""
        return exchanges_heads(self.cfg["lcfed"])

    def shared_keys(self) -> list[str]:
        return shared_keys(build_net(self.cfg["net"]))

    def restore(self) -> int:
        start = super().restore()
        if self.shares_heads():
            self.info("lcfed.hc (hc_map: disagreement): every round each site's coarse head is sent to every other "
                      "site of the job")
        self.head_shape = dict(build_net(self.cfg["net"]).head.state_dict())
        self.heads: dict[str, dict] = {}  # site -> its latest coarse head (weight, bias)
        if start > 0:
            ckpt = self.store.load(start - 1)
            self.heads = {s: unprefixed(f"heads.{s}", ckpt) for s in self.sites if unprefixed(f"heads.{s}", ckpt)}
        return start

    def checkpoint(self, r: int) -> dict:
        out = super().checkpoint(r)
        for site, head in self.heads.items():
            out.update(prefixed(f"heads.{site}", head))
        return out

    def others_heads(self, site: str) -> dict:
        if not self.shares_heads():
            return {}
        out = {}
        for other, head in self.heads.items():
            if other != site:
                out.update(prefixed(f"heads.{other}", head))
        return out

    def track_best(self, r: int, results: dict, state: dict) -> None:
        super().track_best(r, results, {})  # records the sites' validation Dice; no global model to keep

    def round(self, r: int) -> dict:
        keys = self.shared_keys()
        body = self.global_state if r == 0 else {k: self.global_state[k] for k in keys}
        payloads = {s: self.message(r, {**prefixed("global", body), **self.others_heads(s)}) for s in self.sites}
        reference = prefixed("global", {k: self.global_state[k] for k in keys})
        if self.shares_heads():
            reference.update(prefixed("head", self.head_shape))
        results = self.send_each("train", payloads, reference=reference)
        self.track_best(r, results, self.global_state)
        states = [unprefixed("global", res.params) for res in results.values()]
        self.global_state.update({k: v for k,
                                  v in average_shared(states, keys, **robust_args(self.cfg))[0].items() if k in keys})
        if self.shares_heads():
            down = sum(nbytes(unprefixed("heads", p.params)) for s, p in payloads.items() if s in results)
            for site, res in results.items():
                self.heads[site] = unprefixed("head", res.params)
            up = sum(nbytes(unprefixed("head", res.params)) for res in results.values())
            self.round_metrics["head_bytes"] = {"up": up, "down": down}
        return {s: res.metrics.get("compute_seconds", 0.0) for s, res in results.items()}

    def final_params(self, site: str) -> dict:
        return {**prefixed("global", {k: self.global_state[k] for k in self.shared_keys()}), **self.others_heads(site)}


class FedRepController(LCFedController):
    """FedRep: the same workflow without HC (no head leaves a site)."""

    @classmethod
    def check_config(cls, cfg: dict) -> None:
        super().check_config(cfg)
        if cfg["lcfed"]["head_first_iters"] < 1 and not cfg["lcfed"]["head_first_fraction"]:
            raise ConfigError("fedrep trains the head first: set lcfed.head_first_fraction > 0 (e.g. 0.2) "
                              "or lcfed.head_first_iters >= 1")

    def shares_heads(self) -> bool:
        return False
