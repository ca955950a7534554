"""`pflseg` command line: argument parsing only; each command's handler is one call of ``pflseg.deploy`` or
``pflseg.eval``, where the work lives.

Heavy modules (torch, MONAI, nvflare, the method registry) are imported inside the handlers, never at the top
or while the parser is built: ``pflseg --help`` and ``pflseg --version`` stay fast.

Flags that several commands share are declared once (``SHARED``) and added by name (``_flags``); a command gives
its own help text and default. A report is one line of ``REPORTS``.
"""

from __future__ import annotations

import argparse
import sys

from pflseg import __version__

# ---- what a flag's text means ------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (0 would silently mean "the default" where the code reads ``x or default``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 seconds")
    return value


def _preset(text: str) -> str | None:
    """argparse type of ``--preset``: a synthetic data preset's name; ``none`` (the plain generator) is None."""
    return None if text == "none" else text


def _sites_renamed(text: str) -> str:
    """argparse type of ``jobs export --sites``: refused; ``--sites`` is a number of sites in every other command."""
    raise argparse.ArgumentTypeError(f"{text!r}: jobs export names its sites with --site-names A,B,... "
                                     "(--sites is a number of sites in pflseg's other commands)")


def _names(text: str | None) -> list[str] | None:
    """``--site-names A,B`` / ``--methods A,B``: the names, or None when there is none."""
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


# ---- handlers: parsed flags -> one call of deploy/ or eval/ ----------------------------------------------------------


def _data_synth(args) -> int:
    from pflseg.eval.datasets import synth

    print(synth(args.out, args.task, args.sites, args.seed, args.size, args.depth, args.preset, args.outside,
                args.near_copy_of))
    return 0


def _data_index(args) -> int:
    from pflseg.eval.datasets import index

    print(index(args.layout, args.root, args.out, args.seed, args.classes, args.mask_threshold))
    return 0


def _data_check(args) -> int:
    from pflseg.eval.datasets import check

    text, ok = check(args.root)
    print(text)
    return 0 if ok else 1


def _jobs_export(args) -> int:
    from pflseg.config import job_names
    from pflseg.deploy.data_sites import job_overrides
    from pflseg.flare.jobs import export_job

    overrides, sites = job_overrides(args.set, args.data, args.size) or None, _names(args.site_names)
    for name in args.names or job_names():
        print(export_job(name, args.out, overrides=overrides, mode=args.mode, gpu_mem_gib=args.gpu_mem, sites=sites))
    return 0


def _run(args) -> int:
    from pflseg.eval.runs import run_job

    run_job(args.job, args.workspace, sites=args.sites, site_names=_names(args.site_names), rounds=args.rounds,
            threads=args.threads, data=args.data, size=args.size, resume=args.resume, sets=args.set)
    return 0


def _run_overrides(args, workspace) -> dict:
    """``pflseg run``'s config overrides (``pflseg.eval.runs.run_overrides``) from its parsed flags."""
    from pflseg.eval.runs import run_overrides

    return run_overrides(args.job, workspace, args.set, args.data, args.size, args.rounds, args.sites,
                         _names(args.site_names), args.resume)


def _demo(args) -> int:
    from pflseg.eval.demo import ROUNDS, run_demo

    print(run_demo(args.workspace, rounds=args.rounds or ROUNDS, threads=args.threads))
    return 0


def _bench_options(args) -> dict:
    """``pflseg.eval.bench.run_bench``'s keywords from the flags of ``_bench_flags``."""
    return {"workspace": args.workspace, "data": args.data, "synth_sites": args.synth_sites, "seeds": args.seeds,
            "rounds": args.rounds, "holdout": args.holdout, "sets": args.set, "size": args.size,
            "threads": args.threads, "sites": args.sites, "site_names": _names(args.site_names), "preset": args.preset,
            "jobs": args.jobs}


def _bench(args) -> int:
    from pflseg.eval.bench import run_bench

    run_bench(methods=args.methods, outside=not args.no_outside, **_bench_options(args))
    return 0


def _loso(args) -> int:
    from pflseg.eval.bench import run_loso

    run_loso(**_bench_options(args))
    return 0


#: the bench's simulator jobs side by side: 2, as the demo runs them (its jobs on 2 cores: FLARE's start-up, waits and
#: final tests leave a core idle that the second job uses)
BENCH_JOBS = 2


