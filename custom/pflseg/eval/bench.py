"""`pflseg bench`: every method on the same data, backbone and budget; the papers' two protocols.

Inside table: the federation of the inside sites trains each selected method (one FLARE simulator job
per method and seed); per site, the test Dice of each method's model for that site (global and
personalized side by side), mean +- std over seeds. Outside table (leave-one-site-out): for each
held-out site h, FedAvg, FedSM, GRACE and IOP-FL train on the other sites, then at h: FedAvg's and
GRACE's global models, the FedSM super model (``fedsm_infer``, gamma chosen on the inside sites'
validation splits) and IOP-FL test-time routing with its comparators Average, Ensemble, Tent and the
routing variants (``iopfl_route``). Every image of h is used (unlabelled where routing adapts; labels only
score). Under the outside claims, the routing job's diagnostics at each judged outside site, per seed and routing
variant (``routing_rows``, scoring only: nothing is chosen from them): what its unsupervised loss, its Dice against
its start (Average, test-batch statistics), its routers and its predicted foreground did, and the best and worst
expert there.

With one held-out site (the default on synthetic data: its last site, built unlike each single site and
like their mix) the inside federation is the other sites and the same runs serve both tables.

Each run's folder also gets what ``pflseg run`` writes (``<run dir>/results/``: its test table and, for a
post-training job, its own table, e.g. the routing job's diagnostics). A finished (seed, fold, job) run is never run
again when its settings are the same: its ``results.json`` is read back; a run that was stopped resumes from its last
round. "The same" is the run's record
(``<run dir>/run.json``: its effective config, data, sites and, for a post-training job, the record of the run
whose bundle it reads; ``pflseg.deploy.workspace.run_record``): an earlier run with another record is moved
aside to ``<run dir>.<timestamp>`` with a line naming the keys that differ, and the job runs afresh.

Writes ``bench.json``, ``bench_inside.csv``, ``bench_outside.csv``, ``bench.md`` and, with matplotlib,
``bench_inside.png`` (per-site bars, error bars over seeds) and ``bench_curves.png`` (mean validation Dice
per round, per method).
"""

from __future__ import annotations

import csv
import json
import secrets
import shutil
import statistics
import threading
from collections.abc import Callable
from pathlib import Path

from scipy.stats import spearmanr, t
from torch.utils.data import ConcatDataset

from pflseg.config import load_job_config
from pflseg.data import DataError, load_dataset_info, make_synthetic, site_dataset
from pflseg.deploy.data_sites import flare_names, site_view
from pflseg.deploy.simulator import run_side_by_side, run_simulator
from pflseg.deploy.workspace import judge, move_aside, read_record, run_record, server_state, workspace_lock
from pflseg.eval.plots import reported_val_dice, write_results
from pflseg.eval.progress import RunProgress
from pflseg.flare.columns import Column, site_test
from pflseg.flare.jobs import export_job
from pflseg.flare.methods import BACKBONES, METHODS, OUTSIDE_REFERENCE, REFERENCE, TREATMENTS
from pflseg.flare.privacy import SALT_FILE
from pflseg.flare.state import RoundStore, private_dir, unprefixed
from pflseg.flare.wire import BEST, GLOBAL
from pflseg.markdown import diff_cell, markdown_table
from pflseg.markdown import number_cell as _num
from pflseg.nets import build_net
from pflseg.train import evaluate


def inside_columns() -> dict[str, tuple[Column, ...]]:
    """Bench method -> the inside table's ``Column``s (group: the backbone), from the registry
    (``pflseg.flare.methods.Method.inside``). Every label is compared with the FedAvg of its own backbone
    (REFERENCE)."""
    return {name: cols for entry in METHODS.values() for name, cols in entry.inside.items()}


def outside_columns() -> dict[str, tuple[Column, ...]]:
    """Bench method -> the outside table's ``Column``s (group: the normalisation treatment), from the registry
    (``Method.outside``). A column without a reader is the job's best global model scored by the bench at the
    held-out site (running statistics). A comparison is only ever made within one treatment."""
    return {name: cols for entry in METHODS.values() for name, cols in entry.outside.items()}


def default_methods() -> tuple[str, ...]:
    """The bench's default methods: every registered method that has inside columns under its own name."""
    return tuple(name for name, entry in METHODS.items() if name in entry.inside)


def pools(job: str) -> bool:
    """Whether ``job``'s training runs in one site process on every site's data (its site class pools the other
    sites', as Centralized's): the longest chain of work in a bench, as no other process of its run can share it, so
    the bench starts such runs first (the others then fill the second core beside it instead of leaving it idle at
    the end)."""
    return METHODS[load_job_config(job)["method"]].site.pools()


def diagnostic_jobs() -> dict[str, Callable]:
    """Post-training job -> its diagnostics at an outside site (``Method.diagnostics``), from the registry."""
    return {name: entry.diagnostics for name, entry in METHODS.items() if entry.diagnostics}


def after_jobs() -> dict[str, tuple]:
    """Post-training job -> (the training job whose models it uses, the config section that takes its bundle, more
    keys of that section), from the registry (``Method.after``)."""
    return {name: entry.after for name, entry in METHODS.items() if entry.after}


#: the outside claims of every method, declared before any run (``pflseg.flare.methods.Claim``)
CLAIMS = [(entry.label, claim) for entry in METHODS.values() for claim in entry.claims]


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def _interval(diffs: list[float]) -> tuple[float, float, float]:
    mean, half = statistics.mean(diffs), t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return mean, mean - half, mean + half


