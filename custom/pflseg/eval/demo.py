"""`pflseg demo`: what each method is for, on the benchmark's synthetic sites scaled down, in the FLARE simulator.

The data is ``pflseg.data.synth.PRESETS["demo"]``: the bench preset's first three inside sites (sites that
label differently, image differently and differ in size: 12 / 6 / 3 training cases) and one outside site whose
cases blend the inside sites' styles, at 48 px; every inside site tests on 5 cases (40 slices), the outside site
is scored on all of its 20 cases (160 slices). The runs are ``pflseg bench``'s (``Bench.run``: resumable, read back
when the settings are the same), one seed, every method at the same budget.

1. Inside: FedBN, FedSM, GRACE, IOP-FL and LC-Fed (on its own backbone) train on the inside sites. FedAvg is the
   IOP-FL run's global model (bit for bit a FedAvg run at the same seed), so it costs no run of its own. The
   table gives each site's test Dice of the model each method gives it, the mean, and the mean paired
   difference against FedAvg over (site, case) pairs with its 95 % t-interval.
2. Outside: the IOP-FL bundle is routed at the outside site (``iopfl_route``) and scored next to FedAvg, Average,
   Ensemble and online Tent, each comparison within one normalisation treatment (running statistics or the test
   batch's); FedSM's super model (``fedsm_infer``) under running statistics.
Under each table the run's verdicts are written out as sentences from the numbers.

Pairs by case need the same case pseudonym in every run of a site (``privacy.per_case``: HMAC under the site's
salt): as in a deployment, where a hospital keeps one state folder (and salt) for all its jobs, each demo site
keeps one salt (``<workspace>/salts``) for all of its runs.

Writes ``<workspace>/results/`` (``inside.md``, ``inside.csv``, ``outside.md``, ``val_dice.png``: mean validation
Dice per round of each method, ``overlays.md``) and each run's own ``runs/seed0/inside/<job>/results/``.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

from pflseg.deploy.simulator import run_side_by_side
from pflseg.deploy.workspace import workspace_lock
from pflseg.eval.bench import CLAIMS, Bench, paired_difference
from pflseg.eval.plots import PLOTS_HINT, have_matplotlib, overlay_paths, plot_lines, write_results
from pflseg.flare.columns import site_test
from pflseg.flare.methods import METHODS, TREATMENTS
from pflseg.flare.state import private_dir
from pflseg.markdown import diff_cell, markdown_table

PRESET = "demo"
#: inside rows (``pflseg.flare.columns.Column``, group: the backbone), every method's ``Method.demo_inside`` in the
#: registry's order; the reference row is "FedAvg"; a row on another backbone than the UNet is marked in the table
INSIDE = [row for entry in METHODS.values() for row in entry.demo_inside]
#: outside rows (group: the normalisation treatment), every ``Method.demo_outside``
OUTSIDE = [row for entry in METHODS.values() for row in entry.demo_outside]
#: post-training job -> the training job whose bundle it reads (``Method.after``)
AFTER = {name: entry.after[0] for name, entry in METHODS.items() if entry.after}
#: the rows' jobs: training jobs, then the post-training jobs that read their bundles; two run side by side
JOBS = tuple(dict.fromkeys([row.job for row in INSIDE + OUTSIDE if row.job not in AFTER]
                           + [row.job for row in INSIDE + OUTSIDE if row.job in AFTER]))
#: the same for every job: lr 0.003 with Dice + cross-entropy and 3 local epochs make the U-Net segment within
#: a few rounds; per-case Dice (pseudonymised) leaves the sites so that differences can be paired by case; and each
#: method's own ``Method.demo_settings``
SETTINGS = {"train": {"lr": 0.003, "loss": "dice_ce", "epochs": 3},
            **{k: v for entry in METHODS.values() for k, v in entry.demo_settings.items()},
            "privacy": {"per_case": True}}
#: LC-Fed's five-stage backbone, narrowed (its calibration applies every site's head: the demo's slowest job): the net
#: of every job of a row on that backbone
LCFED_NET = {"channels": [8, 16, 32, 64, 128]}
#: rounds: FedAvg's mean validation Dice is flat over the last rounds (docs/benchmark.md: the demo)
ROUNDS = 16
OTHER_BACKBONE = tuple(row.label for row in INSIDE if row.group != "unet")
#: the job of the inside reference row ("FedAvg"): its validation curve is the demo's plateau
REFERENCE_ROW = next(row for row in INSIDE if row.label == "FedAvg")
REFERENCE_JOB = REFERENCE_ROW.job
BENCH_HINT = ("One seed and three small synthetic sites: a guide to what each method is for, not evidence. The "
              "papers' protocols (5 sites, 64 px, seeds x sites, every baseline and control): `pflseg bench`.")


def _case_means(per_case: dict, site: str) -> dict[str, float]:
    """{"site/case": mean Dice over classes} of one site's ``per_case`` entry."""
    return {f"{site}/{case}": statistics.mean(v) if isinstance(v, list) else float(v) for case, v in per_case.items()}


