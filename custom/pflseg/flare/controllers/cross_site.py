"""Cross-site evaluation (job ``cross_site``): every final model of a training run scored at every site.

FLARE's cross-site evaluation matrix (``nvflare.app_common.workflows.cross_site_eval.CrossSiteEval``): model
owners x data sites, written as ``cross_val_results.json`` in FLARE's shape ``{data site: {model: {metric:
value}}}``, into the server's state folder and FLARE's run folder (``cross_site_val/``), with a Markdown table
(``cross_val_results.md``) beside it. A post-training job: it reads the trained run's server state folder
``cross_site.bundle`` (``final.pt``, the models its final test scored, and ``results.json``; the folder must lie
inside the server's state root, ``PostTrainingController.bundle_folder``).

The models (columns):

- ``global``: the trained run's best global model by validation (``best.*`` of ``final.pt``), when its final test
  scored one (its ``results.json`` test entries hold ``global``);
- ``<site>``: site k's personalized model, with ``cross_site.personal`` and a personalized method (its registry
  entry's site class; the registry names them when it builds the job: ``personalized_methods``). Held by the
  server (``bestperson.<site>.*`` / ``person.<site>.*`` of ``final.pt``: FedSM): sent to every site. Kept at the
  sites (FedBN, Local, IOP-FL's P_k, GRACE, FT): task ``own_model`` first; each such site scores its own best model
  on its own test split and hands it out only when its policy allows publishing (``pflseg.flare.policy``,
  ``publish``); a published model goes to every other site, an unpublished one fills the site's own cell only, and
  the notes say so. LC-Fed nets' personalized models predict with their site's PCS index and the other sites'
  heads, which a plain evaluation does not reproduce: left out, said so.

Every site (the trained sites, and sites that never trained: rows only) scores what it is sent on its test split
with the one evaluation path (``pflseg.train.evaluate``) and replies metrics only. The models are the trained
run's network: its ``net`` and ``data`` sections replace this job's (said in the log and in ``results.json``), so
the ``global`` row equals that run's own final test of the global model at every site.
"""

from __future__ import annotations

import json
from pathlib import Path

from pflseg.config import check_effective
from pflseg.flare.checks import check_update
from pflseg.flare.controllers.base import PostTrainingController
from pflseg.flare.state import RoundStore, private_dir, write_text
from pflseg.flare.wire import BEST, BEST_PERSON, GLOBAL, PERSON, SITE, model_prefix, prefixed, unprefixed
from pflseg.markdown import markdown_table
from pflseg.nets import build_net

RESULTS = "cross_val_results.json"
#: FLARE's folder of cross-site results in the run folder (``AppConstants.CROSS_VAL_DIR``)
FLARE_DIR = "cross_site_val"


def matrix_markdown(matrix: dict, models: list[str], notes: list[str] = ()) -> str:
    """Markdown of the matrix ``{data site: {model: {"dice", ...}}}``: one row per data site, one column per model
    (test Dice; "-": not scored there), then the notes."""
    rows = [[site, *(f"{cells[m]['dice']:.4f}" if m in cells else "-" for m in models)]
            for site, cells in sorted(matrix.items())]
    return "\n".join(["Cross-site evaluation: test Dice of each model (columns) at each site (rows)", "",
                      markdown_table(["site \\ model", *models], rows)]
                     + ([""] + [f"- {n}" for n in notes] if notes else []))