def paired_difference(values: dict[str, list[float]], reference: dict[str, list[float]]) -> dict | None:
    """Mean paired difference ``values - reference`` over every (site, seed) both have, with its 95 % t-interval,
    and, with 2 seeds or more, the interval that respects the nesting.

    Args:
        values, reference: site -> one Dice per seed, in seed order (a site lacking some seed is left out whole).

    Returns:
        {"mean", "lo", "hi", "n" (pairs), "verdict": "better" | "worse" | "tie"}, or None with fewer than 2 pairs.
        The pairs are seeds x sites; the sites of one seed share one trained model, so they are not independent.
        With >= 2 seeds ``"seeds": {"mean", "lo", "hi", "n"}`` is the t-interval over the seeds of each seed's
        mean difference over the sites (n = seeds), and the verdict follows it; with one seed the verdict follows
        the pairs' interval (a guide only). A verdict other than "tie" only when its interval excludes 0.
    """
    pairs = {site: [v - r for v, r in zip(vs, reference[site])] for site, vs in values.items()
             if site in reference and len(vs) == len(reference[site])}
    diffs = [d for ds in pairs.values() for d in ds]
    if len(diffs) < 2:
        return None
    mean, lo, hi = _interval(diffs)
    out = {"mean": mean, "lo": lo, "hi": hi, "n": len(diffs)}
    per_seed = [statistics.mean(seed) for seed in zip(*pairs.values())]
    if len(per_seed) >= 2:
        m, slo, shi = _interval(per_seed)
        out["seeds"] = {"mean": m, "lo": slo, "hi": shi, "n": len(per_seed)}
        lo, hi = slo, shi
    out["verdict"] = "better" if lo > 0 else "worse" if hi < 0 else "tie"
    return out


def routing_summary(rows: list[dict]) -> dict:
    """Over the rows: Spearman's rank correlation of loss change and Dice change (over the rows with both; None
    with fewer than 3 or a constant column) and how many rows saw the loss fall, the Dice rise, and both."""
    pairs = [(r["loss_change"], r["dice_change"]) for r in rows
             if r["loss_change"] is not None and r["dice_change"] is not None]
    losses, dices = [p[0] for p in pairs], [p[1] for p in pairs]
    rho = None
    if len(pairs) >= 3 and len(set(losses)) > 1 and len(set(dices)) > 1:
        rho = float(spearmanr(losses, dices)[0])
    fell = [r["loss_change"] is not None and r["loss_change"] < 0 for r in rows]
    rose = [r["dice_change"] is not None and r["dice_change"] > 0 for r in rows]
    return {"rows": len(rows), "pairs": len(pairs), "spearman": rho, "loss_fell": sum(fell), "dice_rose": sum(rose),
            "both": sum(f and r for f, r in zip(fell, rose))}


#: one bench's runs side by side share its salts (``Bench.share_salt``)
_SALT_LOCK = threading.Lock()


def choose_by_loso(per_site: dict[str, dict[str, float]], h: str, inside: list[str]) -> str | None:
    """The option with the best mean Dice over the held-out INSIDE sites other than ``h`` (leave-one-inside-site-out:
    each such site looks to its fold's models as an unseen site does); ties keep the earlier option; None without
    such a site.

    Args:
        per_site: held-out site -> option -> Dice (one seed).
        h: the site the choice is for (its own values are never read).
        inside: the inside sites (a held-out site among them was scored by the federation trained without it).
    """
    others = [g for g in per_site if g != h and g in inside]
    if not others:
        return None
    order = list(per_site[others[0]])
    means = {o: statistics.mean(per_site[g][o] for g in others) for o in order}
    return max(order, key=lambda o: (means[o], -order.index(o)))


def _seed_means(col: dict[str, list[float]]) -> dict | None:
    """Mean over the sites of each seed's run, then mean and std of those over seeds (the spread of a
    method's site mean from seed to seed, not the sites' spread). None (a "-" in the tables) when some
    site lacks a seed's value: a site mean over fewer sites is not comparable."""
    if len({len(values) for values in col.values()}) != 1:
        return None
    return _stats([statistics.mean(values) for values in zip(*col.values())])


