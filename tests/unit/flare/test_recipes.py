"""pflseg's jobs as FLARE recipes: every method's recipe class exports exactly what `pflseg jobs export` writes, a
post-training recipe needs its bundle, and the environments get what a pflseg job needs (SimEnv: the allow list and
the state root; PocEnv: pflseg's provisioning)."""

import filecmp
import json
from pathlib import Path

import pytest
from nvflare.recipe import PocEnv, SimEnv

from pflseg.config import ConfigError
from pflseg.flare import recipes
from pflseg.flare.jobs import export_job
from pflseg.flare.methods import METHODS
from pflseg.flare.recipes import RECIPES, STATE_DIR, PflsegRecipe, recipe_class_name, sim_state_root


def _same(a: Path, b: Path) -> list[str]:
    """Paths that differ between folders a and b (files by content, recursively); [] when identical."""
    cmp = filecmp.dircmp(a, b)
    out = [f"{a}: only in one {cmp.left_only + cmp.right_only}"] if cmp.left_only or cmp.right_only else []
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return out + [str(a / f) for f in mismatch + errors] + [d for s in cmp.common_dirs for d in _same(a / s, b / s)]


def _bundle(method: str, tmp_path: Path) -> dict:
    """The bundle override a post-training method needs ({} for a training one)."""
    after = METHODS[method].after
    return {after[1]: {"bundle": str(tmp_path / "state" / "server" / after[0])}} if after else {}


@pytest.mark.parametrize("method", list(METHODS))
def test_each_methods_recipe_exports_what_pflseg_jobs_export_writes(method, tmp_path):
    over = {"rounds": 3, "train": {"lr": 0.002}}
    bundle = _bundle(method, tmp_path)
    expected = export_job(method, tmp_path / "cli", overrides={**over, **bundle})
    kwargs = {"bundle": next(iter(bundle.values()))["bundle"]} if bundle else {}
    RECIPES[method](rounds=3, overrides={"train": {"lr": 0.002}}, **kwargs).export(str(tmp_path / "recipe"))
    got = tmp_path / "recipe" / method
    assert got.is_dir() and _same(expected, got) == []
    server = json.loads((got / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["config"]["rounds"] == 3


def test_any_job_config_and_a_job_name_as_pflseg_jobs_export(tmp_path):
    expected = export_job("grace_server", tmp_path / "cli", job_name="gs1")
    PflsegRecipe("grace_server", name="gs1").export(str(tmp_path / "recipe"))
    assert _same(expected, tmp_path / "recipe" / "gs1") == []
    # a named class takes another config of its own method
    assert recipes.GRACERecipe("grace_server").config == PflsegRecipe("grace_server").config


def test_one_named_class_per_registry_method_importable_by_name():
    names = [recipe_class_name(m) for m in METHODS]
    assert len(set(names)) == len(METHODS) and list(RECIPES) == list(METHODS)
    for method, cls in RECIPES.items():
        assert getattr(recipes, cls.__name__) is cls and cls.method == method and issubclass(cls, PflsegRecipe)
    assert {"FedAvgRecipe", "FedSMRecipe", "GRACERecipe", "IOPFLRecipe", "LCFedRecipe", "IOPFLRouteRecipe",
            "FedSMInferRecipe", "CrossSiteRecipe"} <= set(names)
    from pflseg.flare.recipes import IOPFLRecipe  # noqa: F401  (the documented import works)


def test_post_training_recipes_need_the_trained_runs_bundle(tmp_path):
    post = [m for m, e in METHODS.items() if e.after]
    assert sorted(post) == ["cross_site", "fedsm_infer", "iopfl_route"]
    for method in post:
        with pytest.raises(ConfigError, match="post-training job; give bundle="):
            RECIPES[method]()
    trained = recipes.IOPFLRecipe()
    env = SimEnv(num_clients=2, workspace_root=str(tmp_path))
    route = recipes.IOPFLRouteRecipe(bundle=trained.server_state(env))
    assert route.config["iopfl"]["bundle"] == str(tmp_path.resolve() / "pflseg_state" / "server" / "iopfl")
    # the bundle may also come through the overrides, as with --set
    assert recipes.CrossSiteRecipe(overrides={"cross_site": {"bundle": "/srv/x"}}).config["cross_site"]["bundle"] == \
        "/srv/x"


@pytest.mark.parametrize("call, message", [
    (lambda: recipes.FedAvgRecipe(bundle="/srv/x"), "training job; bundle= is for post-training jobs"),
    (lambda: recipes.FedAvgRecipe("grace"), "job grace is method grace, not fedavg; use GRACERecipe"),
    (lambda: PflsegRecipe(), "name the job config"),
    (lambda: PflsegRecipe("nope"), "no job config"),
    (lambda: recipes.FedAvgRecipe(overrides={"train": {"lrr": 1}}), "lrr"),
])
def test_mistakes_are_named(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_simenv_gets_pflsegs_allow_list_and_state_root(tmp_path, monkeypatch):
    monkeypatch.delenv("PFLSEG_STATE_DIR", raising=False)
    env = SimEnv(num_clients=2, workspace_root=str(tmp_path / "sim"))
    recipe = recipes.FedBNRecipe(name="fedbn_x")
    recipe.process_env(env)
    allowed = json.loads((tmp_path / "sim" / "fedbn_x" / "local" / "resources.json").read_text())["class_allow_list"]
    assert "pflseg.flare.controllers.fedbn.FedBNController" in allowed
    assert sim_state_root(env) == tmp_path / "sim" / "pflseg_state"
    assert recipe.results(env) == tmp_path / "sim" / "pflseg_state" / "server" / "fedbn_x" / "results.json"
    monkeypatch.setenv("PFLSEG_STATE_DIR", str(tmp_path / "from_env"))
    assert sim_state_root(env) == tmp_path / "from_env"
    given = SimEnv(num_clients=2, workspace_root=str(tmp_path / "sim"), extra={STATE_DIR: str(tmp_path / "st")})
    assert sim_state_root(given) == tmp_path / "st"  # the env's own setting wins


def test_a_sim_run_sets_the_state_root_for_its_sites_only_while_it_runs(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("PFLSEG_STATE_DIR", raising=False)
    seen = {}

    class Env(SimEnv):
        def deploy(self, job):
            seen.update(state=os.environ["PFLSEG_STATE_DIR"], cwd=os.getcwd(), name=job.name)
            return job.name

    run = recipes.LocalRecipe().run(Env(num_clients=2, workspace_root=str(tmp_path / "rel")))
    assert run.get_job_id() == "local" and seen["state"] == str(tmp_path / "rel" / "pflseg_state")
    assert "PFLSEG_STATE_DIR" not in os.environ  # restored


def test_pocenv_with_flares_default_project_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "poc"))
    with pytest.raises(ConfigError, match="allow none of pflseg's classes"):
        recipes.FedAvgRecipe().process_env(PocEnv(num_clients=2))
    recipes.FedAvgRecipe().process_env(PocEnv(num_clients=2, project_conf_path=str(tmp_path / "p.yml")))
