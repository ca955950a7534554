"""LC-Fed (Wang, Jin, Wang, ECCV 2022) and FedRep workflows: shared body, personal heads.

Every round each site receives the shared part of the model (PCS included; the full initial model in
round 0), merges it with its own heads kept on its disk, trains and sends back the shared part; the server
takes the plain (equal-weight) average. With HC (``lcfed.hc``, method ``lcfed``) each site also sends its
coarse head, and the next round the server sends every site the coarse heads of all the others for its
disagreement map: every site's coarse head is shared with every other site (HC's own head never leaves
its site). Only the heads of the sites that answered the latest round are sent: a site left out (refused by
the guard, or silent) stays out of the others' maps until it answers again, so a head the server accepted
once from a site it then refuses does not sit in every honest site's calibration for the rest of the job.
The bytes of that head exchange are recorded per round (``head_bytes``). The HC controls
``lcfed.hc_map: zeros | self_uncertainty`` need no other site's head: no head is exchanged. FedRep runs the same
workflow without HC and site contrast. There is no global model to select: every site selects its own
model on its validation split.
"""

from __future__ import annotations

from pflseg.algorithms.lcfed import CONTRAST_ON, HC_MAPS, average_shared, exchanges_heads
from pflseg.algorithms.robust import clip_updates
from pflseg.config import ConfigError, check_choice
from pflseg.flare.controllers.base import RoundOutput
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.guard import note_clips, robust_args
from pflseg.flare.server_state import BY_SITE, ServerState
from pflseg.flare.wire import GLOBAL, HEAD, HEADS, by_site, prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.nets.lcfed import shared_keys


def nbytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