#: ``pflseg report NAME``: the module whose ``report(**flags)`` returns the Markdown to print (it reads the flags it
#: needs and ignores the others)
REPORTS = {"fedsm-benchmark": "pflseg.eval.fedsm_benchmark", "gpu": "pflseg.eval.gpu",
           "grace-benchmark": "pflseg.flare.controllers.grace_benchmark",
           "heterogeneity": "pflseg.eval.heterogeneity", "iopfl-cost": "pflseg.eval.iopfl_cost",
           "routing-validation": "pflseg.eval.routing_validation", "soak": "pflseg.eval.soak",
           "speed": "pflseg.eval.speed"}


def _report(args) -> int:
    from importlib import import_module

    print(import_module(REPORTS[args.report]).report(**vars(args)))
    return 0


def _deploy_local(args) -> int:
    from pflseg.deploy.local import deploy_local

    deploy_local(args.workspace, args.project, args.data, args.sites, _names(args.site_names), args.device,
                 args.timeout, allow_list=args.allow_list)
    return 0


def _deploy_status(args) -> int:
    from pflseg.deploy.local import federation_status

    return 0 if federation_status(args.workspace) else 1


def _deploy_stop(args) -> int:
    from pflseg.deploy.local import stop_federation

    return 0 if stop_federation(args.workspace) else 1


def _submit(args) -> int:
    from pflseg.deploy.submit import submit_report

    submit_report(args.job, args.kit, user=args.user, timeout=args.timeout, out=args.out)
    return 0


def _poc(args) -> int:
    from pflseg.deploy.poc import run_poc

    run_poc(args.job, args.workspace, args.sites, _names(args.site_names), args.rounds, args.data, args.size, args.set)
    return 0


def _site_init(args) -> int:
    from pflseg.deploy.site_setup import POLICY_FLAGS, site_init, site_policy

    policy = site_policy(_names(args.methods), **{flag: getattr(args, flag) for flag in POLICY_FLAGS})
    site_init(args.site_dir, args.data, args.site_name, args.data_site, args.device, args.state_dir, policy,
              args.threads)
    return 0


def _site_check(args) -> int:
    from pflseg.deploy.site_setup import site_check

    return 0 if site_check(args.site_dir, args.site_name) else 1


# ---- the parser --------------------------------------------------------------------------------------------------

#: flags several commands share, declared once: ``_flags(parser, name=help)`` adds ``--name`` with these keywords
#: (``site_names``: ``--site-names``); a command gives its own help and may override any keyword (its default)
SHARED: dict[str, dict] = {
    "workspace": {},
    "data": {},
    "sites": {"type": _positive},
    "site_names": {"metavar": "A,B,..."},
    "size": {"type": _positive},
    "rounds": {"type": _positive},
    "threads": {"type": _positive, "help": "simulator threads per run (default: one per site)"},
    "seed": {"type": int, "default": 0},
    "seeds": {"type": int, "nargs": "+"},
    "set": {"action": "append", "default": [], "metavar": "KEY=VALUE", "help": "config override"},
    "task": {"choices": ["prostate", "fundus"], "default": "prostate"},
    "preset": {"type": _preset, "default": "bench"},
    "outside": {"nargs": "+", "metavar": "KIND"},
    "device": {"default": "auto"},
    "timeout": {"type": _seconds},
}


def _flags(parser: argparse.ArgumentParser, **flags: str | dict) -> None:
    """Add shared flags (``SHARED``) in the order given; each value is the flag's help text, or a dict of argparse
    keywords (its help, default, ...) over the shared ones."""
    for name, own in flags.items():
        own = {"help": own} if isinstance(own, str) else own
        parser.add_argument("--" + name.replace("_", "-"), **{**SHARED[name], **own})


def _site_flags(parser, default: str) -> None:
    """--sites, --site-names and --size of the commands that run jobs on a data root."""
    _flags(parser, sites=f"number of sites: the first N of --data's sites (default: {default})",
           site_names="these sites of --data (dataset.json names)",
           size="training image size data.size (default: --data's train_size when recorded, else the job's)")


