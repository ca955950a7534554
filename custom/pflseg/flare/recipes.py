"""pflseg's jobs as FLARE 2.9 recipes, the way FLARE packages FedAvg and FedCE::

    from nvflare.recipe import SimEnv
    from pflseg.flare.recipes import IOPFLRecipe, IOPFLRouteRecipe

    env = SimEnv(num_clients=3, workspace_root="runs/recipes")
    train = IOPFLRecipe(rounds=20, overrides={"train": {"lr": 5e-4}})
    train.execute(env)                                   # or PocEnv(...) / ProdEnv(startup_kit_location=...)
    IOPFLRouteRecipe(bundle=train.server_state(env)).execute(SimEnv(num_clients=4, workspace_root="runs/recipes"))

A recipe holds exactly the job ``pflseg jobs export`` writes: ``pflseg.flare.jobs.build_job`` of
``pflseg.config.load_job_config(job, overrides)`` in package mode (the sites run their installed pflseg; the job
carries configuration only). ``recipe.export(dir)`` writes the same folder as ``pflseg jobs export JOB --out dir``.

There is one class per method of the registry (``pflseg.flare.methods.METHODS``), generated here and named after
the method's table label (``RECIPES``): ``FedAvgRecipe``, ``FedProxRecipe``, ``FedBNRecipe``, ``LocalRecipe``,
``CentralizedRecipe``, ``FTRecipe``, ``FedRepRecipe``, ``FedSMRecipe``, ``GRACERecipe``, ``IOPFLRecipe``,
``LCFedRecipe``, and the post-training ones after their training method, ``FedSMInferRecipe``,
``IOPFLRouteRecipe``, ``CrossSiteRecipe``. ``PflsegRecipe(job, ...)`` takes any job config (``grace_server``,
``lcfed_nohc``, ...).

**Post-training recipes** (a method with ``Method.after``: ``fedsm_infer``, ``iopfl_route``, ``cross_site``) run
after a training recipe and read its models: ``bundle=`` is required, the trained job's server state folder, a path
on the server. On SimEnv that is ``train.server_state(env)`` (both recipes on a SimEnv with the same
``workspace_root``: they share one state root, and the server reads bundles only from inside it). On a running
federation (ProdEnv) it is the server's ``<state root>/server/<job>``: the server kit's ``pflseg_state/<job>`` by
default (its ``PFLSEG_STATE_DIR/server/<job>`` when set). PocEnv starts a fresh federation for every recipe: run
post-training recipes on SimEnv or a ProdEnv federation.

**Where state lives on SimEnv**: ``env.extra["state_dir"]`` when given, else ``$PFLSEG_STATE_DIR``, else
``<workspace_root>/pflseg_state`` (``<state>/server/<job>``: checkpoints, ``results.json``; ``<state>/<site>/<job>``:
each site's state). FLARE's own workspace of the run is ``<workspace_root>/<job>``. **PocEnv**: FLARE's PocEnv
provisions a new POC with FLARE's default project, whose sites allow none of pflseg's classes; give it a project
with pflseg's builder, ``pflseg.deploy.poc_env.pflseg_poc_env`` (what ``python job.py JOB --env poc`` runs).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Mapping
from pathlib import Path

from nvflare.recipe.poc_env import PocEnv
from nvflare.recipe.sim_env import SimEnv
from nvflare.recipe.spec import ExecEnv, Recipe

from pflseg.config import ConfigError, load_job_config
from pflseg.flare.allowlist import add_to_resources
from pflseg.flare.jobs import build_job, in_script_dir
from pflseg.flare.methods import METHODS

#: SimEnv's extra property naming pflseg's state root (``SimEnv(..., extra={STATE_DIR: "..."})``)
STATE_DIR = "state_dir"


class PflsegRecipe(Recipe):
    """A pflseg job (``app_configs/<job>.yaml``) as a FLARE recipe: ``recipe.execute(SimEnv | PocEnv | ProdEnv)``.

    Args:
        job: the job config's name (``app_configs/<job>.yaml``); a named recipe class (``FedAvgRecipe``) has its
            method's own by default and takes another config of the same method (``GRACERecipe("grace_server")``).
        rounds: ``rounds`` of the config (None: the config's).
        min_clients: ``min_clients`` of the config (None: the config's): the sites a round needs.
        overrides: nested config overrides, validated like ``--set`` (``{"train": {"lr": 5e-4}}``).
        bundle: post-training jobs only, and required there: the trained job's server state folder (a path on the
            server; see the module docstring); it sets the method's ``<section>.bundle``.
        name: the FLARE job name and pflseg's state folder name (default: the job config's name), as ``pflseg jobs
            export --job-name``.

    Raises:
        ConfigError: an unknown job or config key, a bad value, a tracker that is not installed, a post-training job
            without a bundle, a bundle for a training job, or a named class given another method's job.
    """

    #: the method of a named recipe class (``FedAvgRecipe``: fedavg); None for PflsegRecipe itself
    method: str | None = None

    def __init__(self, job: str | None = None, *, rounds: int | None = None, min_clients: int | None = None,
                 overrides: Mapping | None = None, bundle: str | os.PathLike | None = None, name: str | None = None):
        kind = type(self).__name__
        job = job or self.method
        if job is None:
            raise ConfigError(f"{kind}: name the job config, e.g. {kind}('fedavg') (app_configs/<job>.yaml)")
        over = copy.deepcopy(dict(overrides or {}))
        if rounds is not None:
            over["rounds"] = rounds
        if min_clients is not None:
            over["min_clients"] = min_clients
        cfg = load_job_config(job, overrides=over)
        if self.method is not None and cfg["method"] != self.method:
            raise ConfigError(f"{kind}: job {job} is method {cfg['method']}, not {self.method}; use "
                              f"{RECIPES[cfg['method']].__name__}({job!r}) or PflsegRecipe({job!r})")
        after = METHODS[cfg["method"]].after
        if after is not None:
            trained, section, _ = after
            if bundle is not None:
                over[section] = {**over.get(section, {}), "bundle": str(bundle)}
                cfg = load_job_config(job, overrides=over)
            if not cfg[section]["bundle"]:
                raise ConfigError(f"{kind}: {job} is a post-training job; give bundle=<the server state folder of a "
                                  f"finished training run> (e.g. of {trained}: on SimEnv "
                                  f"{RECIPES[trained].__name__}(...).server_state(env), run first)")
        elif bundle is not None:
            post = ", ".join(m for m, e in METHODS.items() if e.after)
            raise ConfigError(f"{kind}: {job} is a training job; bundle= is for post-training jobs ({post})")
        if name:
            cfg["name"] = name
        self.job_config, self.overrides, self.bundle, self.config = job, over, bundle, cfg
        super().__init__(build_job(cfg))

    # ---- FLARE's Recipe -------------------------------------------------------------------------------
    def process_env(self, env: ExecEnv) -> None:
        """SimEnv: pflseg's classes on the simulated sites' allow list. PocEnv: refused when it would provision FLARE's
        default project (no pflseg classes allowed at its sites)."""
        if isinstance(env, SimEnv):  # SimEnv's workspace of this job (it adds FLARE's default list only when absent)
            add_to_resources(Path(env.workspace_root) / self.name / "local" / "resources.json")
        elif isinstance(env, PocEnv) and not env.project_conf_path:
            raise ConfigError("PocEnv without project_conf_path provisions FLARE's default POC, whose sites allow none "
                              "of pflseg's classes: use pflseg.deploy.poc_env.pflseg_poc_env(...) (a PocEnv with "
                              "pflseg's provisioning) or PocEnv(project_conf_path=<a project.yml with "
                              "pflseg.deploy.provision.PflsegBuilder>)")

    def run(self, env: ExecEnv, server_exec_params: dict | None = None, client_exec_params: dict | None = None):
        """FLARE's ``Recipe.run``; on SimEnv with pflseg's state root (``sim_state_root``) set for the run."""
        with self._sim_run(env), in_script_dir():
            return super().run(env, server_exec_params=server_exec_params, client_exec_params=client_exec_params)

    def export(self, job_dir: str, server_exec_params: dict | None = None, client_exec_params: dict | None = None,
               env: ExecEnv | None = None) -> None:
        """FLARE's ``Recipe.export``: ``<job_dir>/<name>/``, the folder ``pflseg jobs export`` writes."""
        job_dir = str(Path(job_dir).resolve())
        with in_script_dir():
            super().export(job_dir, server_exec_params=server_exec_params, client_exec_params=client_exec_params,
                           env=env)

    # ---- pflseg ---------------------------------------------------------------------------------------
    def server_state(self, env: SimEnv) -> Path:
        """This job's server state folder on SimEnv ``env``: ``results.json``, checkpoints, the bundle a
        post-training recipe reads."""
        return sim_state_root(env) / "server" / self.name

    def results(self, env: SimEnv) -> Path:
        """This job's ``results.json`` on SimEnv ``env`` (written when the job has finished)."""
        return self.server_state(env) / "results.json"

    @contextlib.contextmanager
    def _sim_run(self, env: ExecEnv):
        if not isinstance(env, SimEnv):
            yield
            return
        env.workspace_root = str(Path(env.workspace_root).resolve())  # before in_script_dir changes the directory
        state = sim_state_root(env)
        # the simulated sites share this machine's cores; FLARE's workers inherit this process's environment
        threads = str(max(1, (os.cpu_count() or 1) // max(1, env.num_clients)))
        with _environ(PFLSEG_STATE_DIR=str(state), PFLSEG_THREADS=os.environ.get("PFLSEG_THREADS") or threads):
            yield


def sim_state_root(env: SimEnv) -> Path:
    """pflseg's state root of a SimEnv run: ``env.extra["state_dir"]``, else ``$PFLSEG_STATE_DIR``, else
    ``<workspace_root>/pflseg_state``."""
    root = env.get_extra_prop(STATE_DIR) or os.environ.get("PFLSEG_STATE_DIR") or Path(env.workspace_root) / \
        "pflseg_state"
    return Path(root).resolve()


@contextlib.contextmanager
def _environ(**values: str):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def recipe_class_name(method: str) -> str:
    """The recipe class of registry entry ``method``: its table label without punctuation (``IOP-FL`` ->
    ``IOPFLRecipe``); a post-training method without a label: its training method's label and the rest of its name
    (``iopfl_route`` -> ``IOPFLRouteRecipe``), else its name in CamelCase (``cross_site`` -> ``CrossSiteRecipe``)."""
    entry = METHODS[method]
    if entry.label:
        return re.sub(r"[^A-Za-z0-9]", "", entry.label) + "Recipe"
    parts = method.split("_")
    if entry.after and parts[0] == entry.after[0] and METHODS[entry.after[0]].label:
        return recipe_class_name(entry.after[0])[:-len("Recipe")] + "".join(p.title() for p in parts[1:]) + "Recipe"
    return "".join(p.title() for p in parts) + "Recipe"


def _recipe_class(method: str) -> type[PflsegRecipe]:
    entry = METHODS[method]
    what = (f"post-training job after {entry.after[0]}: bundle= required" if entry.after
            else f"{entry.label or method}")
    doc = (f"pflseg's ``{method}`` job (app_configs/{method}.yaml) as a FLARE recipe ({what}); arguments: "
           "``PflsegRecipe``.")
    return type(recipe_class_name(method), (PflsegRecipe,), {"method": method, "__doc__": doc, "__module__": __name__})


#: method -> its recipe class, in the registry's order
RECIPES: dict[str, type[PflsegRecipe]] = {m: _recipe_class(m) for m in METHODS}
globals().update({cls.__name__: cls for cls in RECIPES.values()})
__all__ = ["PflsegRecipe", "RECIPES", "STATE_DIR", "recipe_class_name", "sim_state_root",
           *(cls.__name__ for cls in RECIPES.values())]