class Demo:
    """The demo's runs (through ``Bench``) and its tables."""

    def __init__(self, workspace, rounds: int = ROUNDS, threads: int | None = None, progress=print):
        self.bench = Bench(workspace, methods=[], seeds=[0], rounds=rounds, overrides=SETTINGS, threads=threads,
                           progress=progress, preset=PRESET, salts=True,
                           per_job={row.job: {"net": LCFED_NET} for row in INSIDE if row.group != "unet"})
        self.ws, self.rounds, self.progress = self.bench.ws, rounds, progress
        self.inside, self.outside = self.bench.inside, self.bench.holdout

    def run(self) -> dict:
        """Every job of ``JOBS``, two side by side (a post-training job after the run it reads), with progress lines."""
        t0, took = time.time(), []

        def job(name):
            def go():
                start = time.time()
                self.progress(f"{name} ...")
                res = self.bench.run(0, "inside", name)
                took.append(time.time() - start)
                write_results(res, self.bench.run_dir(0, "inside", name))
                left = len(JOBS) - len(took)
                eta = f"; about {statistics.mean(took) * left / 2 / 60:.0f} min left" if left else ""
                self.progress(f"[{len(took)}/{len(JOBS)}] {name} finished in {took[-1]:.0f} s ({time.time() - t0:.0f} "
                              "s "
                              f"since the first){eta}")
                return res
            return go

        return run_side_by_side({name: job(name) for name in JOBS}, after=AFTER)

    def scores(self, results: dict, row, sites: list[str]) -> dict:
        """data-root site -> the row's Score there (``pflseg.flare.columns``), at ``sites``."""
        res, names = results[row.job], self.bench.names(0, "inside", row.job)
        return {site: site_test(row, res, sim) for sim, site in names.items() if site in sites}

    def per_case(self, results: dict, row, sites: list[str]) -> dict:
        """{"site/case": Dice} of one row at ``sites`` (data-root names)."""
        out = {}
        for site, score in self.scores(results, row, sites).items():
            if score.per_case is None:
                raise ValueError(f"{row.job}: no per-case Dice for {site} ({row.key}); the demo needs "
                                 "privacy.per_case: true")
            out.update(_case_means(score.per_case, site))
        return out

    def tables(self, results: dict) -> dict:
        inside = {row.label: self.per_case(results, row, self.inside) for row in INSIDE}
        outside = {f"{row.label} [{row.group}]": self.per_case(results, row, self.outside)
                   for row in OUTSIDE if row.job in results}
        report = {"inside_sites": self.inside, "outside_sites": self.outside, "rounds": self.rounds,
                  "cases": {s: len([k for k in inside["FedAvg"] if k.startswith(s + "/")]) for s in self.inside},
                  "outside_cases": {s: len([k for k in outside["FedAvg [running]"] if k.startswith(s + "/")])
                                    for s in self.outside},
                  "images": self.images(results), "inside": summarise(inside, self.inside),
                  "outside": {}, "plateau": self.plateau(results)}
        for tr in TREATMENTS:  # a treatment the demo has no rows for (the bench's loso choice) is left out
            rows = {k.rsplit(" [", 1)[0]: v for k, v in outside.items() if k.endswith(f"[{tr}]")}
            if rows:
                report["outside"][tr] = summarise(rows, self.outside)
        report["claims"] = []
        for method, claim in CLAIMS:
            rows = {k.rsplit(" [", 1)[0]: v for k, v in outside.items() if k.endswith(f"[{claim.treatment}]")}
            report["claims"].append({"method": method, "label": claim.label, "against": list(claim.against),
                                     "treatment": claim.treatment, "differences": {
                                         a: paired_difference({k: [v] for k, v in rows[claim.label].items()},
                                                              {k: [v] for k, v in rows[a].items()})
                                         for a in claim.against if claim.label in rows and a in rows}})
        return report

    def images(self, results: dict) -> dict:
        """site -> test images: the inside sites' from the reference row, the outside sites' from the outside
        reference row."""
        out = {s: sc.images for s, sc in self.scores(results, REFERENCE_ROW, self.inside).items()}
        ref = next(row for row in OUTSIDE if row.label == "FedAvg" and row.job in results)
        return out | {s: sc.images for s, sc in self.scores(results, ref, self.outside).items()}

    def plateau(self, results: dict) -> dict:
        """FedAvg's (the reference run's global model's) mean validation Dice per round."""
        curve = [statistics.mean(h["val_dice"].values()) for h in results[REFERENCE_JOB]["history"]
                 if h.get("val_dice")]
        tail = curve[-4:]
        return {"curve": curve, "last": tail, "range_last": max(tail) - min(tail) if tail else None}


