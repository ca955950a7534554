"""Cross-site evaluation, the site's side (job ``cross_site``; its server side: ``flare.controllers.cross_site``).

Task ``own_model``: the site scores its own best model of the trained run (``best.pt`` in its state folder of that
job) on its test split and hands the model out only when the job asks for it and the site's policy allows
publishing (``policy.publish``); otherwise it replies the scores alone and says why (``meta["why"]``). Its state
folder of the trained job is ``state_dir(site, job)`` (a deployment's persistent state root); in the simulator, where
each run has its own state root, the trained run's folder beside the server's bundle (``<bundle>/../../<site>/<job>``)
is used only when it lies inside a folder of the site's own ``$PFLSEG_BUNDLE_ROOTS``.

Task ``cross_site``: the site scores every model it is sent (``meta["models"]``: ``global`` and ``person.<site>``)
on its test split with the one evaluation path and replies the metrics only (no per-case entries).
"""

from __future__ import annotations

import os
from pathlib import Path

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.outbox import Outgoing
from pflseg.flare.settings import site_settings
from pflseg.flare.sites.base import Site
from pflseg.flare.state import inside, load_file, state_dir
from pflseg.flare.wire import SITE, model_prefix, prefixed, unprefixed
from pflseg.nets import build_net


class CrossSiteSite(Site):
    personalized = False
    exchanges_models = False

    def tasks(self) -> dict:
        return {"own_model": self.own_model, "cross_site": self.score}

    def scores(self, state: dict) -> dict:
        """Test metrics of the network ``state`` (the trained run's net) at this site, per case left out."""
        net = build_net(self.cfg["net"])
        net.load_state_dict({**net.state_dict(), **state})
        out = self.evaluate(net, "testing", surface=True)
        out.pop("per_case", None)
        return out

    def trained_folder(self, job: str, bundle: str) -> Path:
        """This site's state folder of the trained job ``job`` (see the module docstring)."""
        own = state_dir(self.name, job, self.settings["state_dir"])
        if (own / "best.pt").is_file() or not bundle:
            return own
        beside = Path(bundle).parent.parent / self.name / job
        roots = [Path(p) for p in os.environ.get("PFLSEG_BUNDLE_ROOTS", "").split(os.pathsep) if p]
        return beside if any(inside(beside, root) for root in roots) else own

    def own_model(self, msg: FLModel) -> Outgoing:
        job = str(msg.meta["trained_job"])
        path = self.trained_folder(job, str(msg.meta.get("bundle") or "")) / "best.pt"
        if not path.is_file():
            raise FileNotFoundError(f"site {self.name}: no own model of job {job} ({path.name} in its state folder of "
                                    f"that job); run cross_site where the trained run's site state is kept")
        model = unprefixed("model", load_file(path))
        scores = self.scores(model)
        if not self.cfg["cross_site"]["personal"]:
            why = "the job does not ask for it (cross_site.personal: false)"
        elif not site_settings(self.name)["policy"]["publish"]:  # read now: the site may tighten it mid-job
            why = "the site's policy keeps it at the site (policy.publish: false)"
        else:
            return self.reply(prefixed(SITE, model), {"own": scores}, published=1)
        return self.reply({}, {"own": scores}, published=0, why=why)

    def score(self, msg: FLModel) -> Outgoing:
        names = list(msg.meta["models"])
        out = {m: self.scores(unprefixed(model_prefix(m), msg.params)) for m in names}
        return self.reply({}, {"scores": out})
