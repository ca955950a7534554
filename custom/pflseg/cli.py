"""`pflseg` command line: argument parsing only; the work lives in the modules it calls.

Heavy modules (torch, MONAI, nvflare, the method registry) are imported inside the handlers, never at the top
or while the parser is built: ``pflseg --help`` and ``pflseg --version`` stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pflseg import __version__


def _data(args) -> int:
    from pflseg import data

    if args.data_cmd == "synth":
        preset = None if args.preset == "none" else args.preset
        out = data.make_synthetic(args.out, task=args.task, n_sites=args.sites, seed=args.seed, size=args.size,
                                  depth=args.depth, preset=preset, outside=args.outside, near_copy_of=args.near_copy_of)
        info = data.load_dataset_info(out)
        print(f"synthetic {args.task} data set with {len(info['sites'])} sites in {out}"
              + (f" (preset {preset}, seed {args.seed})" if preset else ""))
        for site, p in (info.get("site_profiles") or {}).items():
            knobs = ", ".join(f"{k}={p[k]}" for k in ("dilate", "contour", "include_adjacent", "noisy", "radius_scale"))
            split = "/".join(str(p["split"][k]) for k in ("training", "validation", "testing"))
            kind = p.get("outside_kind", p["kind"])
            print(f"  {site}: {kind}, cases train/val/test {split}, {p['n_px']} px, {knobs}")
    elif args.data_cmd == "index":
        classes = [c.strip() for c in args.classes.split(",")] if args.classes is not None else None
        print(data.index_report(args.layout, args.root, args.out, seed=args.seed, classes=classes,
                                mask_threshold=args.mask_threshold))
    else:
        problems = data.check_dataset(args.root)
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s) in {args.root}")
        return 1 if problems else 0
    return 0


def _jobs(args) -> int:
    from pflseg.config import job_names, parse_set
    from pflseg.flare.jobs import export_job

    sites = _names(args.site_names)
    overrides = parse_set(args.set)
    if args.data:  # channels, classes and training size of this data root unless --set says otherwise
        from pflseg.deploy.data_sites import data_overrides

        overrides = data_overrides(Path(args.data).resolve(), overrides, args.size)
    elif args.size:
        overrides.setdefault("data", {}).setdefault("size", args.size)
    overrides = overrides or None
    for name in args.names or job_names():
        print(export_job(name, args.out, overrides=overrides, mode=args.mode, gpu_mem_gib=args.gpu_mem, sites=sites))
    return 0


def _deploy(args) -> int:
    from pflseg.deploy.local import LocalFederation

    project = {"project_yml": args.project} if getattr(args, "project", None) else {}
    site_cfg = {"device": getattr(args, "device", "auto")}
    if args.deploy_cmd == "local" and args.data:  # the data root's own sites become the provisioned sites
        import yaml

        from pflseg.deploy.data_sites import project_with_sites
        from pflseg.deploy.provision import REPO_PROJECT

        ws = Path(args.workspace).resolve()
        data, mapping = _data_sites(args, ws)
        site_cfg["data"] = str(data)
        source = yaml.safe_load(Path(project.get("project_yml", REPO_PROJECT)).read_text())
        ws.mkdir(parents=True, exist_ok=True)
        (ws / "project.data.yml").write_text(yaml.safe_dump(project_with_sites(source, list(mapping)), sort_keys=False))
        project = {"project_yml": ws / "project.data.yml"}
    fed = LocalFederation(args.workspace, **project)
    if args.deploy_cmd == "local":
        fed.provision(site_cfg)
        fed.start()
        fed.wait_connected(timeout=args.timeout)
        kit = fed.admin_kit()
        print(f"federation running ({fed.rss_bytes() / 2**30:.2f} GiB resident); admin kit: {kit}")
        if args.data:
            print(f"  jobs for this data: pflseg jobs export fedavg --out runs/jobs --data {Path(args.data).resolve()}")
        print(f"  submit:  pflseg submit jobs/fedavg --kit {kit}")
        print(f"  console: {kit}/startup/fl_admin.sh")
        print(f"  stop:    pflseg deploy stop --workspace {args.workspace}")
    elif args.deploy_cmd == "status":
        if not fed.processes():
            print(f"no federation running from {fed.workspace} (start one: pflseg deploy local --workspace "
                  f"{args.workspace})")
            return 1
        sess = fed.session()
        try:
            print(f"connected sites: {', '.join(fed.connected(sess)) or 'none'}")
        finally:
            sess.close()
        print(f"{len(fed.processes())} process(es), {fed.rss_bytes() / 2**30:.2f} GiB resident")
    else:
        killed = fed.stop()
        left = fed.processes()
        print(f"stopped; {len(killed)} leftover process(es) killed; {len(left)} still alive")
        return 1 if left else 0
    return 0


def _poc(args) -> int:
    from pflseg.config import parse_set
    from pflseg.deploy.poc import PocFederation
    from pflseg.deploy.submit import metrics_table, submit
    from pflseg.flare.jobs import export_job

    ws = Path(args.workspace).resolve()
    overrides, data, names = _data_overrides(args, parse_set(args.set)), None, _names(args.site_names)
    if args.data:
        data, mapping = _data_sites(args, ws)
        names = list(mapping)
    else:  # a researcher's POC on this machine: its sites make the job's synthetic data (a deployment refuses that)
        overrides.setdefault("data", {}).setdefault("allow_synthetic", True)
    n = len(names) if names else args.sites or 2
    overrides.setdefault("rounds", args.rounds)
    overrides.setdefault("min_clients", min(n, 2))
    fed = PocFederation(ws, n_sites=n, clients=names)
    fed.provision({"data": str(data)} if data else None)
    try:
        fed.start()
        fed.wait_connected()
        job = export_job(args.job, fed.workspace / "jobs", overrides=overrides)
        results = submit(job, fed.admin_kit(), out=fed.workspace / "results")
        print(metrics_table(results))
    finally:
        fed.stop()
    return 0


def _submit(args) -> int:
    from pflseg.deploy.submit import metrics_table, submit

    try:
        results = submit(args.job, args.kit, user=args.user, timeout=args.timeout, out=args.out)
    except ConnectionError as exc:  # nvflare's NoConnection: the server is down or not reachable
        raise RuntimeError(f"cannot reach the FLARE server of the admin kit {Path(args.kit).resolve()} ({exc}): is the "
                           "federation running? Start it (pflseg deploy local) or check the server's address and "
                           "port in the kit's startup/fed_admin.json") from None
    print(metrics_table(results))
    print(f"downloaded to {results['download']}")
    return 0


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _data_sites(args, workspace: Path) -> tuple[Path, dict[str, str]]:
    """``--data`` with ``--sites`` / ``--site-names``: (data root to run on, {FLARE name: data site})."""
    from pflseg.deploy.data_sites import choose_sites, renamed, site_view

    root = Path(args.data).resolve()
    data, mapping = site_view(root, choose_sites(root, args.sites, _names(args.site_names)), workspace / "data_view")
    print(f"sites of {root}: {', '.join(mapping)}")
    if renamed(mapping):
        print(renamed(mapping))
    return data, mapping


def _data_overrides(args, overrides: dict) -> dict:
    """The user's --set plus channels, classes and size from --data's dataset.json (and --size)."""
    if args.data:
        from pflseg.deploy.data_sites import data_overrides

        return data_overrides(Path(args.data).resolve(), overrides, args.size)
    if args.size:
        overrides.setdefault("data", {}).setdefault("size", args.size)
    return overrides


def _run(args) -> int:
    from pflseg.deploy.simulator import result_warnings, run_simulator, workspace_lock
    from pflseg.eval.plots import write_results
    from pflseg.eval.tables import run_tables
    from pflseg.flare.jobs import export_job

    workspace = Path(args.workspace or f"runs/{args.job}")
    with workspace_lock(workspace):  # one run per workspace: a second fails here, before it touches anything
        overrides = _run_overrides(args, workspace)
        data, clients = None, _names(args.site_names)
        if args.data:
            data, mapping = _data_sites(args, workspace.resolve())
            clients = list(mapping)
        n = len(clients) if clients else args.sites or 3
        job_dir = export_job(args.job, workspace / "job", overrides=overrides)
        results = run_simulator(job_dir, workspace, n_sites=n, threads=args.threads, data=data, clients=clients)
        for table in run_tables(results, args.job):
            print(table)
        if results["missing"]:
            print(f"sites left out: {json.dumps(results['missing'])}")
        for line in write_results(results, workspace):
            print(line)
        for line in result_warnings(results):
            print(line)
    return 0


def _run_overrides(args, workspace: Path) -> dict:
    """``pflseg run``'s config overrides. With ``--resume`` the earlier run in the workspace is continued only
    when it is the same run (``run.json``: the same effective config but a larger ``--rounds``, data and
    sites); another one is moved aside to ``<workspace>.<timestamp>`` (said, naming the keys that differ) and
    this run starts afresh."""
    from pflseg.config import load_job_config, parse_set
    from pflseg.deploy.simulator import judge, move_aside, run_record

    overrides = _data_overrides(args, parse_set(args.set))
    if args.rounds:
        overrides["rounds"] = args.rounds
    root = Path(args.data).resolve() if args.data else None
    if root is not None:
        from pflseg.deploy.data_sites import choose_sites, flare_names

        sites = flare_names(choose_sites(root, args.sites, _names(args.site_names)))
    else:
        sites = _names(args.site_names) or [f"site-{i + 1}" for i in range(args.sites or 3)]
    overrides.setdefault("min_clients", min(len(sites), 2))
    if args.resume:
        expected = run_record(load_job_config(args.job, overrides=overrides), root, sites)
        verdict, lines = judge(workspace, args.job, expected, more_rounds=True)
        if verdict == "differs":
            moved = move_aside(workspace)
            print(f"--resume: the earlier run in {workspace.resolve()} is not this run ({'; '.join(lines)}); it is "
                  f"kept in {moved}, and this run starts afresh")
        else:
            for line in lines:
                print(f"--resume: {line}")
            overrides["resume"] = True
    return overrides


def _demo(args) -> int:
    from pflseg.eval.demo import ROUNDS, run_demo

    print(run_demo(args.workspace, rounds=args.rounds or ROUNDS, threads=args.threads))
    return 0


def _report(args) -> int:
    """The per-method reports and benchmarks (each prints a Markdown table)."""
    if args.report == "fedsm-benchmark":
        from pflseg.eval import fedsm_benchmark as m

        print(m.to_markdown(m.run(args.workspace or "runs/fedsm_bench", args.rounds or 20, args.seeds)))
    elif args.report == "grace-benchmark":
        from pflseg.eval import grace_benchmark as m

        print(m.to_markdown(m.run(args.sites or 6, args.repeats)))
    elif args.report == "heterogeneity":
        from pflseg.eval import heterogeneity as m

        preset = None if args.preset == "none" else args.preset
        print(m.to_markdown(m.measure(args.workspace or "runs/heterogeneity", args.rounds or 20, args.task,
                                      args.seeds[0], preset=preset, size=args.size, outside=args.outside)))
    elif args.report == "iopfl-cost":
        import json

        from pflseg.eval import iopfl_cost as m

        rows = [m.measure(s, args.experts, args.batch, args.epochs, args.repeats) for s in args.sizes]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        print(m.to_markdown(rows))
    return 0


def _site(args) -> int:
    from pflseg.flare.settings import init_site, site_report

    name = args.site_name or Path(args.site_dir).resolve().name  # a provisioned kit's folder is the site's name
    if args.site_cmd == "check":
        lines, problems = site_report(args.site_dir, name)
        print("\n".join(lines))
        return 1 if problems else 0
    policy = {key: value for key, value in (
        ("methods", _names(args.methods)), ("per_case", False if args.no_per_case else None),
        ("round_test", False if args.no_round_test else None), ("publish", False if args.no_publish else None),
        ("pooling", True if args.allow_pooling else None), ("two_sites", True if args.allow_two_sites else None))
        if value is not None}
    target, problems = init_site(args.site_dir, name, args.data, args.data_site, args.device, args.state_dir, policy)
    if problems:
        print(f"pflseg: error: site {name}: nothing written to {target}:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    print(f"wrote {target} (mode 0600); check it with `pflseg site check --site-dir {args.site_dir}`")
    return 0


def _iopfl(args) -> int:
    """IOP-FL's leave-one-site-out protocol: ``pflseg bench --methods iopfl`` with every site held out once."""
    args.methods, args.no_outside, args.holdout = ["iopfl"], False, args.holdout or ["all"]
    return _bench(args)


