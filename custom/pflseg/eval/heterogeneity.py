"""How heterogeneous is the synthetic data? Measured with the real jobs, not assumed.

    pflseg report heterogeneity --preset bench --workspace runs/heterogeneity --rounds 20

1. makes the preset's synthetic data set (``--preset bench``: 5 inside sites + 1 outside site; ``none``:
   the plain 6-site generator, site-6 outside) with the data seed = the first ``--seeds``;
2. runs the ``local`` and ``fedavg`` jobs on the inside sites in the FLARE simulator;
3. scores every inside site's own best-by-validation model (Local) and the best FedAvg global model on
   the test split of every site, inside and outside, and reports:
   - the cross-site Dice matrix (row: the model, column: the test site, with its kind);
   - per single-site model, on how many other inside sites it loses >= 0.15 Dice;
   - FedAvg vs Local on the inside site with the fewest training slices;
   - at each outside site: the best single-site model vs the FedAvg model (trained on the mix).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pflseg.config import load_job_config
from pflseg.data import load_dataset_info, make_synthetic, site_dataset
from pflseg.deploy.simulator import run_simulator
from pflseg.deploy.workspace import server_state
from pflseg.eval.progress import RunProgress
from pflseg.flare.jobs import export_job
from pflseg.flare.methods import REFERENCE_JOB
from pflseg.flare.state import RoundStore, load_file, unprefixed
from pflseg.flare.wire import BEST
from pflseg.markdown import markdown_table
from pflseg.nets import build_net
from pflseg.train import evaluate

DROP = 0.15


def site_kinds(info: dict) -> dict[str, str]:
    """site -> "inside" or the outside site's kind, from a dataset.json (its ``site_profiles``; without them,
    the plain generator's rule: with 3 or more sites the last one is an outside "blend" site)."""
    sites, profiles = info["sites"], info.get("site_profiles") or {}
    if profiles:
        return {s: (profiles.get(s, {}).get("outside_kind", "blend") if profiles.get(s, {}).get("kind") == "outside"
                    else "inside") for s in sites}
    return {s: "blend" if len(sites) >= 3 and s == sites[-1] else "inside" for s in sites}


def summarise(matrix: dict[str, dict[str, float]], kinds: dict[str, str], n_train: dict[str, int]) -> dict:
    """The report from a Dice matrix (pure).

    Args:
        matrix: model -> test site -> Dice; models ``local:<site>`` per inside site, optionally ``fedavg``.
        kinds: site -> "inside" | outside kind (every column of the matrix, in column order).
        n_train: inside site -> training slices.

    Returns:
        {"matrix", "kinds", "train_slices", "smallest_site", "sites_losing_0.15_on_most_others",
        "other_sites_with_drop_ge_0.15", "smallest_site_local_vs_fedavg" (None without fedavg),
        "outside_single_site_models": {outside: {inside: Dice}}, "outside_fedavg": {outside: Dice}}.
    """
    inside = [s for s, k in kinds.items() if k == "inside"]
    outside = [s for s, k in kinds.items() if k != "inside"]
    smallest = min(inside, key=lambda s: n_train[s])
    drops = {s: sum(1 for o in inside if o != s and matrix[f"local:{s}"][s] - matrix[f"local:{s}"][o] >= DROP)
             for s in inside}
    fedavg = matrix.get(REFERENCE_JOB)
    return {
        "matrix": matrix, "kinds": dict(kinds), "train_slices": dict(n_train), "smallest_site": smallest,
        "sites_losing_0.15_on_most_others": sum(1 for s in inside if drops[s] > (len(inside) - 1) / 2),
        "other_sites_with_drop_ge_0.15": drops,
        "smallest_site_local_vs_fedavg": [matrix[f"local:{smallest}"][smallest], fedavg[smallest]] if fedavg else None,
        "outside_single_site_models": {o: {s: matrix[f"local:{s}"][o] for s in inside} for o in outside},
        "outside_fedavg": {o: fedavg[o] for o in outside} if fedavg else {},
    }


def _score(state: dict, cfg: dict, root: Path, sites: list[str]) -> dict[str, float]:
    net = build_net(cfg["net"])
    net.load_state_dict(state)
    return {s: evaluate(net, site_dataset(root, s, "testing", size=cfg["data"]["size"]), torch.device("cpu"))["dice"]
            for s in sites}