class Bench:
    """The runs, resumable, and the tables. ``methods``: keys of ``inside_columns()`` (default:
    ``default_methods()``); the outside table has the columns of the selected methods found in ``outside_columns()``.

    Without ``data`` each seed makes its own synthetic data root ``<workspace>/data/seed<s>`` from ``preset``
    (``pflseg.data.synth.PRESETS``; the data seed is the run's seed): its inside sites train, its outside sites
    are held out. With ``data`` every seed uses that root (only training varies).

    ``per_job``: more overrides of one job (``{"lcfed": {"net": {...}}}``). ``salts``: every run of a site uses one
    pseudonym salt (``<workspace>/salts/<site>``), as a deployed site keeps one state folder for all its jobs, so
    that per-case Dice (``privacy.per_case``) can be paired across runs.
    """

    def __init__(self, workspace, data=None, synth_sites: int = 6, methods=None, seeds=(0,), rounds: int = 20,
                 holdout: list[str] | None = None, overrides: dict | None = None, outside: bool = True,
                 threads: int | None = None, progress=print, sites: list[str] | None = None,
                 preset: str | None = "bench", per_job: dict | None = None, salts: bool = False, jobs: int = 1):
        self.inside_cols, self.outside_cols, self.after = inside_columns(), outside_columns(), after_jobs()
        methods = default_methods() if methods is None else methods
        unknown = [m for m in methods if m not in self.inside_cols]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(self.inside_cols)}")
        self.ws = Path(workspace).resolve()
        self.methods, self.seeds, self.rounds = list(methods), list(seeds), rounds
        self.data, self.preset, self.synth_sites = (Path(data).resolve() if data else None), preset, synth_sites
        info = load_dataset_info(self.root(self.seeds[0]))
        self.sites = list(sites) if sites else info["sites"]
        kinds = {s: p.get("kind", "inside") for s, p in (info.get("site_profiles") or {}).items()}
        outside_sites = [s for s in self.sites if kinds.get(s) == "outside"]
        outside_sites = outside_sites or ([self.sites[-1]] if data is None else [])
        if holdout == ["all"]:
            holdout = list(self.sites)
        self.holdout = list(holdout) if holdout else (outside_sites if data is None else list(self.sites))
        bad = [h for h in self.holdout if h not in self.sites]
        if len(self.holdout) == 1 or (not holdout and data is None):
            self.inside = [s for s in self.sites if s not in self.holdout]
        else:
            self.inside = list(self.sites)
        if bad or len(self.inside) - any(h in self.inside for h in self.holdout) < 2:
            raise ValueError(f"--holdout {self.holdout}: need sites of the data ({self.sites}) and 2 sites left to "
                             "train")
        self.outside = outside and any(m in self.outside_cols for m in self.methods)
        self.overrides, self.threads, self.progress = dict(overrides or {}), threads, progress
        self.per_job, self.salts = dict(per_job or {}), salts
        if data is None and preset and "size" not in self.overrides.get("data", {}):
            self.overrides.setdefault("data", {})["size"] = info.get("train_size") or 64
        self.timings: list[dict] = []
        self.jobs = jobs
        self.choices: dict = {}

    def root(self, seed: int) -> Path:
        """The data root of ``seed``'s runs (made once, on first use, for synthetic data)."""
        if self.data is not None:
            return self.data
        root = self.ws / "data" / f"seed{seed}"
        if not (root / "dataset.json").is_file():
            if self.preset:
                make_synthetic(root, preset=self.preset, seed=seed)
            else:
                make_synthetic(root, n_sites=self.synth_sites, seed=seed)
        return root

    # ---- runs -----------------------------------------------------------------------------------
    def fold(self, h: str | None) -> str:
        """Folder of the federation that leaves ``h`` out (None: the inside federation, which serves every held-out
        site it did not train on)."""
        return "inside" if h is None or h not in self.inside else f"without-{h}"

    def trained_on(self, fold: str) -> list[str]:
        return self.inside if fold == "inside" else [s for s in self.inside if s != fold[len("without-"):]]

    def plan(self) -> list[tuple[int, str, str]]:
        """Every (seed, fold, job), each once, training jobs before the post-training jobs that read them."""
        wanted = [(None, col.job) for m in self.methods for col in self.inside_cols[m]]
        if self.outside:
            wanted += [(h, col.job) for h in self.holdout for m in self.methods for col in self.outside_cols.get(m, ())]
        keys: list[tuple[str, str]] = []
        for h, job in wanted:
            for j in ([self.after[job][0], job] if job in self.after else [job]):
                if (self.fold(h), j) not in keys:
                    keys.append((self.fold(h), j))
        self.read_from = {(fold, job): other for fold, job in keys
                          if (other := self.stand_in(fold, job, [j for f, j in keys if f == fold]))}
        return [(seed, fold, job) for seed in self.seeds for fold, job in keys if (fold, job) not in self.read_from]

    def stand_in(self, fold: str, job: str, jobs: list[str]) -> str | None:
        """A job of ``jobs`` (the same fold's) whose run yields ``job``'s whole run bit for bit (its method's
        ``global_as`` is ``job`` and every setting outside the method's own sections is the same), or None."""
        mine = load_job_config(job, overrides=self.job_overrides(self.seeds[0], fold, job))
        for other in jobs:
            cfg = load_job_config(other, overrides=self.job_overrides(self.seeds[0], fold, other))
            entry = METHODS.get(cfg["method"])
            if other != job and entry is not None and entry.global_as == job:
                drop = {"name", "method", *entry.sections}
                if {k: v for k, v in cfg.items() if k not in drop} == {k: v for k, v in mine.items() if k not in drop}:
                    return other
        return None

    def source(self, fold: str, job: str) -> str:
        """The job whose run holds ``job``'s results in ``fold`` (``job`` itself unless ``stand_in`` found one)."""
        if not hasattr(self, "read_from"):
            self.plan()
        return self.read_from.get((fold, job), job)

    def run_dir(self, seed: int, fold: str, job: str) -> Path:
        return self.ws / "runs" / f"seed{seed}" / fold / job

    def clients(self, fold: str, job: str) -> list[str]:
        trained = self.trained_on(fold)
        if job in self.after:  # post-training jobs also reach the sites outside this federation
            return trained + [s for s in self.holdout if s not in trained]
        return trained

    def results(self, seed: int, fold: str, job: str) -> dict:
        job = self.source(fold, job)
        return json.loads((server_state(self.run_dir(seed, fold, job), job) / "results.json").read_text())

    def finished(self, seed: int, fold: str, job: str) -> bool:
        """Whether the run finished earlier with exactly this bench's settings (it is then read back)."""
        return judge(self.run_dir(seed, fold, job), job, self.expected(seed, fold, job))[0] == "finished"

    def job_overrides(self, seed: int, fold: str, job: str) -> dict:
        """The job's config overrides in this bench (``resume`` aside: it only says how a run starts)."""
        over = {**self.overrides, **self.per_job.get(job, {}), "seed": seed, "rounds": self.rounds,
                "min_clients": len(self.clients(fold, job))}
        if job in self.after:
            trained, key, more = self.after[job]
            bundle = str(server_state(self.run_dir(seed, fold, trained), trained))
            over[key] = {**over.get(key, {}), "bundle": bundle, **more}
        return over

    def expected(self, seed: int, fold: str, job: str) -> dict:
        """The record (``run_record``) an earlier (seed, fold, job) run must have to be read back or resumed: the
        job's effective config, the seed's data root and the run's sites; a post-training job also the record of
        the run whose bundle it reads (a training run made again makes its post-training jobs run again)."""
        inputs = {}
        if job in self.after:
            trained = read_record(self.run_dir(seed, fold, self.after[job][0]), self.after[job][0]) or {}
            inputs["bundle_run"] = trained.get("sha256")
        cfg = load_job_config(job, overrides=self.job_overrides(seed, fold, job))
        return run_record(cfg, self.root(seed), flare_names(self.clients(fold, job)), inputs)

    def names(self, seed: int, fold: str, job: str) -> dict[str, str]:
        """FLARE site name -> the data root's site name, for one run."""
        return json.loads((self.run_dir(seed, fold, self.source(fold, job)) / "sites.json").read_text())

    def run(self, seed: int, fold: str, job: str) -> dict:
        """One FLARE simulator job: read back when it finished earlier with the same record, resumed when it
        stopped mid-way with it; an earlier run with another record is moved aside (``<run dir>.<timestamp>``,
        with a line naming what differs) and the job runs afresh."""
        ws = self.run_dir(seed, fold, job)
        with workspace_lock(ws):
            expected = self.expected(seed, fold, job)
            verdict, lines = judge(ws, job, expected)
            if verdict == "finished":
                if lines:
                    self.progress(f"[seed {seed}, {fold}: {job}] {'; '.join(lines)}")
                return self.results(seed, fold, job)
            over = self.job_overrides(seed, fold, job)
            if verdict == "differs":
                moved = move_aside(ws)
                self.progress(f"[seed {seed}, {fold}: {job}] not the earlier run ({'; '.join(lines)}): that one is "
                              f"kept in {moved}; running it again")
            elif verdict == "stopped":
                over["resume"] = True
            clients = self.clients(fold, job)
            data, mapping = site_view(self.root(seed), clients, ws / "data")
            (ws / "sites.json").write_text(json.dumps(mapping, indent=1))
            if self.salts:
                for name, site in mapping.items():
                    self.share_salt(site, ws / "state" / name)
            job_dir = export_job(job, ws / "job", overrides=over)
            return run_simulator(job_dir, ws, n_sites=len(clients), threads=self.threads, data=data,
                                 progress=lambda m: None, clients=list(mapping), inputs=expected["inputs"])

    def share_salt(self, site: str, state_root: Path) -> None:
        """Put the site's one salt (made once, ``<workspace>/salts/<site>``) in a run's site state folder."""
        salt = self.ws / "salts" / site
        with _SALT_LOCK:  # runs side by side: one salt per site
            if not salt.is_file():
                private_dir(salt.parent)
                salt.write_text(secrets.token_hex(32))
                salt.chmod(0o600)
        private_dir(state_root)
        target = state_root / SALT_FILE
        if not target.is_file():
            shutil.copy2(salt, target)

    def execute(self) -> dict:
        """Every run of the plan, ``self.jobs`` side by side (a post-training job once the run it reads has finished;
        one bench at a time in a workspace: ``<workspace>/.lock``), then the tables. Runs are independent processes
        with their own seeds, so side by side or one by one gives the same results."""
        with workspace_lock(self.ws):
            plan = self.plan()
            for job, other in sorted({(j, o) for (_, j), o in self.read_from.items()}):
                self.progress(f"{job}: read from the {other} runs (the same global model, curves and test scores, bit "
                              f"for bit: {other}'s sites train it as {job}'s do); not run")
            for seed in self.seeds:
                self.root(seed)  # synthetic data made once, before runs start side by side
            steps = RunProgress(len(plan), self.progress)
            timings = {}

            def one(seed: int, fold: str, job: str):
                done_before = self.finished(seed, fold, job)
                t0 = steps.start(f"seed {seed}, {fold}: {job}")
                res = self.run(seed, fold, job)
                write_results(res, self.run_dir(seed, fold, job))  # what pflseg run shows: <run dir>/results/
                took = steps.done(timed=not done_before, t0=t0)
                seconds = res.get("footprint", {}).get("wall_seconds", took)
                timings[seed, fold, job] = {"seed": seed, "fold": fold, "job": job, "seconds": seconds}
                how = f"finished earlier ({seconds:.0f} s), read back" if done_before else f"{seconds:.0f} s"
                self.progress(f"[{steps.finished}/{len(plan)}] {job}: {how}; {len(plan) - steps.finished} left")

            # training runs first, those whose one site trains on every site's data ahead of the others, then the
            # post-training runs: queued after every training run, a post-training run that waits for the run it
            # reads never keeps a training run from starting
            training = sorted((k for k in plan if k[2] not in self.after), key=lambda k: not pools(k[2]))
            order = training + [k for k in plan if k[2] in self.after]
            run_side_by_side({k: (lambda k=k: one(*k)) for k in order},  # type: ignore[misc]
                             after={k: (k[0], k[1], self.after[k[2]][0]) for k in order if k[2] in self.after},
                             workers=self.jobs)
            self.timings += [timings[k] for k in plan]
            return self.tables()

    # ---- tables ---------------------------------------------------------------------------------
    def inside_values(self) -> dict:
        """label -> site -> test Dice per seed (in seed order)."""
        table: dict = {}
        for m in self.methods:
            for column in self.inside_cols[m]:
                col = table.setdefault(column.label, {})
                for seed in self.seeds:
                    res, names = self.results(seed, "inside", column.job), self.names(seed, "inside", column.job)
                    for sim_site, site in names.items():  # the run's sites, in order
                        if site in self.inside:
                            col.setdefault(site, []).append(site_test(column, res, sim_site).dice)
        return table

    def inside_cases(self) -> dict:
        """site -> {"cases", "images"} of its test split (the same for every method: read from the first run)."""
        for m in self.methods:
            for col in self.inside_cols[m]:
                if col.read is None:
                    res = self.results(self.seeds[0], "inside", col.job)
                    names = self.names(self.seeds[0], "inside", col.job)
                    return {names[s]: {"cases": sc.cases, "images": sc.images} for s in res["test"]
                            if names[s] in self.inside and (sc := site_test(col, res, s))}
        return {}

    def outside_values(self) -> tuple[dict, dict]:
        """("label [treatment]" -> held-out site -> Dice per seed (in seed order), site -> {"cases", "images"}).

        A column whose reader gives options (e.g. FedSM's super model at each gamma) takes, at each held-out site h
        and seed, the option with the best mean Dice at the OTHER held-out inside sites of that seed (each scored
        by the federation trained without it: leave-one-inside-site-out), never h's own labels; without another
        held-out inside site (``--holdout all`` gives them) the column has no value at h. The choices are in
        ``self.choices``: "label [treatment]" -> h -> option per seed."""
        table: dict = {}
        cases: dict = {}
        options: dict = {}
        for h in self.holdout:
            fold = self.fold(h)
            for m in self.methods:
                for col in self.outside_cols.get(m, ()):
                    key = f"{col.label} [{col.group}]"
                    for seed in self.seeds:
                        dice, n = self.outside_dice(seed, fold, col, h)
                        if isinstance(dice, dict):
                            options.setdefault(key, {}).setdefault(seed, {})[h] = dice
                            table.setdefault(key, {})  # its place among the columns; filled below
                            continue
                        table.setdefault(key, {}).setdefault(h, []).append(dice)
                        if n:
                            cases[h] = n
        for key, per_seed in options.items():
            for h in self.holdout:
                chosen = [choose_by_loso(per_seed[seed], h, self.inside) for seed in self.seeds]
                if None not in chosen:
                    self.choices.setdefault(key, {})[h] = chosen
                    table[key][h] = [per_seed[seed][h][c] for seed, c in zip(self.seeds, chosen)]
        return {key: col for key, col in table.items() if col}, cases

    def outside_dice(self, seed: int, fold: str, col: Column, h: str) -> tuple[float | dict, dict | None]:
        """(Dice of one outside column at ``h`` (or {option: Dice}), its {"cases", "images"} when known)."""
        if col.read is None:
            score = self.global_dice_at(seed, fold, col.job, h)
            return score["dice"], {"cases": score["n_cases"], "images": score["n_images"]}
        res, names = self.results(seed, fold, col.job), self.names(seed, fold, col.job)
        sim_h = next(s for s, original in names.items() if original == h)
        out = col.read(res, sim_h)
        if isinstance(out, dict):
            return {option: sc.dice for option, sc in out.items()}, None
        return out.dice, ({"cases": out.cases, "images": out.images} if out.cases is not None else None)

    def global_dice_at(self, seed: int, fold: str, job: str, h: str) -> dict:
        """Scores of ``job``'s final best global model on every labelled image of the held-out site ``h``."""
        res, job = self.results(seed, fold, job), self.source(fold, job)
        ckpt = RoundStore(server_state(self.run_dir(seed, fold, job), job)).final()
        net = build_net(res["config"]["net"])
        net.load_state_dict({**net.state_dict(), **(unprefixed(BEST, ckpt) or unprefixed(GLOBAL, ckpt))})
        parts = []
        for split in ("training", "validation", "testing"):
            try:
                parts.append(site_dataset(self.root(seed), h, split, size=res["config"]["data"]["size"]))
            except DataError:
                continue
        return evaluate(net, ConcatDataset(parts), "cpu", res["config"]["train"]["eval_batch_size"])

    def routing_rows(self) -> list[dict]:
        """The diagnostics (``Method.diagnostics``) of every finished post-training run that declares them (IOP-FL's
        routing) at each judged outside site, ``{"seed", "site", ...}`` per seed in seed order, then held-out site; []
        when no selected method's outside columns come from such a job. Scoring only: the judged site's labels score
        these numbers, nothing is chosen from them."""
        jobs = {col.job for m in self.methods for col in self.outside_cols.get(m, ())}
        rows: list[dict] = []
        for job, diagnose in diagnostic_jobs().items():
            if not self.outside or job not in jobs:
                continue
            for seed in self.seeds:
                for h in self.holdout:
                    fold = self.fold(h)
                    if self.finished(seed, fold, job):
                        sim_h = next((s for s, site in self.names(seed, fold, job).items() if site == h), None)
                        rows += [{"seed": seed, "site": h, **r} for r in diagnose(self.results(seed, fold, job), sim_h)]
        return rows

    def curves(self) -> dict:
        """Mean validation Dice per round (over sites, then seeds) of the model each inside column reports: the
        site's personalized model (``val_dice_person`` where a method tracks one beside the global model) for
        personalized columns, the global model's otherwise."""
        out = {}
        for m in self.methods:
            for col in self.inside_cols[m]:
                if col.job in self.after or col.key == "global_adabn":
                    continue
                per_seed = [self.curve(seed, col.job, col.key) for seed in self.seeds]
                n = min(len(c) for c in per_seed)
                out[col.label] = [statistics.mean(c[i] for c in per_seed) for i in range(n)]
        return out

    def curve(self, seed: int, job: str, key: str) -> list[float]:
        """Mean validation Dice per round (over the sites) of one inside run's reported model: the site's
        personalized model for ``key`` "site" (``pflseg.eval.plots.reported_val_dice``), else the global."""
        curve = []
        for h in self.results(seed, "inside", job)["history"]:
            values = reported_val_dice(h, key)
            if values:
                curve.append(statistics.mean(values.values()))
        return curve

    def steps(self) -> dict:
        """job -> site -> optimizer steps per round at that site (mean over rounds, seed 0's run)."""
        out: dict = {}
        for m in self.methods:
            for job in (col.job for col in self.inside_cols[m]):
                if job in self.after or job in out:
                    continue
                names = self.names(self.seeds[0], "inside", job)
                per_site: dict = {}
                for h in self.results(self.seeds[0], "inside", job)["history"]:
                    for s, v in (h.get("site_metrics") or {}).items():
                        if isinstance(v, dict) and isinstance(v.get("steps"), (int, float)):
                            per_site.setdefault(names.get(s, s), []).append(v["steps"])
                if per_site:
                    out[job] = {s: statistics.mean(v) for s, v in per_site.items()}
        return out

    def tables(self) -> dict:
        report = {"data": str(self.data or self.ws / "data"), "preset": None if self.data else self.preset,
                  "inside_sites": self.inside, "holdout": self.holdout, "seeds": self.seeds, "rounds": self.rounds,
                  "overrides": self.overrides, "backbones": BACKBONES, "treatments": TREATMENTS,
                  "claims": [{"method": label, "label": c.label, "against": list(c.against), "treatment": c.treatment}
                             for label, c in CLAIMS]}
        inside = self.inside_values()
        backbone = {col.label: col.group for m in self.methods for col in self.inside_cols[m]}
        report["inside"] = {label: {site: _stats(v) for site, v in col.items()} for label, col in inside.items()}
        report["inside_mean"] = {label: m for label, col in inside.items() if col and (m := _seed_means(col))}
        report["inside_backbone"] = backbone
        report["inside_cases"] = self.inside_cases()
        report["inside_vs_fedavg"] = {label: d for label, col in inside.items() if label != REFERENCE[backbone[label]]
                                      and REFERENCE[backbone[label]] in inside
                                      and (d := paired_difference(col, inside[REFERENCE[backbone[label]]]))}
        outside, cases = self.outside_values() if self.outside else ({}, {})
        report["outside"] = {label: {site: _stats(v) for site, v in col.items()} for label, col in outside.items()}
        report["outside_mean"] = {label: m for label, col in outside.items() if col and (m := _seed_means(col))}
        report["outside_cases"] = cases
        report["outside_choices"] = self.choices
        report["outside_vs_fedavg"] = {}
        for key, col in outside.items():
            treatment = key.rsplit(" [", 1)[1].rstrip("]")
            ref = next((f"{r} [{treatment}]" for r in OUTSIDE_REFERENCE if f"{r} [{treatment}]" in outside), None)
            if ref and ref != key and (d := paired_difference(col, outside[ref])):
                report["outside_vs_fedavg"][key] = {**d, "reference": ref}
        for claim in report["claims"]:
            mine = outside.get(f"{claim['label']} [{claim['treatment']}]")
            if mine:
                claim["differences"] = {a: paired_difference(mine, outside[f"{a} [{claim['treatment']}]"])
                                        for a in claim["against"] if f"{a} [{claim['treatment']}]" in outside}
        if rows := self.routing_rows():
            report["routing_diagnostics"] = {"rows": rows, "summary": routing_summary(rows)}
        report |= {"curves": self.curves(), "steps_per_round": self.steps(), "timings": self.timings}
        self.write(report)
        return report

    def write(self, report: dict) -> None:
        (self.ws / "bench.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        for name in ("inside", "outside"):
            with open(self.ws / f"bench_{name}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["site", "method", "dice_mean", "dice_std", "n_seeds", "diff_vs_fedavg", "ci95_lo",
                            "ci95_hi",
                            "n_pairs"])
                for label, col in report[name].items():
                    d = report[f"{name}_vs_fedavg"].get(label)
                    for site, st in [*col.items(), ("mean", report[f"{name}_mean"].get(label))]:
                        if st:
                            diff = [f"{d[k]:.4f}"
                                    for k in ("mean", "lo", "hi")] + [d["n"]] if d and site == "mean" else [""] * 4
                            w.writerow([site, label, f"{st['mean']:.4f}", _csv_std(st), st["n"], *diff])
        (self.ws / "bench.md").write_text(to_markdown(report) + "\n")
        try:
            plot(report, self.ws)
        except ImportError:
            self.progress("matplotlib is not installed: no PNG plots (pip install 'pflseg[plots]')")