def _bench_flags(parser, workspace: str, seeds: list[int], rounds: int, sites: int) -> None:
    """The flags of the bench and of the protocols that are a bench (``_bench_options``)."""
    _flags(parser, workspace={"default": workspace,
                              "help": f"folder of the data, runs and tables (default: {workspace})"},
           data="data root (default: synthetic data of --preset, made per seed in the workspace: its inside sites "
                "train, its outside sites are held out)",
           preset="synthetic data preset (pflseg.data.synth.PRESETS; 'none': the plain generator with "
                  "--synth-sites sites)")
    parser.add_argument("--synth-sites", type=_positive, default=sites,
                        help="sites of --preset none (the last: outside)")
    parser.add_argument("--holdout", nargs="+",
                        help="held-out sites (default: synthetic: its outside sites; --data: every site; 'all': each "
                             "once)")
    _flags(parser, seeds={"default": seeds,
                          "help": f"seeds: one run of every method per seed (default: {' '.join(map(str, seeds))})"},
           rounds={"default": rounds, "help": f"rounds of every job (default: {rounds})"}, threads={})
    parser.add_argument("--jobs", type=_positive, default=BENCH_JOBS,
                        help=f"simulator jobs side by side (default: {BENCH_JOBS}: FLARE's start-up and round trips "
                             "leave cores idle that a second job uses; the results do not depend on it)")
    _site_flags(parser, "all sites of --data")
    _flags(parser, set="config override for every job")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that runs ``prepare(self)`` once, when its command is parsed (or its help printed): what
    needs the method registry (the bench's --methods choices and default) is filled in only then."""

    prepare = None

    def parse_known_args(self, args=None, namespace=None):
        if self.prepare is not None:
            prepare, self.prepare = self.prepare, None
            prepare(self)
        return super().parse_known_args(args, namespace)


def _registry_methods(parser: argparse.ArgumentParser) -> None:
    """--methods of the bench: choices and default from the registry (``pflseg.eval.bench``)."""
    from pflseg.eval.bench import default_methods, inside_columns

    for action in parser._actions:
        if action.dest == "methods":
            action.choices, action.default = list(inside_columns()), list(default_methods())
            action.help = f"{action.help}: {', '.join(action.choices)}"


def _reference_job(parser: argparse.ArgumentParser) -> None:
    """--job of the POC: its default the registry's reference job (``pflseg.flare.methods.REFERENCE_JOB``)."""
    from pflseg.flare.methods import REFERENCE_JOB

    for action in parser._actions:
        if action.dest == "job":
            action.default, action.help = REFERENCE_JOB, f"job name (app_configs/<job>.yaml; default {REFERENCE_JOB})"


def _data_parser(sub) -> None:
    d = sub.add_parser("data", help="make, index and check data sets").add_subparsers(dest="data_cmd", required=True)
    s = d.add_parser("synth", help="make a synthetic multi-site NIfTI data set")
    s.set_defaults(func=_data_synth)
    s.add_argument("--out", required=True, help="data root to write (a new or empty folder, or an earlier "
                                                 "synthetic data root: another data root is not overwritten)")
    _flags(s, task="prostate: gray volumes, one class; fundus: RGB images, disc and cup (default prostate)",
           sites="sites without a preset (default 6; the last is an outside site)",
           seed="data seed (template jitter and every case)",
           preset={"default": "none", "help": "bench | demo (pflseg.data.synth.PRESETS): sites, knobs, cases per "
                                              "split, size and depth; 'none' (default): the plain generator"},
           outside="with --preset: outside site kinds, e.g. near_copy blend extrapolate (default: the preset's)")
    s.add_argument("--near-copy-of", help="with --preset: the inside site a near_copy outside site copies")
    _flags(s, size="nominal in-plane size (default 64 or the preset's)")
    s.add_argument("--depth", type=_positive, help="slices per case (default 12 or the preset's)")
    i = d.add_parser("index", help="write per-site datalists for a real data layout; print what each site holds")
    i.set_defaults(func=_data_index)
    i.add_argument("--layout", required=True,
                   help="saml, nvflare_prostate, prostate_slices, fundus or generic (<root>/<site>/{images,masks}/ "
                        "or <root>/<site>/{train,test}/{images,masks}/)")
    i.add_argument("--root", required=True, help="folder holding one folder per site")
    i.add_argument("--out", required=True, help="data root to write (dataset.json + <site>/datalist.json); an "
                                                 "earlier index of the same --root and --layout is rewritten, "
                                                 "another data root is not overwritten")
    _flags(i, seed="seed of the case-level train/validation(/test) split")
    i.add_argument("--mask-threshold", type=float, metavar="T",
                   help="generic: mask value > T is foreground (lossy masks, e.g. JPEG: --mask-threshold 127)")
    i.add_argument("--classes", metavar="A,B,...",
                   help="generic: class names for masks labelled 0..C (needed for masks with more than two "
                        "values; one name names the class of binary masks)")
    c = d.add_parser("check", help="report every problem of a data set")
    c.set_defaults(func=_data_check)
    c.add_argument("root", help="data root (dataset.json + one folder per site)")


def _jobs_parser(sub) -> None:
    j = sub.add_parser("jobs", help="FLARE job folders").add_subparsers(dest="jobs_cmd", required=True)
    e = j.add_parser("export", help="write jobs/<name>/ from app_configs/")
    e.set_defaults(func=_jobs_export)
    e.add_argument("names", nargs="*", help="jobs to export (app_configs/<name>.yaml; default: every job)")
    e.add_argument("--out", default="jobs", help="folder to write the job folders into (default: jobs)")
    e.add_argument("--mode", choices=["package", "byoc"], default="package",
                   help="package: no code in the job, sites pip-install pflseg (default); byoc: pflseg in app/custom")
    e.add_argument("--gpu-mem", type=float, metavar="GIB",
                   help="require one GPU per site with this many GiB (meta.json resource_spec)")
    _flags(e, site_names="comma-separated site names for a per-site resource_spec (with --gpu-mem)",
           sites={"type": _sites_renamed, "help": argparse.SUPPRESS},  # a count everywhere else
           set="config override, e.g. rounds=3",
           data="data root whose dataset.json sets net.in_channels, net.out_channels and data.size (train_size) "
                "unless --set says otherwise",
           size={"type": int, "help": "data.size (default: --data's train_size when recorded)"})


def _run_parsers(sub) -> None:
    r = sub.add_parser("run", help="run a job in the FLARE simulator")
    r.set_defaults(func=_run)
    r.add_argument("job", help="job name (app_configs/<job>.yaml), e.g. fedavg")
    _site_flags(r, "all sites of --data, else 3 synthetic sites")
    _flags(r, rounds="federated rounds (default: the job's rounds)",
           threads="simulator threads (default: one per site)",
           workspace="folder of the run: simulator workspace, state, results (default: runs/<job>)",
           data="data root (default: synthetic data made at each site); its sites run under their own names, its "
                "channels, classes and train_size set the network and data.size unless --set says otherwise")
    r.add_argument("--resume", action="store_true", help="continue from the last completed round")
    _flags(r, set="config override, e.g. train.lr=0.0005")

    m = sub.add_parser("demo", help="the bench's synthetic sites scaled down (preset demo): FedAvg and the "
                                    "personalized methods on 3 inside sites, IOP-FL routing and FedSM at an outside "
                                    "site; tables with paired differences, sentences, pictures")
    m.set_defaults(func=_demo)
    _flags(m, workspace={"default": "demo", "help": "folder of the demo's data, runs and report (default: demo)"},
           rounds="rounds of every job (default: pflseg.eval.demo.ROUNDS)", threads={})

    bp = sub.add_parser("bench", help="every method on the same data and budget: inside and leave-one-site-out tables")
    bp.set_defaults(func=_bench)
    _bench_flags(bp, "runs/bench", [0, 1, 2], 20, 6)
    bp.add_argument("--methods", nargs="+", metavar="METHOD",
                    help="methods to compare (default: every registered method with inside columns; "
                         "choices: the registry's, pflseg.flare.methods)")
    bp.prepare = _registry_methods
    bp.add_argument("--no-outside", action="store_true", help="inside table only")

    lo = sub.add_parser("loso", help="leave-one-site-out: every site held out once, the methods the outside claims "
                                     "need (pflseg bench --holdout all --methods ...)")
    lo.set_defaults(func=_loso)
    _bench_flags(lo, "runs/loso", [0, 1, 2], 20, 6)


def _fedsm_benchmark_flags(p) -> None:
    _flags(p, workspace="default runs/fedsm_bench", rounds="rounds of each run (default 20)",
           seeds={"default": [0, 1], "help": "seeds (default: 0 1)"})


def _grace_benchmark_flags(p) -> None:
    _flags(p, sites={"default": 6, "help": "sites whose updates the server step aggregates (default 6)"})
    p.add_argument("--repeats", type=_positive, default=5, help="timing repeats (default 5)")


def _heterogeneity_flags(p) -> None:
    _flags(p, workspace="default runs/heterogeneity", rounds="rounds of each Local and FedAvg run (default 20)",
           seeds={"default": [0], "help": "the data seed: the first (default 0)"},
           task="synthetic task (default prostate)",
           preset="synthetic data preset (bench | demo; 'none': the plain 6-site generator; default bench)",
           outside="outside site kinds of the preset (near_copy blend extrapolate; default: the preset's)",
           size="data and training size (default: the preset's)")


def _iopfl_cost_flags(p) -> None:
    p.add_argument("--sizes", type=_positive, nargs="+", default=[64, 256], help="image sizes (default 64 256)")
    p.add_argument("--experts", type=_positive, default=5, help="K + 1 (default 5)")
    p.add_argument("--batch", type=_positive, default=8, help="batch (default 8)")
    p.add_argument("--epochs", type=_positive, default=10, help="test-time epochs (default 10)")
    p.add_argument("--repeats", type=_positive, default=5, help="timing repeats (default 5)")
    p.add_argument("--json", help="also write the rows as JSON here")


def _routing_validation_flags(p) -> None:
    p.add_argument("--run", required=True, help="workspace of a finished `pflseg run iopfl` (its bundle)")
    p.add_argument("--data", required=True, help="data root holding the validation sites")
    p.add_argument("--site-names", required=True, metavar="A,B,...",
                   help="validation sites: near_copy / extrapolate outside sites, or an inside site left out of --run")
    p.add_argument("--variants", nargs="+", help="loss variants (default: all of pflseg.eval.routing_validation)")
    p.add_argument("--rates", nargs="+", type=float, help="router learning rates (default 0.001 0.01 0.1)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per run (default: the run's iopfl budget)")
    p.add_argument("--every", type=_positive, default=38, help="score every this many steps (default 38)")
    p.add_argument("--seed", type=int, default=0, help="router init, batch order and noise (default 0)")
    p.add_argument("--out", help="folder of routing_validation.json/.md (default: --run)")


def _soak_flags(p) -> None:
    from pflseg.eval import soak  # its own flags (a light import: no torch at module level)

    _flags(p, workspace="folder of the data, runs and soak.json (default: runs/soak)",
           sites=f"sites of every run (default {soak.DEFAULTS['sites']})",
           size=f"image size (default {soak.DEFAULTS['size']})")
    soak.add_arguments(p)
    p.prepare = soak.name_defaults


def _speed_flags(p) -> None:
    from pflseg.eval import speed  # its own flags (a light import: no torch at module level)

    d = speed.DEFAULTS
    _flags(p, workspace="folder of the data, runs and report (default: runs/speed)",
           sites=f"sites of every run (default {d['sites']})",
           rounds=f"rounds of every run (default {d['rounds']}; the first is not measured)",
           size=f"image size (default {d['size']})", set="config override for every job")
    p.add_argument("--repeats", type=_positive, help="timing repeats of the aggregation step")
    speed.add_arguments(p)  # the rest of its flags
    p.prepare = speed.name_defaults


def _gpu_flags(p) -> None:
    from pflseg.eval import gpu  # its own flags (a light import: no torch at module level)

    gpu.add_arguments(p)


#: ``pflseg report NAME``'s help and the function adding its own flags (``REPORTS`` names its module)
REPORT_PARSERS = {
    "fedsm-benchmark": ("communication and timing of FedSM's two selectors", _fedsm_benchmark_flags),
    "gpu": ("the GPU check (~10 min on one GPU): gpu tests, amp on/off per demo method, sites sharing the GPU; "
            "--dry-run on the CPU, --plan", _gpu_flags),
    "grace-benchmark": ("GRACE's server step against FedAvg's", _grace_benchmark_flags),
    "heterogeneity": ("how different the synthetic sites are (each inside site's Local vs FedAvg)",
                      _heterogeneity_flags),
    "iopfl-cost": ("IOP-FL routing's cost per image against one UNet forward", _iopfl_cost_flags),
    "routing-validation": ("does routing's unsupervised loss track Dice? variants and rates at validation outside "
                           "sites (never the judged ones)", _routing_validation_flags),
    "soak": ("memory per process round after round over a long run (default FedAvg and FedSM, 100 rounds)",
             _soak_flags),
    "speed": ("wall per round, FLARE's fixed cost and memory per method (simulator and POC)", _speed_flags),
}


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="cost benchmarks and data heterogeneity (Markdown tables); the protocols are "
                                       "`pflseg bench`")
    *names, last = REPORTS
    reports = rp.add_subparsers(dest="report", required=True, metavar="REPORT", parser_class=_Parser,
                                help=f"which report: {', '.join(names)} or {last} (`pflseg report REPORT --help`: "
                                     "its own flags)")
    for name in REPORTS:
        text, add = REPORT_PARSERS[name]
        parser = reports.add_parser(name, help=text, description=text)
        parser.set_defaults(func=_report)
        add(parser)


