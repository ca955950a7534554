"""Run a pflseg job as a FLARE recipe (the `python job.py` route) on SimEnv, PocEnv or ProdEnv.

    python job.py fedavg --sites 3 --rounds 2 --workspace runs/simenv          # SimEnv (default)
    python job.py fedavg --env poc --rounds 2 --workspace runs/poc_env          # a fresh POC, then stopped
    python job.py fedavg --env prod --startup-kit runs/federation/.../admin@pflseg.org   # a running federation
    python job.py cross_site --bundle runs/simenv/state/server/fedavg          # post-training: the trained run
    python job.py fedavg --export --export-dir runs/jobs                       # FLARE's own flags: export only

The job is built from app_configs/<job>.yaml exactly as `pflseg jobs export` builds jobs/<job>/
(pflseg.flare.recipes). SimEnv: FLARE's workspace in W/sim, pflseg's state in W/state (results.json in
W/state/server/<job>). PocEnv: provisions pflseg's project on loopback in W/poc (stopping and replacing a POC that
runs there), runs the job, downloads it, stops the POC (its files stay). ProdEnv: submits to the federation of the
admin startup kit as its user (default: the kit folder's name) and downloads the result into the kit.
"""

import argparse
import json
import warnings
from pathlib import Path

#: FLARE's warning when its recipe module takes --export / --export-dir out of sys.argv at import (they are this
#: script's documented flags, declared below for --help and handed to FLARE as it expects)
_EXPORT_WARNING = "NVFlare reserves '--export' and '--export-dir'"


def parser() -> argparse.ArgumentParser:
    """The script's flags; built before anything heavy is imported (``--help`` answers at once)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="job config name (app_configs/<job>.yaml)")
    p.add_argument("--env", choices=("sim", "poc", "prod"), default="sim", help="where it runs (default sim)")
    p.add_argument("--sites", type=int, help="sim and poc: number of sites (default: sim 3, poc 2)")
    p.add_argument("--threads", type=int, help="sim: simulator threads (default: one per site)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--workspace", help="sim: default runs/simenv; poc: default runs/poc_env")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--bundle", help="post-training jobs: the trained job's server state folder (a server path)")
    p.add_argument("--startup-kit", help="prod: the admin's startup kit folder")
    p.add_argument("--username", help="prod: the admin user (default: the kit folder's name)")
    p.add_argument("--login-timeout", type=float, default=10.0, help="prod: seconds to log in (default 10)")
    p.add_argument("--timeout", type=float, default=3600.0, help="poc, prod: seconds to wait (default 3600)")
    p.add_argument("--export", action="store_true", help="FLARE's: write the job folder instead of running it")
    p.add_argument("--export-dir", help="FLARE's: where --export writes the job folder (default ./fl_job)")
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.export_dir and not args.export:
        p.error("--export-dir is where --export writes the job folder: add --export")
    # nvflare.recipe takes --export / --export-dir out of sys.argv when it is imported (after parse_args: they are
    # declared above, so --help lists them and parsing accepts them)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EXPORT_WARNING, category=UserWarning)
        from nvflare.recipe import ProdEnv, SimEnv

    from pflseg.config import parse_set
    from pflseg.flare.recipes import STATE_DIR, PflsegRecipe

    overrides = parse_set(args.set)
    n_sites = args.sites or (2 if args.env == "poc" else 3)
    if args.env != "prod":
        overrides.setdefault("min_clients", min(n_sites, 2))
    if args.env == "poc":  # the researcher's own POC sites have no data configured: they make the synthetic data
        overrides.setdefault("data", {}).setdefault("allow_synthetic", True)
    recipe = PflsegRecipe(args.job, rounds=args.rounds, overrides=overrides, bundle=args.bundle)

    if args.env == "sim":
        ws = Path(args.workspace or "runs/simenv").resolve()
        env = SimEnv(num_clients=n_sites, num_threads=args.threads or n_sites, workspace_root=str(ws / "sim"),
                     extra={STATE_DIR: str(ws / "state")})
        recipe.execute(env)
        _report(args.job, recipe.results(env))
        return
    if args.env == "poc":
        from pflseg.deploy.poc_env import pflseg_poc_env

        env = pflseg_poc_env(args.workspace or "runs/poc_env", n_sites=n_sites)
    else:
        if not args.startup_kit:
            p.error("--env prod needs --startup-kit (the admin's startup kit folder)")
        kit = Path(args.startup_kit).resolve()
        env = ProdEnv(startup_kit_location=str(kit), username=args.username or kit.name,
                      login_timeout=args.login_timeout)
    run = recipe.execute(env)
    download = run.get_result(timeout=args.timeout, clean_up=False)  # poc: stopped, its files kept
    print(f"job {run.get_job_id()}: {run.get_status()}")
    found = sorted(Path(download).rglob("results.json")) if download else []
    if not found:
        raise SystemExit(f"job {run.get_job_id()}: no results.json in {download} (status {run.get_status()})")
    _report(args.job, found[0])
    print(f"downloaded to {download}")


def _report(job: str, path: Path) -> None:
    """What `pflseg run` prints of a finished job's results.json, the sites left out, and where it is."""
    from pflseg.eval.tables import run_tables

    results = json.loads(Path(path).read_text())
    for table in run_tables(results, job):
        print(table)
    for site, why in sorted((results.get("missing") or {}).items()):
        print(f"left out: {site}: {why}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