def _csv_std(st: dict) -> str:
    """The CSV's std over seeds; empty with one seed (a std of one value is no spread, not 0.0000)."""
    return f"{st['std']:.4f}" if st["n"] > 1 else ""


def _cell(st: dict | None) -> str:
    """mean ± std over seeds; the mean alone with one seed (a std of one value is no spread)."""
    if not st:
        return "-"
    return f"{st['mean']:.3f} ± {st['std']:.3f}" if st["n"] > 1 else f"{st['mean']:.3f}"


def _counts(cases: dict, site: str) -> str:
    c = cases.get(site) or {}
    return f"{site} ({c.get('cases', '?')} cases, {c.get('images', '?')} img)" if c else site


def _rows_table(table: dict, mean: dict, diffs: dict, labels: list[str], sites: list[str], cases: dict,
                ref_of, names=lambda label: label) -> list[str]:
    head = ["method", *[_counts(cases, s) for s in sites], "mean", "Δ vs reference [95 % CI]", "reference"]
    return [markdown_table(head, [[names(label), *(_cell(table[label].get(s)) for s in sites),
                                   f"**{_cell(mean.get(label))}**", diff_cell(diffs.get(label)), ref_of(label)]
                                  for label in labels])]


def _expert_cell(expert: dict | None) -> str:
    return "-" if not expert else f"{expert['name']} {expert['dice']:.4f}"


