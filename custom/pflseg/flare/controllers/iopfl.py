"""IOP-FL workflows (Jiang et al., IEEE TMI 2023; pflseg/algorithms/METHODS.md, section "IOP-FL").

``IOPFLController`` (job ``iopfl``): FedAvg over the full state; each site keeps its local adapted model
P_k on its own disk (``pflseg.flare.sites.iopfl``). After the final test, when ``iopfl.publish`` is true,
every site submits its best P_k and the server writes the routing bundle ``bundle.pt`` into its state
folder: {"sites", "global.*" (the best global model by validation), "person.<site>.*"}. Publishing shares
the personalized models beyond the federation; the job config says so.

``IOPFLRoutingController`` (job ``iopfl_route``): a post-training job. It reads ``<iopfl.bundle>/bundle.pt``
(``iopfl.bundle`` must lie inside the server's state root, ``PostTrainingController.bundle_folder``),
sends it to the outside sites ``iopfl.targets`` (default: every connected site not in the bundle; an
inside site is refused) and collects each site's routing and comparator Dice into ``results.json``.
"""

from __future__ import annotations

from pflseg.flare.controllers.base import PostTrainingController
from pflseg.flare.controllers.fedavg import FedAvgController
from pflseg.flare.state import load_file, prefixed, save_file, unprefixed

BUNDLE = "bundle.pt"


class IOPFLController(FedAvgController):
    task_meta = {"submit_model": {"round": "count"}}

    def after_test(self, results: dict) -> None:
        """With ``iopfl.publish``: every site submits its best P_k; the server writes the routing bundle."""
        if not self.cfg["iopfl"]["publish"] or self.abort_signal.triggered:
            return
        subs = self.send_each("submit_model", {s: self.message(self.n_rounds()) for s in self.sites},
                              reference=prefixed("site", self.global_state))
        bundle = {"sites": sorted(subs), "person_round": {s: int(res.meta["round"]) for s, res in subs.items()},
                  **prefixed("global", self.best_state or self.global_state)}
        for site, res in subs.items():
            bundle.update(prefixed(f"person.{site}", unprefixed("site", res.params)))
        path = self.store.root / BUNDLE
        save_file(path, bundle)
        results.update({"bundle": str(path), "person_round": bundle["person_round"]})
        self.info(f"routing bundle (global + P_k of {bundle['sites']}) written to {path}")


class IOPFLRoutingController(PostTrainingController):
    task_metrics = {"route": {"route": "dict"}}

    def post_training(self) -> dict:
        iopfl = self.cfg["iopfl"]
        path = self.bundle_folder("iopfl.bundle") / BUNDLE
        if not iopfl["bundle"] or not path.is_file():
            raise ValueError(f"iopfl.bundle={iopfl['bundle']!r} holds no {BUNDLE}; set it to the trained IOP-FL run's "
                             "server "
                             "state folder (e.g. runs/iopfl/state/server/iopfl), trained with iopfl.publish: true")
        bundle = load_file(path)
        inside = list(bundle["sites"])
        targets = list(iopfl["targets"]) or [s for s in self.sites if s not in inside]
        problems = [f"{t} is an inside site (trained in the federation)" for t in targets if t in inside]
        problems += [f"{t} is not connected (connected: {self.sites})" for t in targets if t not in inside
                     and t not in self.sites]
        if problems or not targets:
            raise ValueError("iopfl.targets: "
                             + ("; ".join(problems) or f"no outside site connected (inside: {inside})")
                             + ". Test-time routing runs at outside sites only: list those in iopfl.targets")
        payload = {k: v for k, v in bundle.items() if k.startswith(("global.", "person."))}
        self.info(f"routing bundle {path}: experts P_k of {inside} + global; sending to {targets}")
        res = self.send_each("route", {t: self.message(0, payload, inside_sites=inside) for t in targets})
        return {"inside_sites": inside, "targets": targets, "bundle": str(path),
                "route": {s: r.metrics["route"] for s, r in res.items()}}