def _bench(args) -> int:
    from pflseg.config import parse_set
    from pflseg.deploy.simulator import workspace_lock
    from pflseg.eval.bench import Bench, to_markdown

    sites = None
    if args.data and (args.sites or args.site_names):
        from pflseg.deploy.data_sites import choose_sites

        sites = choose_sites(Path(args.data).resolve(), args.sites, _names(args.site_names))
    with workspace_lock(args.workspace):  # before Bench makes the synthetic data there
        bench = Bench(args.workspace, data=args.data, synth_sites=args.synth_sites, methods=args.methods,
                      seeds=args.seeds, rounds=args.rounds, holdout=args.holdout,
                      overrides=_data_overrides(args, parse_set(args.set)), outside=not args.no_outside,
                      threads=args.threads, sites=sites, preset=None if args.preset == "none" else args.preset)
        report = bench.execute()
    print(to_markdown(report))
    print(f"written: {bench.ws}/bench.json, bench_inside.csv, bench_outside.csv, bench.md "
          "(+ PNG plots with matplotlib)")
    return 0


def _sites_renamed(text: str) -> str:
    """argparse type of ``jobs export --sites``: refused; ``--sites`` is a number of sites in every other command."""
    raise argparse.ArgumentTypeError(f"{text!r}: jobs export names its sites with --site-names A,B,... "
                                     "(--sites is a number of sites in pflseg's other commands)")


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