def summarise(rows: dict[str, dict[str, float]], sites: list[str]) -> dict:
    """label -> {"sites": {site: mean Dice}, "mean", "vs_fedavg": paired difference over (site, case) pairs,
    "per_site": {site: paired difference over that site's cases}}; the reference row is "FedAvg"."""
    ref = rows["FedAvg"]
    out = {}
    for label, values in rows.items():
        by_site = {s: [v for k, v in values.items() if k.startswith(s + "/")] for s in sites}
        entry = {"sites": {s: statistics.mean(v) for s, v in by_site.items() if v},
                 "mean": statistics.mean(values.values()) if values else None}
        if label != "FedAvg":
            entry["vs_fedavg"] = paired_difference({k: [v] for k, v in values.items()},
                                                   {k: [v] for k, v in ref.items()})
            entry["per_site"] = {s: paired_difference({k: [v] for k, v in values.items() if k.startswith(s + "/")},
                                                      {k: [v] for k, v in ref.items()}) for s in sites}
        out[label] = entry
    return out


def markdown(table: dict, sites: list[str], counts: dict, images: dict, note=lambda label: "") -> str:
    head = ["method", *[f"{s} ({counts.get(s, '?')} cases, {images.get(s, '?')} img)" for s in sites], "mean",
            "Δ vs FedAvg [95 % CI over (site, case) pairs]"]
    return markdown_table(head, [[f"{label}{note(label)}",
                                  *(f"{e['sites'][s]:.3f}" if s in e["sites"] else "-" for s in sites),
                                  f"**{e['mean']:.3f}**", diff_cell(e.get("vs_fedavg"))] for label, e in table.items()])


def sentences(table: dict, where: str) -> list[str]:
    """Plain verdicts from the numbers: who beats FedAvg (interval above 0), who loses, what is unresolved, and at
    which sites a method's own per-site interval lies above 0."""
    groups: dict[str, list[str]] = {"better": [], "worse": [], "tie": []}
    for label, e in table.items():
        d = e.get("vs_fedavg")
        if d:
            groups[d["verdict"]].append(f"{label} ({d['mean']:+.3f})")
    out = []
    if groups["better"]:
        out.append(f"{where}, better than FedAvg (95 % interval above 0): {', '.join(groups['better'])}.")
    if groups["worse"]:
        out.append(f"{where}, worse than FedAvg (interval below 0): {', '.join(groups['worse'])}.")
    if groups["tie"]:
        out.append(f"{where}, not resolved by this run (interval includes 0), so no claim either way: "
                   f"{', '.join(groups['tie'])}.")
    wins = [f"{label} at {', '.join(s for s, d in e['per_site'].items() if d and d['verdict'] == 'better')}"
            for label, e in table.items()
            if any(d and d["verdict"] == "better" for d in e.get("per_site", {}).values())]
    if wins and len(table[next(iter(table))]["sites"]) > 1:
        out.append("Site by site (interval over that site's cases above 0): " + "; ".join(wins) + ".")
    return out