def _routing_section(diag: dict) -> list[str]:
    """Markdown lines of ``report["routing_diagnostics"]``: what it is, the summary line, one row per (seed, site,
    routing variant)."""
    s = diag["summary"]
    rho = ("-" if s["spearman"] is None else f"{s['spearman']:+.3f}") + f" over {s['pairs']} rows with both"
    rows = [[r["seed"], r["site"], r.get("label", r["variant"]),
             _num(r["loss_change"], 5, signed=True), _num(r["dice_change"], 4, signed=True), _num(r["movement"], 4),
             "-" if r["foreground_change"] is None else f"{100 * r['foreground_change']:+.1f} %",
             ", ".join(f"{p:.4f}" for p in r.get("prior") or []) or "-",
             _expert_cell(r["best_expert"]), _expert_cell(r["worst_expert"])] for r in diag["rows"]]
    head = ["seed", "outside site", "routing variant", "Δ loss", "Δ Dice vs Average, test-batch BN", "router movement",
            "Δ foreground", "size prior", "best expert", "worst expert"]
    return ["", "IOP-FL routing at the judged outside sites, diagnostics (scoring only: the judged sites' labels score "
                "these numbers, never choose anything): per seed, site and routing variant the change of the "
                "unsupervised loss from start to end of adaptation, the Dice change of the variant's final model "
                "(IOP-FL routing: the final routed model) against its start, the Average with test-batch statistics, "
                "the routers' mean movement from their start (mean |coefficient - start|), the change of the predicted "
                "foreground fraction, and the site's best and worst expert by Dice with test-batch statistics.",
            "", f"Loss fell in {s['loss_fell']} of {s['rows']} rows, Dice rose in {s['dice_rose']}, both in "
                f"{s['both']}; Spearman rank correlation of Δ loss and Δ Dice: {rho} (negative: a lower loss goes "
                "with a higher Dice; - with fewer than 3 rows or a constant column).",
            "", markdown_table(head, rows)]