def _deploy_parsers(sub) -> None:
    dsub = sub.add_parser("deploy", help="a provisioned federation on this machine (loopback)").add_subparsers(
        dest="deploy_cmd", required=True)
    dl = dsub.add_parser("local", help="provision provisioning/project.yml on loopback, start server + sites, wait")
    dl.set_defaults(func=_deploy_local)
    dl.add_argument("--project", help="project.yml (default: provisioning/project.yml)")
    dl.add_argument("--allow-list", choices=["narrow", "broad"], help="the kits' class allow list: narrow (the classes "
                    "pflseg's jobs name; the project's default) or broad (FLARE's default list plus pflseg's classes)")
    _flags(dl, data="data root every site uses (default: synthetic data made at each site); its sites replace "
                    "project.yml's sites",
           sites="the first N sites of --data (default: all)", site_names="these sites of --data",
           device="every site's device: auto (CUDA when present), cpu or cuda (default auto)",
           timeout={"default": 180.0, "help": "seconds to wait for the server and every site to connect (default 180)"})
    dsub.add_parser("status", help="connected sites and resident memory").set_defaults(func=_deploy_status)
    dsub.add_parser("stop", help="shut down through the FLARE API").set_defaults(func=_deploy_stop)
    for parser in dsub.choices.values():
        _flags(parser, workspace={"default": "runs/federation", "help": "folder of the provisioned kits and their "
                                                                        "processes (default: runs/federation)"})

    sb = sub.add_parser("submit",
                        help="submit a job folder through the FLARE API, wait, download, print per-site metrics")
    sb.set_defaults(func=_submit)
    sb.add_argument("job", help="job folder (e.g. jobs/fedavg)")
    sb.add_argument("--kit", required=True, help="the admin's startup kit folder")
    sb.add_argument("--user", help="admin user name (default: the kit folder's name)")
    _flags(sb, timeout={"default": 3600.0, "help": "seconds to wait for the job to finish (default 3600)"})
    sb.add_argument("--out", help="where to put the downloaded job (default: the kit's transfer folder)")

    pc = sub.add_parser("poc",
                        help="FLARE POC on loopback: prepare, start, submit one job, print per-site metrics, stop")
    pc.set_defaults(func=_poc)
    pc.add_argument("--job", help="job name (app_configs/<job>.yaml; default: the registry's reference job)")
    pc.prepare = _reference_job
    _site_flags(pc, "all sites of --data, else 2")
    _flags(pc, rounds={"default": 2, "help": "federated rounds (default 2)"},
           data="data root (default: synthetic data made at each site); its sites are the POC sites",
           workspace={"default": "runs/poc", "help": "folder of the POC kits, jobs and results (default: runs/poc)"},
           set={})