class LCFedController(FedAvgController):
    """The ``lcfed`` section's rules are here, for both methods that read it (lcfed, fedrep: a subclass)."""

    ranges = {"lcfed.nms_window": (1, 255), "lcfed.gauss_size": (1, 255), "lcfed.window_ref_size": (0, 1024),
              "lcfed.head_first_iters": (0, 1_000_000)}

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        if cfg["net"]["name"] != "lcfed":
            raise ConfigError(f"{source}: method {cfg['method']} needs net.name: lcfed (personal heads), got "
                              f"{cfg['net']['name']!r}")
        lcfed = cfg["lcfed"]
        check_choice(cfg, "lcfed.contrast_on", CONTRAST_ON, source)
        check_choice(cfg, "lcfed.hc_map", HC_MAPS, source)
        if lcfed["lam"] < 0 or lcfed["head_first_iters"] < 0 or not 0.0 <= lcfed["nms_threshold"] < 1.0:
            raise ConfigError(f"{source}: lcfed.lam and lcfed.head_first_iters must be >= 0, lcfed.nms_threshold in "
                              "[0, 1)")
        if not 0.0 <= lcfed["head_first_fraction"] <= 1.0:
            raise ConfigError(f"{source}: lcfed.head_first_fraction must lie in [0, 1], got "
                              f"{lcfed['head_first_fraction']}")
        if lcfed["head_first_iters"] and lcfed["head_first_fraction"]:
            raise ConfigError(f"{source}: set one of lcfed.head_first_iters ({lcfed['head_first_iters']}) and "
                              f"lcfed.head_first_fraction ({lcfed['head_first_fraction']}), not both: set the other to "
                              "0")
        if any(lcfed[k] < 1 or lcfed[k] % 2 == 0 for k in ("nms_window", "gauss_size")) or lcfed["gauss_sigma"] < 0:
            raise ConfigError(f"{source}: lcfed.nms_window and lcfed.gauss_size must be odd >= 1, lcfed.gauss_sigma "
                              ">= 0")

    def shares_heads(self) -> bool:
        """Whether coarse heads are exchanged: HC on with the paper's disagreement map (``lcfed.hc_map``); the
        ``zeros`` and ``self_uncertainty`` controls use each site's own head only, so no head leaves a site."""
        return exchanges_heads(self.cfg["lcfed"])

    def shared_keys(self) -> list[str]:
        return shared_keys(build_net(self.cfg["net"]))

    def declare(self, state: ServerState) -> None:
        super().declare(state)
        if self.shares_heads():
            self.info("lcfed.hc (hc_map: disagreement): every round each site's coarse head is sent to every other "
                      "site of the job")
        self.head_shape = dict(build_net(self.cfg["net"]).head.state_dict())
        state.add("heads", {}, BY_SITE, HEADS)  # site -> its latest coarse head (weight, bias)
        state.add("head_sites", None)  # the sites that answered the latest round (None: every head held is sent)

    def others_heads(self, site: str) -> dict:
        """What ``site`` is sent of the other sites' coarse heads (``heads.<other>.*``; none without the exchange):
        those of the sites that answered the latest round."""
        if not self.shares_heads():
            return {}
        fresh = self.state.head_sites
        return by_site(HEADS, {other: head for other, head in self.state.heads.items()
                               if other != site and (fresh is None or other in fresh)})

    def track_best(self, r: int, results: dict, state: dict) -> dict:
        return super().track_best(r, results, {})  # records the sites' validation Dice; no global model to keep

    def round(self, r: int) -> RoundOutput:
        keys = self.shared_keys()
        body = self.state.global_state if r == 0 else {k: self.state.global_state[k] for k in keys}
        payloads = {s: self.message(r, {**prefixed(GLOBAL, body), **self.others_heads(s)}) for s in self.sites}
        reference = prefixed(GLOBAL, {k: self.state.global_state[k] for k in keys})
        if self.shares_heads():
            reference.update(prefixed(HEAD, self.head_shape))
        results = self.send_each("train", payloads, reference=reference)
        metrics = self.track_best(r, results, self.state.global_state)
        self.state.global_state, more = self.aggregate(results, self.state.global_state, r)
        if self.shares_heads():
            self.state.heads, exchanged = self.exchange_heads(results, payloads, self.state.heads)
            self.state.head_sites = sorted(results)
            more = {**more, **exchanged}
        return RoundOutput.of(results, {**metrics, **more})

    def aggregate(self, results: dict, state: dict, r: int) -> tuple[dict, dict]:
        """The new model from the sites' shared parts and the current one ``state``: the plain (equal-weight) average
        of the shared keys (PCS included; ``average_shared``, or ``robust.aggregation``'s rule), the heads kept.
        Returns (the new model, the round's entries: none)."""
        keys = self.shared_keys()
        states = [unprefixed(GLOBAL, res.params) for res in results.values()]
        averaged = average_shared(states, keys, **robust_args(self.cfg, r))[0]
        return {**state, **{k: v for k, v in averaged.items() if k in keys}}, {}

    def exchange_heads(self, results: dict, payloads: dict, heads: dict) -> tuple[dict, dict]:
        """HC's head exchange after a round: each answering site's coarse head becomes its latest in ``heads`` (site
        -> head), its update clipped first at ``robust.clip`` x the median of the other answering sites' head updates
        (``clip_updates``; the update is taken from its head in ``heads``, or from the initial model's head, which
        every site's head starts from: one site cannot push its head, which every other site's calibration map reads,
        further per round than that many honest head updates). Returns (the new heads, the round's entry
        ``head_bytes`` {"up", "down"}: the bytes of the heads the answering sites sent and were sent)."""
        down = sum(nbytes(unprefixed(HEADS, p.params)) for s, p in payloads.items() if s in results)
        up = sum(nbytes(unprefixed(HEAD, res.params)) for res in results.values())
        sites = list(results)
        start = {} if all(s in heads for s in sites) else self.head_start(payloads)
        sent, factors, ratios = clip_updates([heads.get(s, start) for s in sites],
                                             [unprefixed(HEAD, results[s].params) for s in sites],
                                             self.cfg["robust"]["clip"])
        note_clips(self, results, "coarse head update", sites, factors, ratios)
        new = {**heads, **dict(zip(sites, sent))}
        return new, {"head_bytes": {"up": up, "down": down}}

    def head_start(self, payloads: dict) -> dict:
        """The initial model's coarse head: in round 0's payloads (the whole model), else rebuilt
        (``initial_state``)."""
        for payload in payloads.values():
            head = unprefixed(HEAD, unprefixed(GLOBAL, payload.params or {}))
            if head:
                return head
        return unprefixed(HEAD, self.initial_state())

    def final_params(self, site: str) -> dict:
        shared = {k: self.state.global_state[k] for k in self.shared_keys()}
        return {**prefixed(GLOBAL, shared), **self.others_heads(site)}


class FedRepController(LCFedController):
    """FedRep: the same workflow without HC (no head leaves a site)."""

    @classmethod
    def check_config(cls, cfg: dict, source: str = "config") -> None:
        super().check_config(cfg, source)
        if cfg["lcfed"]["head_first_iters"] < 1 and not cfg["lcfed"]["head_first_fraction"]:
            raise ConfigError(f"{source}: fedrep trains the head first: set lcfed.head_first_fraction > 0 (e.g. 0.2) "
                              "or lcfed.head_first_iters >= 1")

    def shares_heads(self) -> bool:
        return False