def _site_args(parser, default: str) -> None:
    """--sites, --site-names and --size of the commands that run jobs on a data root."""
    parser.add_argument("--sites", type=_positive,
                        help=f"number of sites: the first N of --data's sites (default: {default})")
    parser.add_argument("--site-names", metavar="A,B,...", help="these sites of --data (dataset.json names)")
    parser.add_argument("--size", type=_positive, help="training image size data.size (default: --data's train_size "
                                                       "when recorded, else the job's)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pflseg", description="Personalized federated segmentation on NVIDIA FLARE")
    p.add_argument("--version", action="version", version=f"pflseg {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    dp = sub.add_parser("data", help="make, index and check data sets")
    dp.set_defaults(func=_data)
    d = dp.add_subparsers(dest="data_cmd", required=True)
    s = d.add_parser("synth", help="make a synthetic multi-site NIfTI data set")
    s.add_argument("--out", required=True, help="data root to write (a new or empty folder, or an earlier "
                                                 "synthetic data root: another data root is not overwritten)")
    s.add_argument("--task", choices=["prostate", "fundus"], default="prostate",
                   help="prostate: gray volumes, one class; fundus: RGB images, disc and cup (default prostate)")
    s.add_argument("--sites", type=_positive, help="sites without a preset (default 6; the last is an outside site)")
    s.add_argument("--seed", type=int, default=0, help="data seed (template jitter and every case)")
    s.add_argument("--preset", default="none", help="bench | demo (pflseg.data.synth.PRESETS): sites, knobs, cases "
                                                     "per split, size and depth; 'none' (default): the plain generator")
    s.add_argument("--outside", nargs="+", metavar="KIND",
                   help="with --preset: outside site kinds, e.g. near_copy blend extrapolate (default: the preset's)")
    s.add_argument("--near-copy-of", help="with --preset: the inside site a near_copy outside site copies")
    s.add_argument("--size", type=_positive, help="nominal in-plane size (default 64 or the preset's)")
    s.add_argument("--depth", type=_positive, help="slices per case (default 12 or the preset's)")
    i = d.add_parser("index", help="write per-site datalists for a real data layout; print what each site holds")
    i.add_argument("--layout", required=True,
                   help="saml, nvflare_prostate, prostate_slices, fundus or generic (<root>/<site>/{images,masks}/ "
                        "or <root>/<site>/{train,test}/{images,masks}/)")
    i.add_argument("--root", required=True, help="folder holding one folder per site")
    i.add_argument("--out", required=True, help="data root to write (dataset.json + <site>/datalist.json); an "
                                                 "earlier index of the same --root and --layout is rewritten, "
                                                 "another data root is not overwritten")
    i.add_argument("--seed", type=int, default=0, help="seed of the case-level train/validation(/test) split")
    i.add_argument("--mask-threshold", type=float, metavar="T",
                   help="generic: mask value > T is foreground (lossy masks, e.g. JPEG: --mask-threshold 127)")
    i.add_argument("--classes", metavar="A,B,...",
                   help="generic: class names for masks labelled 0..C (needed for masks with more than two "
                        "values; one name names the class of binary masks)")
    c = d.add_parser("check", help="report every problem of a data set")
    c.add_argument("root", help="data root (dataset.json + one folder per site)")

    jp = sub.add_parser("jobs", help="FLARE job folders")
    jp.set_defaults(func=_jobs)
    j = jp.add_subparsers(dest="jobs_cmd", required=True)
    e = j.add_parser("export", help="write jobs/<name>/ from app_configs/")
    e.add_argument("names", nargs="*", help="jobs to export (app_configs/<name>.yaml; default: every job)")
    e.add_argument("--out", default="jobs", help="folder to write the job folders into (default: jobs)")
    e.add_argument("--mode", choices=["package", "byoc"], default="package",
                   help="package: no code in the job, sites pip-install pflseg (default); byoc: pflseg in app/custom")
    e.add_argument("--gpu-mem", type=float, metavar="GIB",
                   help="require one GPU per site with this many GiB (meta.json resource_spec)")
    e.add_argument("--site-names", metavar="A,B,...",
                   help="comma-separated site names for a per-site resource_spec (with --gpu-mem)")
    e.add_argument("--sites", type=_sites_renamed, help=argparse.SUPPRESS)  # a count everywhere else
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. rounds=3")
    e.add_argument("--data", help="data root whose dataset.json sets net.in_channels, net.out_channels and "
                                  "data.size (train_size) unless --set says otherwise")
    e.add_argument("--size", type=int, help="data.size (default: --data's train_size when recorded)")

    r = sub.add_parser("run", help="run a job in the FLARE simulator")
    r.add_argument("job", help="job name (app_configs/<job>.yaml), e.g. fedavg")
    _site_args(r, "all sites of --data, else 3 synthetic sites")
    r.add_argument("--rounds", type=_positive, help="federated rounds (default: the job's rounds)")
    r.add_argument("--threads", type=_positive, help="simulator threads (default: one per site)")
    r.add_argument("--workspace", help="folder of the run: simulator workspace, state, results (default: runs/<job>)")
    r.add_argument("--data", help="data root (default: synthetic data made at each site); its sites run under "
                                  "their own names, its channels, classes and train_size set the network and data.size "
                                  "unless --set says otherwise")
    r.add_argument("--resume", action="store_true", help="continue from the last completed round")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. train.lr=0.0005")
    r.set_defaults(func=_run)

    m = sub.add_parser("demo",
                       help="the bench's synthetic sites scaled down (preset demo): FedAvg and the personalized "
                                    "methods on 3 inside sites, IOP-FL routing and FedSM at an outside site; tables "
                                    "with paired differences, sentences, pictures")
    m.add_argument("--workspace", default="demo", help="folder of the demo's data, runs and report (default: demo)")
    m.add_argument("--rounds", type=_positive, default=None,
                   help="rounds of every job (default: pflseg.eval.demo.ROUNDS)")
    m.add_argument("--threads", type=_positive, help="simulator threads per run (default: one per site)")
    m.set_defaults(func=_demo)

    def bench_args(parser, workspace: str, seeds: list[int], rounds: int, sites: int) -> None:
        parser.add_argument("--workspace", default=workspace,
                            help=f"folder of the data, runs and tables (default: {workspace})")
        parser.add_argument("--data", help="data root (default: synthetic data of --preset, made per seed in the "
                                           "workspace: its inside sites train, its outside sites are held out)")
        parser.add_argument("--preset", default="bench", help="synthetic data preset (pflseg.data.synth.PRESETS; "
                                                              "'none': the plain generator with --synth-sites sites)")
        parser.add_argument("--synth-sites", type=_positive, default=sites,
                            help="sites of --preset none (the last: outside)")
        parser.add_argument("--holdout", nargs="+",
                            help="held-out sites (default: synthetic: its outside sites; --data: every site; 'all': "
                            "each once)")
        parser.add_argument("--seeds", type=int, nargs="+", default=seeds,
                            help=f"seeds: one run of every method per seed (default: {' '.join(map(str, seeds))})")
        parser.add_argument("--rounds", type=_positive, default=rounds, help=f"rounds of every job (default: {rounds})")
        parser.add_argument("--threads", type=_positive, help="simulator threads per run (default: one per site)")
        _site_args(parser, "all sites of --data")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="config override for every job")

    bp = sub.add_parser("bench", help="every method on the same data and budget: inside and leave-one-site-out tables")
    bench_args(bp, "runs/bench", [0, 1, 2], 20, 6)
    bp.add_argument("--methods", nargs="+", metavar="METHOD",
                    help="methods to compare (default: every registered method with inside columns; "
                         "choices: the registry's, pflseg.flare.methods)")
    bp.prepare = _registry_methods
    bp.add_argument("--no-outside", action="store_true", help="inside table only")
    bp.set_defaults(func=_bench)

    ip = sub.add_parser("iopfl", help="IOP-FL protocols")
    io = ip.add_subparsers(dest="iopfl_cmd", required=True)
    lo = io.add_parser("loso", help="leave-one-site-out: train on all sites but one, route at the held-out one "
                                    "(pflseg bench --methods iopfl)")
    bench_args(lo, "runs/iopfl_loso", [0, 1], 10, 5)
    lo.set_defaults(func=_iopfl)

    rp = sub.add_parser("report",
                        help="cost benchmarks and data heterogeneity (Markdown tables); the protocols are `pflseg "
                        "bench`")
    rp.add_argument("report", choices=["fedsm-benchmark", "grace-benchmark", "heterogeneity", "iopfl-cost"],
                    help="which report: fedsm-benchmark, grace-benchmark, heterogeneity or iopfl-cost")
    rp.add_argument("--workspace", help="default runs/<report>")
    rp.add_argument("--rounds", type=_positive, help="default: fedsm-benchmark 20, heterogeneity 20")
    rp.add_argument("--sites", type=_positive, help="grace-benchmark sites (default 6)")
    rp.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (fedsm-benchmark; heterogeneity: the "
                                                                          "first is the data seed) (default: 0 1)")
    rp.add_argument("--task", choices=["prostate", "fundus"], default="prostate",
                    help="heterogeneity: synthetic task (default prostate)")
    rp.add_argument("--repeats", type=_positive, default=5, help="timing repeats (grace-benchmark, iopfl-cost)")
    rp.add_argument("--sizes", type=_positive, nargs="+", default=[64, 256], help="iopfl-cost image sizes")
    rp.add_argument("--experts", type=_positive, default=5, help="iopfl-cost: K + 1")
    rp.add_argument("--batch", type=_positive, default=8, help="iopfl-cost batch")
    rp.add_argument("--epochs", type=_positive, default=10, help="iopfl-cost test-time epochs")
    rp.add_argument("--json", help="iopfl-cost: also write the rows as JSON here")
    rp.add_argument("--preset", default="bench",
                    help="heterogeneity: synthetic data preset (bench | demo; 'none': the plain 6-site generator); "
                         "the data seed is the first --seeds")
    rp.add_argument("--outside", nargs="+", metavar="KIND", help="heterogeneity: outside site kinds of the preset "
                                                                 "(near_copy blend extrapolate; default: the preset's)")
    rp.add_argument("--size", type=_positive, help="heterogeneity: data and training size (default: the preset's)")
    rp.set_defaults(func=_report)

    dep = sub.add_parser("deploy", help="a provisioned federation on this machine (loopback)")
    dep.set_defaults(func=_deploy)
    dsub = dep.add_subparsers(dest="deploy_cmd", required=True)
    dl = dsub.add_parser("local", help="provision provisioning/project.yml on loopback, start server + sites, wait")
    dl.add_argument("--project", help="project.yml (default: provisioning/project.yml)")
    dl.add_argument("--data", help="data root every site uses (default: synthetic data made at each site); its "
                                   "sites replace project.yml's sites")
    dl.add_argument("--sites", type=_positive, help="the first N sites of --data (default: all)")
    dl.add_argument("--site-names", metavar="A,B,...", help="these sites of --data")
    dl.add_argument("--device", default="auto", help="every site's device: auto (CUDA when present), cpu or cuda "
                                                     "(default auto)")
    dl.add_argument("--timeout", type=_seconds, default=180.0,
                    help="seconds to wait for the server and every site to connect (default 180)")
    for name, text in (("status", "connected sites and resident memory"), ("stop", "shut down through the FLARE API")):
        dsub.add_parser(name, help=text)
    for parser in dsub.choices.values():
        parser.add_argument("--workspace", default="runs/federation",
                            help="folder of the provisioned kits and their processes (default: runs/federation)")

    sb = sub.add_parser("submit",
                        help="submit a job folder through the FLARE API, wait, download, print per-site metrics")
    sb.add_argument("job", help="job folder (e.g. jobs/fedavg)")
    sb.add_argument("--kit", required=True, help="the admin's startup kit folder")
    sb.add_argument("--user", help="admin user name (default: the kit folder's name)")
    sb.add_argument("--timeout", type=_seconds, default=3600.0,
                    help="seconds to wait for the job to finish (default 3600)")
    sb.add_argument("--out", help="where to put the downloaded job (default: the kit's transfer folder)")
    sb.set_defaults(func=_submit)

    pc = sub.add_parser("poc",
                        help="FLARE POC on loopback: prepare, start, submit one job, print per-site metrics, stop")
    pc.add_argument("--job", default="fedavg", help="job name (app_configs/<job>.yaml; default fedavg)")
    _site_args(pc, "all sites of --data, else 2")
    pc.add_argument("--rounds", type=_positive, default=2, help="federated rounds (default 2)")
    pc.add_argument("--data", help="data root (default: synthetic data made at each site); its sites are the POC sites")
    pc.add_argument("--workspace", default="runs/poc",
                    help="folder of the POC kits, jobs and results (default: runs/poc)")
    pc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    pc.set_defaults(func=_poc)

    sp = sub.add_parser("site", help="site-local configuration")
    sp.set_defaults(func=_site)
    si = sp.add_subparsers(dest="site_cmd", required=True)
    init = si.add_parser("init", help="check, then write <site-dir>/local/pflseg_site.json (data location, device, "
                                      "state folder, the site's policy)")
    init.add_argument("--data", required=True, help="the site's data root (made by `pflseg data index|synth`)")
    init.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (checked on this machine)")
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
    check = si.add_parser("check", help="print the site's settings and policy, and whether its data validates "
                                        "(exit 1 when not)")
    for parser in (init, check):
        parser.add_argument("--site-dir", default=".", help="the site's startup kit folder (default: here)")
        parser.add_argument("--site-name", help="the FLARE site name (default: the --site-dir folder's name)")
    return p


#: what to do after Ctrl-C / SIGTERM stopped a command's run, per command
_AFTER_STOP = {"run": "continue with --resume",
               "bench": "run the same command again to continue (finished runs are read back, this one resumes)",
               "iopfl": "run the same command again to continue (finished runs are read back, this one resumes)"}


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
    except KeyboardInterrupt:
        print("pflseg: stopped (SIGINT)", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