def _site_parsers(sub) -> None:
    si = sub.add_parser("site", help="site-local configuration").add_subparsers(dest="site_cmd", required=True)
    init = si.add_parser("init", help="check, then write <site-dir>/local/pflseg_site.json (data location, device, "
                                      "state folder, the site's policy)")
    init.set_defaults(func=_site_init)
    _flags(init, data={"required": True, "help": "the site's data root (made by `pflseg data index|synth`)"},
           device={"default": None, "help": "auto, cpu, cuda or cuda:N (checked on this machine; default: the earlier "
                                            "setting, else auto)"},
           threads="torch CPU threads of the site's jobs (default: the earlier setting, else torch's)")
    init.add_argument("--data-site", help="the site's folder name in the data root (default: FLARE site name)")
    init.add_argument("--state-dir", help="where the site keeps models and state (default: <site-dir>/pflseg_state); "
                                          "made with mode 0700, may lie outside the kit")
    pol = init.add_argument_group("the site's policy (pflseg.flare.policy; default: allow what the job asks)")
    pol.add_argument("--methods", metavar="A,B,...", help="run only these methods")
    pol.add_argument("--no-per-case", action="store_true", help="refuse jobs that ask for Dice per case")
    pol.add_argument("--no-round-test", action="store_true", help="refuse IOP-FL's per-round test scores")
    pol.add_argument("--no-publish", action="store_true", help="keep personalized models at the site (refuses FedSM, "
                                                               "LC-Fed with HC, IOP-FL's bundle)")
    pol.add_argument("--allow-pooling", action="store_true", help="let Centralized train on other sites' folders of "
                                                                  "the data root in a deployment")
    pol.add_argument("--allow-two-sites", action="store_true", help="join deployed training jobs of exactly two sites "
                                                                    "(each can recover the other's model)")
    pol.add_argument("--allow-per-case", action="store_true", help="send Dice per case (pseudonymised) when a deployed "
                                                                   "job asks (default: the simulator only)")
    pol.add_argument("--allow-remote-tracking", action="store_true", help="let a deployed job's tracking send metrics "
                                                                          "to another host (MLflow URI, W&B online)")
    pol.add_argument("--require-dp", action="store_true", help="refuse training jobs whose model updates leave "
                                                               "without DP (privacy.update.dp)")
    pol.add_argument("--min-noise-multiplier", type=float, metavar="X", help="with DP required, the least "
                                                                             "privacy.update.dp.noise_multiplier")
    for flag, what in (("--min-batch-size", "the least train.batch_size (deployment default 4)"),
                       ("--max-evaluations-per-job", "scoring tasks answered per job (deployment default 2)"),
                       ("--max-image-size", "the largest data.size (deployment default 512)"),
                       ("--max-rounds-x-epochs", "the largest rounds x train.epochs (deployment default 10000)")):
        pol.add_argument(flag, type=int, metavar="N", help=what)
    pol.add_argument("--max-memory-gib", type=float, metavar="GIB", help="the job's memory estimate at most this "
                                                                          "(deployment default: this machine's)")
    check = si.add_parser("check", help="print the site's settings and policy, and whether its data validates "
                                        "(exit 1 when not)")
    check.set_defaults(func=_site_check)
    for parser in (init, check):
        parser.add_argument("--site-dir", default=".", help="the site's startup kit folder (default: here)")
        parser.add_argument("--site-name", help="the FLARE site name (default: the --site-dir folder's name)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pflseg", description="Personalized federated segmentation on NVIDIA FLARE")
    p.add_argument("--version", action="version", version=f"pflseg {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for add in (_data_parser, _jobs_parser, _run_parsers, _report_parser, _deploy_parsers, _site_parsers):
        add(sub)
    return p


#: what to do after Ctrl-C / SIGTERM stopped a command's run, per command
_AFTER_STOP = {"run": "continue with --resume",
               "bench": "run the same command again to continue (finished runs are read back, this one resumes)"}


def main(argv: list[str] | None = None) -> int:
    """Run one command. Ctrl-C (SIGINT) and SIGTERM stop it without a traceback: a simulator it runs is stopped
    whole (``pflseg.deploy.simulator.Interrupted``), the last completed round is named, and the exit code is
    130 / 143 (128 + the signal's number)."""
    args = build_parser().parse_args(argv)
    import signal
    import threading

    from pflseg.config import ConfigError
    from pflseg.data import DataError
    from pflseg.deploy.simulator import Interrupted, raise_interrupted

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_interrupted) if main_thread else None
    try:
        return args.func(args)
    except (ConfigError, DataError, OSError, RuntimeError, ValueError) as exc:  # OSError: FileNotFoundError too
        print(f"pflseg: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"pflseg: {exc.message(_AFTER_STOP.get(args.cmd, 'run the same command again'))}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt as exc:  # one that says more (e.g. a submitted job goes on at the server) says it
        print(f"pflseg: {str(exc) or 'stopped (SIGINT)'}", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
