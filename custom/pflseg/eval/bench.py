"""`pflseg bench`: every method on the same data, backbone and budget; the papers' two protocols.

Inside table: the federation of the inside sites trains each selected method (one FLARE simulator job
per method and seed); per site, the test Dice of each method's model for that site (global and
personalized side by side), mean +- std over seeds. Outside table (leave-one-site-out): for each
held-out site h, FedAvg, FedSM, GRACE and IOP-FL train on the other sites, then at h: FedAvg's and
GRACE's global models, the FedSM super model (``fedsm_infer``, gamma chosen on the inside sites'
validation splits) and IOP-FL test-time routing with its comparators Average, Ensemble, Tent and the
routing variants (``iopfl_route``). Every image of h is used (unlabelled where routing adapts; labels only
score).

With one held-out site (the default on synthetic data: its last site, built unlike each single site and
like their mix) the inside federation is the other sites and the same runs serve both tables.

A finished (seed, fold, job) run is never run again: its ``results.json`` is read back; a run that was
stopped resumes from its last round. Writes ``bench.json``, ``bench_inside.csv``, ``bench_outside.csv``,
``bench.md`` and, with matplotlib, ``bench_inside.png`` (per-site bars, error bars over seeds) and
``bench_curves.png`` (mean validation Dice per round, per method).
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from torch.utils.data import ConcatDataset

from pflseg.data import DataError, load_dataset_info, make_synthetic, site_dataset
from pflseg.deploy.data_sites import site_view
from pflseg.deploy.simulator import run_simulator
from pflseg.eval.progress import RunProgress
from pflseg.flare.jobs import export_job
from pflseg.flare.state import RoundStore, unprefixed
from pflseg.nets import build_net
from pflseg.train import evaluate

#: method -> the inside table's columns: (label, job, key of the site's test metrics; "super": FedSM's super model)
INSIDE = {
    "local": [("Local", "local", "site")],
    "fedavg": [("FedAvg", "fedavg", "global")],
    "fedprox": [("FedProx", "fedprox", "global")],
    "fedbn": [("FedBN", "fedbn", "site")],
    "ft": [("FT", "ft", "site")],
    "fedrep": [("FedRep", "fedrep", "site")],
    "fedsm": [("FedSM personalized", "fedsm", "site"), ("FedSM super", "fedsm_infer", "super")],
    "grace": [("GRACE global", "grace", "global"), ("GRACE personalized", "grace", "site")],
    "grace_server": [("GRACE server-only global", "grace_server", "global")],
    "grace_client": [("GRACE client-only personalized", "grace_client", "site")],
    "iopfl": [("IOP-FL global", "iopfl", "global"), ("IOP-FL P_k", "iopfl", "site")],
    "lcfed": [("LC-Fed w/o HC", "lcfed_nohc", "site"), ("LC-Fed", "lcfed", "site")],
    "centralized": [("Centralized", "centralized", "global")],
}
DEFAULT_METHODS = ("local", "fedavg", "fedprox", "fedbn", "ft", "fedrep", "fedsm", "grace", "iopfl", "lcfed", "centralized")
#: method -> the outside table's columns: (label, job, source: "global" = the job's best global model scored at
#: the held-out site, "super" = FedSM's super model, "route:<m>" = a method of the routing job)
OUTSIDE = {
    "fedavg": [("FedAvg", "fedavg", "global")],
    "fedsm": [("FedSM super", "fedsm_infer", "super")],
    "grace": [("GRACE global", "grace", "global")],
    "grace_server": [("GRACE server-only global", "grace_server", "global")],
    "grace_client": [("GRACE client-only global", "grace_client", "global")],
    "iopfl": [("FedAvg (IOP-FL run)", "iopfl_route", "route:global"), ("Average", "iopfl_route", "route:average"),
              ("Ensemble", "iopfl_route", "route:ensemble"), ("Tent", "iopfl_route", "route:tent"),
              ("IOP-FL (Global)", "iopfl_route", "route:routing_global"),
              ("Routing per-layer (ours)", "iopfl_route", "route:routing_layer"),
              ("IOP-FL routing", "iopfl_route", "route:routing")],
}
#: post-training jobs and the training job whose models they use
AFTER = {"fedsm_infer": "fedsm", "iopfl_route": "iopfl"}


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def _seed_means(col: dict[str, list[float]]) -> dict | None:
    """Mean over the sites of each seed's run, then mean and std of those over seeds (the spread of a
    method's site mean from seed to seed, not the sites' spread). None (a "-" in the tables) when some
    site lacks a seed's value: a site mean over fewer sites is not comparable."""
    if len({len(values) for values in col.values()}) != 1:
        return None
    return _stats([statistics.mean(values) for values in zip(*col.values())])