def to_markdown(report: dict) -> str:
    seeds = report["seeds"]
    n_pairs = "seeds x sites"
    parts = [f"Inside: test Dice per site after {report['rounds']} rounds, mean ± std over seeds {seeds}; the mean "
             "column is each seed's mean over the sites, mean ± std over seeds; Δ is the mean paired difference with "
             "the "
             f"FedAvg of the same backbone over {n_pairs} with its 95 % t-interval (**+** / **−**: the interval "
             f"excludes 0). Header: the test cases and images each cell rests on (per seed)."]
    backbone = report.get("inside_backbone", {})
    for bb, title in report.get("backbones", {"unet": "UNet"}).items():
        labels = [l for l in report["inside"] if report["inside"][l] and backbone.get(l, "unet") == bb]
        if labels:
            parts += ["", f"**Backbone: {title}** (reference: {REFERENCE[bb]})", ""]
            parts += _rows_table(report["inside"], report.get("inside_mean", {}), report.get("inside_vs_fedavg", {}),
                                 labels, report["inside_sites"], report.get("inside_cases", {}),
                                 lambda l, r=REFERENCE[bb]: "" if l == r else r)
    if report.get("outside"):
        parts += ["",
                  f"Outside (held-out sites, never trained on): Dice over every labelled image, mean ± std over seeds "
                      f"{seeds}; Δ against FedAvg under the same normalisation treatment."]
        diffs = report.get("outside_vs_fedavg", {})
        for treatment, title in report.get("treatments", TREATMENTS).items():
            labels = [k for k in report["outside"] if k.endswith(f" [{treatment}]")]
            if labels:
                parts += ["", f"**Normalisation: {title}**", ""]
                parts += _rows_table(report["outside"], report.get("outside_mean", {}), diffs, labels,
                                     report["holdout"],
                                     report.get("outside_cases", {}),
                                     lambda k: diffs.get(k, {}).get("reference", "").rsplit(" [", 1)[0],
                                     lambda k: k.rsplit(" [", 1)[0])
        if report.get("outside_choices"):
            parts += ["", "Options chosen by leave-one-inside-site-out (at each held-out site, per seed, the option "
                          "with the best mean Dice at the other held-out inside sites): "
                      + "; ".join(f"{key.rsplit(' [', 1)[0]} at {h}: {', '.join(map(str, chosen))}"
                                  for key, sites in report["outside_choices"].items() for h, chosen in sites.items())]
        for claim in report.get("claims", []):
            if claim.get("differences"):
                verdicts = [d["verdict"] if d else None for d in claim["differences"].values()]
                verdict = ("cannot be judged: fewer than 2 (seed, site) pairs" if None in verdicts else
                           "holds on this run" if all(v == "better" for v in verdicts) else "does not hold on this run")
                parts += ["", f"Primary outside comparison (declared before running): {claim['label']} vs "
                              f"{', '.join(claim['against'])} under {TREATMENTS[claim['treatment']]}: "
                              + "; ".join(f"vs {a} {diff_cell(d)}" for a, d in claim["differences"].items())
                              + f" -> the claim {verdict}."]
    if report.get("routing_diagnostics"):
        parts += _routing_section(report["routing_diagnostics"])
    if report.get("steps_per_round"):
        sites = report["inside_sites"]
        parts += ["", "Local optimizer steps per round (seed 0, mean over rounds)", "",
                  markdown_table(["job", *sites], [[job, *(f"{v[s]:.0f}" if s in v else "-" for s in sites)]
                                                   for job, v in report["steps_per_round"].items()])]
    if report["timings"]:
        parts += ["", markdown_table(["seed", "fold", "job", "seconds"], [
            [t["seed"], t["fold"], t["job"], f"{t['seconds']:.0f}"] for t in report["timings"]])]
    return "\n".join(parts)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for name in ("inside", "outside"):
        diffs = report.get(f"{name}_vs_fedavg") or {}
        if not diffs:
            continue
        labels = list(diffs)
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(labels) + 1.5))
        ys = range(len(labels))
        means = [diffs[l]["mean"] for l in labels]
        err = [[diffs[l]["mean"] - diffs[l]["lo"] for l in labels], [diffs[l]["hi"] - diffs[l]["mean"] for l in labels]]
        colors = ["tab:green" if diffs[l]["verdict"] == "better" else "tab:red" if diffs[l]["verdict"] == "worse"
                  else "tab:gray" for l in labels]
        ax.barh(ys, means, xerr=err, color=colors, capsize=3)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks(list(ys), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("paired Dice difference vs FedAvg (95 % CI over seeds x sites)")
        ax.set_title(f"{name.capitalize()}: Δ Dice vs FedAvg (same "
                     f"{'backbone' if name == 'inside' else 'BN treatment'})",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(out / f"bench_{name}.png", dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (label, curve) in enumerate(report["curves"].items()):  # 20 colours, and a line style per 4: no two alike
        ax.plot(range(1, len(curve) + 1), curve, label=label, color=colors[i % 20],
                linestyle=("-", "--", ":", "-.")[i % 4])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("mean validation Dice of the reported model")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Validation Dice per round")
    fig.tight_layout()
    fig.savefig(out / "bench_curves.png", dpi=120)
    plt.close(fig)


def run_bench(workspace: str | Path, data: str | Path | None = None, synth_sites: int = 6,
              methods: list[str] | None = None, seeds=(0,), rounds: int = 20, holdout: list[str] | None = None,
              sets: list[str] | None = None, size: int | None = None, outside: bool = True, threads: int | None = None,
              sites: int | None = None, site_names: list[str] | None = None, preset: str | None = "bench",
              jobs: int = 1, say=print) -> dict:
    """``pflseg bench``: run the ``Bench`` of these settings in ``workspace`` (locked before it makes its synthetic
    data there), then ``say`` its tables and the files written. ``sets``, ``data`` and ``size``: the jobs' overrides
    (``pflseg.deploy.data_sites.job_overrides``); ``sites`` / ``site_names``: the sites of ``data`` it uses (default:
    all).

    Returns:
        The bench's report (``Bench.execute``).
    """
    from pflseg.deploy import data_sites

    chosen = None
    if data and (sites or site_names):
        chosen = data_sites.choose_sites(Path(data).resolve(), sites, site_names)
    with workspace_lock(workspace):  # before Bench makes the synthetic data there
        bench = Bench(workspace, data=data, synth_sites=synth_sites, methods=methods, seeds=seeds, rounds=rounds,
                      holdout=holdout, overrides=data_sites.job_overrides(sets or [], data, size), outside=outside,
                      threads=threads, progress=say, sites=chosen, preset=preset, jobs=jobs)
        report = bench.execute()
    say(to_markdown(report))
    say(f"written: {bench.ws}/bench.json, bench_inside.csv, bench_outside.csv, bench.md (+ PNG plots with matplotlib)")
    return report


def loso_methods() -> list[str]:
    """The bench methods the outside claims need (``Method.claims``): those whose outside columns hold a claim's
    label or one it is compared with."""
    wanted = {f"{label} [{c.treatment}]" for _, c in CLAIMS for label in (c.label, *c.against)}
    return [name for name, cols in outside_columns().items()
            if any(f"{col.label} [{col.group}]" in wanted for col in cols)]


def run_loso(holdout: list[str] | None = None, **settings) -> dict:
    """``pflseg loso``: ``run_bench`` with the methods the outside claims need (``loso_methods``), the outside table,
    and ``holdout`` (default: every site once); ``settings``: ``run_bench``'s other arguments."""
    return run_bench(**{**settings, "methods": loso_methods(), "outside": True, "holdout": holdout or ["all"]})