class CrossSiteController(PostTrainingController):
    """Every final model of the trained run at every site (see the module docstring).

    Args:
        personalized_methods: the registered methods whose sites keep their own models
            (``pflseg.flare.methods.personalized_methods``, given by the registry when it builds the job).
    """

    task_metrics = {"own_model": {"own": "dict"}, "cross_site": {"scores": "dict"}}
    task_meta = {"own_model": {"published": "count"}}

    def __init__(self, config: dict, personalized_methods: list[str], task_check_period: float = 0.2):
        super().__init__(config, task_check_period)
        self.personalized_methods = list(personalized_methods)  # the attribute FLARE's export writes back

    def post_training(self) -> dict:
        folder = self.bundle_folder("cross_site.bundle")
        if not self.cfg["cross_site"]["bundle"] or not (folder / "results.json").is_file():
            raise ValueError(f"cross_site.bundle={self.cfg['cross_site']['bundle']!r} holds no finished run "
                             "(results.json); set it to the trained run's server state folder, e.g. "
                             "runs/fedavg/state/server/fedavg")
        trained = json.loads((folder / "results.json").read_text())
        ckpt = RoundStore(folder, clean=False).final()  # another job's folder: read only
        notes = self.adopt(trained["config"])
        models, notes = self.server_models(trained, ckpt, notes)
        own, published, notes = self.site_models(trained, models, notes)
        columns = sorted(set(models) - {"global"} | set(published) | set(own))
        names = (["global"] if "global" in models else []) + columns
        self.info(f"cross-site evaluation of {trained['job']} ({source_of(folder)}): models {names} at {self.sites}")
        payloads = {}
        for site in self.sites:
            send = [m for m in names if m in models or (m in published and m != site)]  # own: scored already
            params = {k: v for m in send for k, v in prefixed(model_prefix(m), {**models, **published}[m]).items()}
            payloads[site] = self.message(0, params, models=send)
        res = self.send_each("cross_site", payloads)
        matrix = {s: {m: r.metrics["scores"][m] for m in names if m in r.metrics["scores"]} for s, r in res.items()}
        for site, cell in own.items():
            matrix.setdefault(site, {})[site] = cell
        matrix = {s: {m: row[m] for m in names if m in row} for s, row in sorted(matrix.items())}
        self.write_matrix(matrix, names, notes)
        # ``report``: what any post-training job may carry for `pflseg run` to print and write (eval names no job)
        return {"cross_site": {"trained": {"job": trained["job"], "method": trained["method"], "bundle": str(folder)},
                               "models": names, "matrix": matrix, "notes": notes},
                "report": {"markdown": matrix_markdown(matrix, names, notes), "files": {RESULTS: matrix}}}

    def adopt(self, trained_cfg: dict) -> list[str]:
        """The trained run's ``net`` and ``data`` sections replace this job's (its models are that network, scored
        on that data's slices); a note when they differed."""
        differ = [s for s in ("net", "data") if self.cfg[s] != trained_cfg[s]]
        if differ:
            self.cfg = check_effective({**self.cfg, "net": trained_cfg["net"], "data": trained_cfg["data"]},
                                       "cross_site job config with the trained run's net and data")
            self.info(f"cross_site: the trained run's {' and '.join(differ)} replace this job's")
        return [f"the trained run's {' and '.join(differ)} section(s) replaced this job's"] if differ else []

    def server_models(self, trained: dict, ckpt: dict, notes: list[str]) -> tuple[dict, list[str]]:
        """``{model name: state}`` of the models the server holds: the best global model (when the trained run's
        final test scored one) and the personalized models kept in its checkpoint."""
        models = {}
        if any("global" in t for t in trained["test"].values()):
            models["global"] = unprefixed(BEST, ckpt) or unprefixed(GLOBAL, ckpt)
        else:
            notes = notes + [f"{trained['method']} has no global model: no 'global' column"]
        if self.personal(trained):
            for site in trained["sites"]:
                state = unprefixed(f"{BEST_PERSON}.{site}", ckpt) or unprefixed(f"{PERSON}.{site}", ckpt)
                if state:
                    models[site] = state
        return models, notes

    def personal(self, trained: dict) -> bool:
        """Whether the trained run's personalized models are scored: ``cross_site.personal``, a method whose sites
        keep their own models (``personalized_methods``), and a plain network (not LC-Fed's, see the module
        docstring)."""
        return bool(self.cfg["cross_site"]["personal"] and trained["method"] in self.personalized_methods
                    and self.cfg["net"]["name"] != "lcfed")

    def site_models(self, trained: dict, models: dict, notes: list[str]) -> tuple[dict, dict, list[str]]:
        """Task ``own_model`` at the connected trained sites whose personalized model the server does not hold:
        ``({site: its own model's scores on its own test split}, {site: its published model}, notes)``."""
        if not self.personal(trained):
            if self.cfg["cross_site"]["personal"] and self.cfg["net"]["name"] == "lcfed":
                notes = notes + ["LC-Fed nets' personalized models (PCS index, the other sites' heads) are not scored"]
            return {}, {}, notes
        asked = [s for s in trained["sites"] if s in self.sites and s not in models]
        if not asked:
            return {}, {}, notes
        meta = {"trained_job": trained["job"], "bundle": self.cfg["cross_site"]["bundle"]}
        res = self.send_each("own_model", {s: self.message(0, **meta) for s in asked})
        reference = prefixed(SITE, dict(build_net(self.cfg["net"]).state_dict()))
        own, published = {}, {}
        for site, r in sorted(res.items()):
            own[site] = r.metrics["own"]
            reason = check_update(r.params or {}, reference) if r.meta["published"] else r.meta.get("why", "not sent")
            if reason:
                notes = notes + [f"{site}'s model scored at {site} only: {reason}"]
                self.info(f"cross_site: {site}'s own model is scored at {site} only ({reason})")
            else:
                published[site] = unprefixed(SITE, r.params)
        return own, published, notes

    def write_matrix(self, matrix: dict, names: list[str], notes: list[str]) -> None:
        """``cross_val_results.json`` (FLARE's shape) and ``cross_val_results.md`` into the server's state folder,
        the JSON also into FLARE's run folder (``cross_site_val/``)."""
        text = json.dumps(matrix, indent=2, sort_keys=True)
        for path in (self.store.root / RESULTS, Path(self.get_run_dir()) / FLARE_DIR / RESULTS):
            private_dir(path.parent)
            write_text(path, text)
        write_text(self.store.root / "cross_val_results.md", matrix_markdown(matrix, names, notes) + "\n")
        self.info(f"cross-site matrix written to {self.store.root / RESULTS}")


def source_of(folder: Path) -> str:
    return str(folder / "final.pt") if (folder / "final.pt").is_file() else f"{folder}, last completed round"