class Bench:
    """The runs, resumable, and the tables. ``methods``: keys of INSIDE; the outside table has the columns
    of the selected methods found in OUTSIDE."""

    def __init__(self, workspace, data=None, synth_sites: int = 6, methods=DEFAULT_METHODS, seeds=(0,), rounds: int = 20,
                 holdout: list[str] | None = None, overrides: dict | None = None, outside: bool = True,
                 threads: int | None = None, progress=print, sites: list[str] | None = None):
        unknown = [m for m in methods if m not in INSIDE]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(INSIDE)}")
        self.ws = Path(workspace).resolve()
        self.root = Path(data).resolve() if data else make_synthetic(self.ws / "data", n_sites=synth_sites, seed=0)
        self.sites = list(sites) if sites else load_dataset_info(self.root)["sites"]
        if holdout == ["all"]:
            holdout = list(self.sites)
        self.holdout = list(holdout) if holdout else ([self.sites[-1]] if data is None else list(self.sites))
        bad = [h for h in self.holdout if h not in self.sites]
        if bad or len(self.sites) - (len(self.holdout) == 1) < 2:
            raise ValueError(f"--holdout {self.holdout}: need sites of {self.root} ({self.sites}) and 2 sites left to train")
        self.inside = [s for s in self.sites if s not in self.holdout] if len(self.holdout) == 1 else list(self.sites)
        self.methods, self.seeds, self.rounds = list(methods), list(seeds), rounds
        self.outside = outside and any(m in OUTSIDE for m in self.methods)
        self.overrides, self.threads, self.progress = dict(overrides or {}), threads, progress
        self.timings: list[dict] = []

    # ---- runs -----------------------------------------------------------------------------------
    def fold(self, h: str | None) -> str:
        """Folder of the federation that leaves ``h`` out (None: the inside federation); the same when equal."""
        return "inside" if h is None or [s for s in self.sites if s != h] == self.inside else f"without-{h}"

    def trained_on(self, fold: str) -> list[str]:
        return self.inside if fold == "inside" else [s for s in self.sites if s != fold[len("without-"):]]

    def plan(self) -> list[tuple[int, str, str]]:
        """Every (seed, fold, job), each once, training jobs before the post-training jobs that read them."""
        wanted = [(None, job) for m in self.methods for _, job, _ in INSIDE[m]]
        if self.outside:
            wanted += [(h, job) for h in self.holdout for m in self.methods for _, job, _ in OUTSIDE.get(m, [])]
        keys: list[tuple[str, str]] = []
        for h, job in wanted:
            for j in ([AFTER[job], job] if job in AFTER else [job]):
                if (self.fold(h), j) not in keys:
                    keys.append((self.fold(h), j))
        return [(seed, fold, job) for seed in self.seeds for fold, job in keys]

    def run_dir(self, seed: int, fold: str, job: str) -> Path:
        return self.ws / "runs" / f"seed{seed}" / fold / job

    def clients(self, fold: str, job: str) -> list[str]:
        trained = self.trained_on(fold)
        if job in AFTER:  # post-training jobs also reach the sites outside this federation
            return trained + [s for s in self.holdout if s not in trained]
        return trained

    def results(self, seed: int, fold: str, job: str) -> dict:
        return json.loads((self.run_dir(seed, fold, job) / "state" / "server" / job / "results.json").read_text())

    def finished(self, seed: int, fold: str, job: str) -> bool:
        return (self.run_dir(seed, fold, job) / "state" / "server" / job / "results.json").is_file()

    def names(self, seed: int, fold: str, job: str) -> dict[str, str]:
        """FLARE site name -> the data root's site name, for one run."""
        return json.loads((self.run_dir(seed, fold, job) / "sites.json").read_text())

    def run(self, seed: int, fold: str, job: str) -> dict:
        """One FLARE simulator job (read back when it finished; resumed when it stopped mid-way)."""
        ws = self.run_dir(seed, fold, job)
        if self.finished(seed, fold, job):
            return self.results(seed, fold, job)
        clients = self.clients(fold, job)
        over = {**self.overrides, "seed": seed, "rounds": self.rounds, "min_clients": len(clients)}
        if job in AFTER:
            trained = AFTER[job]
            key = "fedsm" if trained == "fedsm" else "iopfl"
            bundle = str(self.run_dir(seed, fold, trained) / "state" / "server" / trained)
            over[key] = {**over.get(key, {}), "bundle": bundle, **({"targets": []} if key == "iopfl" else {})}
        if RoundStore(ws / "state" / "server" / job).latest() is not None:
            over["resume"] = True
        data, mapping = site_view(self.root, clients, ws / "data")
        ws.mkdir(parents=True, exist_ok=True)
        (ws / "sites.json").write_text(json.dumps(mapping, indent=1))
        job_dir = export_job(job, ws / "job", overrides=over)
        return run_simulator(job_dir, ws, n_sites=len(clients), threads=self.threads, data=data, progress=lambda m: None,
                             clients=list(mapping))

    def execute(self) -> dict:
        plan = self.plan()
        steps = RunProgress(len(plan), self.progress)
        for seed, fold, job in plan:
            done_before = self.finished(seed, fold, job)
            steps.start(f"seed {seed}, {fold}: {job}")
            res = self.run(seed, fold, job)
            took = steps.done(timed=not done_before)
            seconds = res.get("footprint", {}).get("wall_seconds", took)
            self.timings.append({"seed": seed, "fold": fold, "job": job, "seconds": seconds})
            how = f"finished earlier ({seconds:.0f} s), read back" if done_before else f"{seconds:.0f} s"
            self.progress(f"[{steps.finished}/{len(plan)}] {job}: {how}; {len(plan) - steps.finished} left")
        return self.tables()

    # ---- tables ---------------------------------------------------------------------------------
    def inside_values(self) -> dict:
        """label -> site -> test Dice per seed (in seed order)."""
        table: dict = {}
        for m in self.methods:
            for label, job, key in INSIDE[m]:
                col = table.setdefault(label, {})
                for seed in self.seeds:
                    res, names = self.results(seed, "inside", job), self.names(seed, "inside", job)
                    values = res["test_at_gamma"] if key == "super" else {s: t[key]["dice"] for s, t in res["test"].items()}
                    for sim_site, dice in values.items():
                        if names[sim_site] in self.inside:
                            col.setdefault(names[sim_site], []).append(dice)
        return table

    def outside_values(self) -> dict:
        """label -> held-out site -> Dice per seed (in seed order)."""
        table: dict = {}
        for h in self.holdout:
            fold = self.fold(h)
            for m in self.methods:
                for label, job, source in OUTSIDE.get(m, []):
                    for seed in self.seeds:
                        table.setdefault(label, {}).setdefault(h, []).append(self.outside_dice(seed, fold, job, source, h))
        return table

    def outside_dice(self, seed: int, fold: str, job: str, source: str, h: str) -> float:
        if source == "global":
            return self.global_dice_at(seed, fold, job, h)
        res, names = self.results(seed, fold, job), self.names(seed, fold, job)
        sim_h = next(s for s, original in names.items() if original == h)
        if source == "super":
            return res["test_at_gamma"][sim_h] if "test_at_gamma" in res else res["infer"][sim_h]["super"]["extra"]["dice"]
        return res["route"][sim_h]["methods"][source[len("route:"):]]["dice"]

    def global_dice_at(self, seed: int, fold: str, job: str, h: str) -> float:
        """Dice of ``job``'s final best global model on every labelled image of the held-out site ``h``."""
        res = self.results(seed, fold, job)
        ckpt = RoundStore(self.run_dir(seed, fold, job) / "state" / "server" / job).final()
        net = build_net(res["config"]["net"])
        net.load_state_dict({**net.state_dict(), **(unprefixed("best", ckpt) or unprefixed("global", ckpt))})
        parts = []
        for split in ("training", "validation", "testing"):
            try:
                parts.append(site_dataset(self.root, h, split, size=res["config"]["data"]["size"]))
            except DataError:
                continue
        return evaluate(net, ConcatDataset(parts), "cpu", res["config"]["train"]["eval_batch_size"])["dice"]

    def curves(self) -> dict:
        """Mean validation Dice per round (over sites, then seeds) of every inside training job."""
        out = {}
        for m in self.methods:
            for _, job, _ in INSIDE[m]:
                if job in AFTER or job in out:
                    continue
                per_seed = [[statistics.mean(h["val_dice"].values()) for h in self.results(seed, "inside", job)["history"]
                             if h.get("val_dice")] for seed in self.seeds]
                n = min(len(c) for c in per_seed)
                out[job] = [statistics.mean(c[i] for c in per_seed) for i in range(n)]
        return out

    def tables(self) -> dict:
        report = {"data": str(self.root), "inside_sites": self.inside, "holdout": self.holdout, "seeds": self.seeds,
                  "rounds": self.rounds, "overrides": self.overrides}
        for name, values in (("inside", self.inside_values()), ("outside", self.outside_values() if self.outside else {})):
            report[name] = {label: {site: _stats(v) for site, v in col.items()} for label, col in values.items()}
            report[f"{name}_mean"] = {label: m for label, col in values.items() if col and (m := _seed_means(col))}
        report |= {"curves": self.curves(), "timings": self.timings}
        self.write(report)
        return report

    def write(self, report: dict) -> None:
        (self.ws / "bench.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        for name in ("inside", "outside"):
            with open(self.ws / f"bench_{name}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["site", "method", "dice_mean", "dice_std", "n"])
                for label, col in report[name].items():
                    for site, st in [*col.items(), ("mean", report[f"{name}_mean"].get(label))]:
                        if st:
                            w.writerow([site, label, f"{st['mean']:.4f}", f"{st['std']:.4f}", st["n"]])
        (self.ws / "bench.md").write_text(to_markdown(report) + "\n")
        try:
            plot(report, self.ws)
        except ImportError:
            self.progress("matplotlib is not installed: no PNG plots (pip install -e '.[plots]')")


def _md_table(table: dict, mean: dict, rows: list[str], title: str) -> str:
    labels = [label for label in table if table[label]]
    lines = [f"{title}", "", "| site | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for site in rows:
        cells = [f"{table[l][site]['mean']:.4f} ± {table[l][site]['std']:.4f}" if site in table[l] else "-" for l in labels]
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    cells = [f"**{mean[l]['mean']:.4f} ± {mean[l]['std']:.4f}**" if l in mean else "-" for l in labels]
    lines.append("| **mean** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_markdown(report: dict) -> str:
    seeds = report["seeds"]
    parts = [_md_table(report["inside"], report.get("inside_mean", {}), report["inside_sites"],
                       f"Inside: test Dice per site, {report['rounds']} rounds, mean ± std over seeds {seeds}")]
    if report["outside"]:
        parts += ["", _md_table(report["outside"], report.get("outside_mean", {}), report["holdout"],
                                f"Outside (leave-one-site-out): Dice over every image of the held-out site, mean ± std over seeds {seeds}")]
    if report["timings"]:
        parts += ["", "| seed | fold | job | seconds |", "|---|---|---|---|"]
        parts += [f"| {t['seed']} | {t['fold']} | {t['job']} | {t['seconds']:.0f} |" for t in report["timings"]]
    return "\n".join(parts)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table, sites = report["inside"], report["inside_sites"]
    labels = [l for l in table if table[l]]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(sites) * len(labels) / 4), 4.5))
    width, colors = 0.8 / max(len(labels), 1), plt.get_cmap("tab20").colors
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(sites))]
        ax.bar(xs, [table[label].get(s, {}).get("mean", 0) for s in sites], width,
               yerr=[table[label].get(s, {}).get("std", 0) for s in sites], label=label, capsize=2, color=colors[i % 20])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sites))], sites)
    ax.set_ylabel("test Dice")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Inside: per-site test Dice (error bars: std over seeds)")
    fig.tight_layout()
    fig.savefig(out / "bench_inside.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (job, curve) in enumerate(report["curves"].items()):  # 20 colours, and a line style per 4: no two alike
        ax.plot(range(1, len(curve) + 1), curve, label=job, color=colors[i % 20], linestyle=("-", "--", ":", "-.")[i % 4])
    ax.set_xlabel("round")
    ax.set_ylabel("mean validation Dice")
    ax.legend(fontsize=7)
    ax.set_title("Validation Dice per round")
    fig.tight_layout()
    fig.savefig(out / "bench_curves.png", dpi=120)
    plt.close(fig)