def run_demo(workspace: str | Path = "demo", rounds: int = ROUNDS, threads: int | None = None, progress=print) -> str:
    """Make the data, run the demo's jobs, write the tables and pictures; return the text to print. One demo at a
    time in a workspace (``<workspace>/.lock``, see ``workspace_lock``)."""
    t0 = time.time()
    ws = Path(workspace).resolve()
    with workspace_lock(ws):
        demo = Demo(ws, rounds, threads, progress)
        progress(f"synthetic data (preset {PRESET}) in {demo.bench.root(0)}: inside sites {', '.join(demo.inside)}, "
                 f"outside site {', '.join(demo.outside)}")
        results = demo.run()
        report = demo.tables(results)
        return write(demo, results, report, ws, t0)


def write(demo: Demo, results: dict, report: dict, ws: Path, t0: float) -> str:
    out = ws / "results"
    private_dir(out)
    flat = report["plateau"]
    inside_md = markdown(report["inside"], demo.inside, report["cases"], report["images"],
                         lambda label: " (own net)" if label in OTHER_BACKBONE else "")
    text = [f"Inside: test Dice per site after {report['rounds']} rounds (each method's model for that site; FedAvg = "
            f"the IOP-FL run's global model). FedAvg's mean validation Dice over the last rounds: "
            + ", ".join(f"{v:.3f}" for v in flat["last"]) + f" (range {flat['range_last']:.3f}).", "", inside_md, "",
            *sentences(report["inside"], "Inside"),
            *(f"{label} runs on its own U-shaped net, so its Δ mixes the method with the backbone."
              for label in OTHER_BACKBONE), ""]
    (out / "inside.md").write_text("\n".join(text) + "\n")
    with open(out / "inside.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", *demo.inside, "mean", "diff_vs_fedavg", "ci95_lo", "ci95_hi", "n_pairs"])
        for label, e in report["inside"].items():
            d = e.get("vs_fedavg") or {}
            w.writerow([label, *(f"{e['sites'].get(s, float('nan')):.4f}" for s in demo.inside), f"{e['mean']:.4f}",
                        *(f"{d[k]:.4f}" if d else "" for k in ("mean", "lo", "hi")), d.get("n", "")])
    outside = [f"Outside: {', '.join(demo.outside)} never trained; every image scored; comparisons within one "
               "normalisation treatment."]
    for tr, title in ((tr, t) for tr, t in TREATMENTS.items() if tr in report["outside"]):
        outside += ["", f"**Normalisation: {title}**", "",
                    markdown(report["outside"][tr], demo.outside, report["outside_cases"], report["images"]), "",
                    *sentences(report["outside"][tr], f"Outside ({title})")]
    for claim in report["claims"]:
        diffs = claim["differences"]
        if diffs:
            verdicts = {d["verdict"] if d else None for d in diffs.values()}
            verdict = ("holds on this run" if verdicts == {"better"} else "cannot be judged (too few pairs)"
                       if None in verdicts else "does not hold on this run")
            outside += ["", f"{claim['method']}'s outside claim ({claim['label']} beats {', '.join(claim['against'])} "
                            f"under {TREATMENTS[claim['treatment']]}): "
                        + "; ".join(f"vs {a} {diff_cell(d)}" for a, d in diffs.items()) + f" -> the claim {verdict}."]
    (out / "outside.md").write_text("\n".join(outside) + "\n")
    text += outside + ["", BENCH_HINT]
    written = [out / "inside.md", out / "inside.csv", out / "outside.md"]
    lines = []
    if have_matplotlib():
        curves = {row.label: [(i + 1, v) for i, v in enumerate(demo.bench.curve(0, row.job, row.key))]
                  for row in INSIDE if row.key != "global_adabn"}
        written.append(plot_lines(curves, out / "val_dice.png", "validation Dice per round (mean over sites)"))
    else:
        lines.append(PLOTS_HINT)
    listing = []
    for job in JOBS:
        run_dir = demo.bench.run_dir(0, "inside", job)
        for site, paths in overlay_paths(run_dir, job).items():
            listing += [f"- {job}, {site}: {p}" for p in paths]
    if listing:
        (out / "overlays.md").write_text("Overlays (image | ground truth | prediction) of the best and worst test "
                                         "cases, drawn at each site:\n\n" + "\n".join(listing) + "\n")
        written.append(out / "overlays.md")
    (ws / "results.json").write_text(json.dumps({"report": report, "runs": results}, indent=1, sort_keys=True))
    text += ["", "Written: " + ", ".join(str(p) for p in written), *lines,
             f"demo finished in {(time.time() - t0) / 60:.1f} min; everything in {ws}"]
    return "\n".join(text)