def measure(workspace: str | Path, rounds: int = 20, task: str = "prostate", seed: int = 0, progress=print,
            preset: str | None = "bench", size: int | None = None, outside: list[str] | None = None) -> dict:
    """Makes the data, runs Local and FedAvg on its inside sites, scores the models everywhere (see the module).

    Args:
        workspace: Folder for the data, the jobs, their runs and ``heterogeneity.json``.
        rounds: Federated rounds of both jobs.
        task: "prostate" or "fundus".
        seed: Data seed and training seed.
        progress: Called with progress lines.
        preset: Synthetic data preset (``pflseg.data.synth.PRESETS``), or None for the plain 6-site generator.
        size: Data and training size (default: the preset's, else 64).
        outside: The preset's outside site kinds (default: the preset's).

    Returns:
        The report of :func:`summarise` (also written to ``<workspace>/heterogeneity.json``).
    """
    ws = Path(workspace).resolve()
    if preset:
        root = make_synthetic(ws / "data", task=task, seed=seed, size=size, preset=preset, outside=outside)
    else:
        root = make_synthetic(ws / "data", task=task, n_sites=6, seed=seed, size=size)
    info = load_dataset_info(root)
    sites, kinds = info["sites"], site_kinds(info)
    inside = [s for s in sites if kinds[s] == "inside"]
    over = {"rounds": rounds, "min_clients": len(inside), "seed": seed}
    if size or info.get("train_size"):
        over["data"] = {"size": int(size or info["train_size"])}
    if task == "fundus":
        over["net"] = {"out_channels": 2}
    models = {}
    steps = RunProgress(2, progress)
    for name in ("local", REFERENCE_JOB):
        job = export_job(name, ws / "jobs", overrides=over)
        steps.start(name)
        run_simulator(job, ws / name, n_sites=len(inside), data=root, progress=progress, clients=inside)
        steps.done()
    cfg = load_job_config(REFERENCE_JOB, overrides=over)
    for site in inside:
        models[f"local:{site}"] = unprefixed("model", load_file(ws / "local" / "state" / site / "local" / "best.pt"))
    store = RoundStore(server_state(ws / REFERENCE_JOB, REFERENCE_JOB))
    models[REFERENCE_JOB] = unprefixed(BEST, store.final())
    matrix = {name: _score(state, cfg, root, sites) for name, state in models.items()}
    n_train = {s: len(site_dataset(root, s, "training", size=cfg["data"]["size"])) for s in inside}
    report = {"preset": preset, "seed": seed, "rounds": rounds, **summarise(matrix, kinds, n_train)}
    (ws / "heterogeneity.json").write_text(json.dumps(report, indent=1))
    return report


def to_markdown(report: dict) -> str:
    """The report as Markdown: the cross-site matrix, then the summary lines."""
    matrix, kinds = report["matrix"], report["kinds"]
    sites = list(kinds)
    head = [s if kinds[s] == "inside" else f"{s} ({kinds[s]})" for s in sites]
    lines = [markdown_table(["model \\ test site", *head],
                            [[name, *(f"{row[s]:.3f}" for s in sites)] for name, row in matrix.items()])]
    drops = report["other_sites_with_drop_ge_0.15"]
    lines += [
        "",
        f"- single-site models that lose >= {DROP} Dice on most other inside sites: "
        f"{report['sites_losing_0.15_on_most_others']} of {len(drops)} (other sites with such a drop: {drops})",
    ]
    smallest = report["smallest_site"]
    if report["smallest_site_local_vs_fedavg"]:
        local, fed = report["smallest_site_local_vs_fedavg"]
        lines.append(f"- smallest inside site {smallest} ({report['train_slices'][smallest]} training slices): "
                     f"Local {local:.3f} vs FedAvg {fed:.3f}")
    for o, row in report["outside_single_site_models"].items():
        best = max(row, key=row.get)
        fed = report["outside_fedavg"].get(o)
        lines.append(f"- outside site {o} ({kinds[o]}): best single-site model local:{best} {row[best]:.3f}"
                     + (f", FedAvg (the mix) {fed:.3f}" if fed is not None else ""))
    return "\n".join(lines)


def report(workspace: str | Path | None = None, rounds: int | None = None, task: str = "prostate", seeds=(0,),
           preset: str | None = "bench", size: int | None = None, outside: list[str] | None = None, **_) -> str:
    """``pflseg report heterogeneity``: ``measure`` in ``workspace`` (default ``runs/heterogeneity``) for ``rounds``
    (default 20) on ``task``'s ``preset`` data (None: the plain generator) of the first of ``seeds``; its Markdown.
    Other keywords (the flags of other reports) are ignored."""
    return to_markdown(measure(workspace or "runs/heterogeneity", rounds or 20, task, seeds[0], preset=preset,
                               size=size, outside=outside))
