"""Pictures and tables of a run, written to ``<workspace>/results/``.

``write_results`` (every ``pflseg run``) writes ``val_dice.png`` (validation Dice per round, one line per site,
from ``results.json`` ``history``), ``test.md`` and ``test.csv`` (per-site test metrics of every model a site
scored) and ``overlays.md`` (the paths of the overlays each site drew of its own test cases, in its state
folder: ``<workspace>/state/<site>/<job>/overlays/``). Plots need matplotlib (``pip install -e ".[plots]"``);
without it the tables are still written and the runner says how to get the plots.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from pflseg.eval.tables import METRIC_COLUMNS, metric_rows, metric_table
from pflseg.flare.methods import METHODS
from pflseg.flare.state import private_dir

PLOTS_HINT = 'no plots: matplotlib is not installed (pip install "pflseg[plots]", or -e ".[plots]" in a checkout)'


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


#: a site's round metrics that score its personalized model, first found wins: the personalized model tracked
#: beside the global one (FedSM, IOP-FL), else the site's model after its local training (Local, FedBN, GRACE, LC-Fed)
PERSONAL_KEYS = ("val_dice_person", "val_dice_local")


def reported_key(results: dict) -> str:
    """The model a run's tables report per site: "site" (its personalized model) or "global" (``Method.site``)."""
    from pflseg.flare.methods import METHODS

    entry = METHODS.get(results.get("method", ""))
    return "site" if entry is not None and entry.site.personalized else "global"


def reported_val_dice(h: dict, key: str) -> dict[str, float]:
    """``{site: validation Dice}`` of one ``history`` round for the model of ``key``: "site": each site's personalized
    model (``PERSONAL_KEYS``), where the method scores one; else the global model (``val_dice``)."""
    if key == "site":
        for name in PERSONAL_KEYS:
            person = {s: float(v[name]) for s, v in (h.get("site_metrics") or {}).items()
                      if isinstance(v, dict) and isinstance(v.get(name), (int, float))}
            if person:
                return person
    return {s: float(d) for s, d in (h.get("val_dice") or {}).items() if d is not None}


def val_curves(results: dict) -> dict[str, list[tuple[int, float]]]:
    """``{site: [(round, validation Dice)]}`` of the model the run reports (``reported_key``) from
    ``results["history"]`` (rounds counted from 1)."""
    key, curves = reported_key(results), {}
    for h in results.get("history", []):
        for site, dice in sorted(reported_val_dice(h, key).items()):
            curves.setdefault(site, []).append((int(h["round"]), dice))
    return curves


def mean_curve(results: dict) -> list[tuple[int, float]]:
    """Validation Dice per round of the reported model, averaged over the sites that reported it."""
    key, out = reported_key(results), []
    for h in results.get("history", []):
        values = list(reported_val_dice(h, key).values())
        if values:
            out.append((int(h["round"]), sum(values) / len(values)))
    return out


def plot_lines(curves: dict[str, list[tuple[int, float]]], path: str | Path, title: str,
               ylabel: str = "validation Dice") -> Path:
    """One line per entry of ``curves`` ({label: [(round, value)]}) -> PNG at ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    from matplotlib.ticker import MaxNLocator

    markers = "os^Dvx*P"
    for i, (label, points) in enumerate(curves.items()):  # markers and shrinking widths: equal curves stay visible
        xs, ys = zip(*points) if points else ((), ())
        style = {"color": "black", "linestyle": "--"} if label == "mean" else {}
        ax.plot(xs, ys, marker=markers[i % len(markers)], markersize=6 - 0.5 * (i % 6), linewidth=2.5 - 0.25 * (i % 6),
                label=label, **style)
    ax.set(xlabel="round", ylabel=ylabel, title=title, ylim=(0, 1))
    rounds = sorted({x for points in curves.values() for x, _ in points})
    if rounds and rounds[-1] - rounds[0] < 10:  # a few rounds (one too): a tick on each, half a round of margin
        ax.set_xticks(range(int(rounds[0]), int(rounds[-1]) + 1))
        ax.set_xlim(rounds[0] - 0.5, rounds[-1] + 0.5)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    private_dir(path.parent)
    fig.savefig(path)
    plt.close(fig)
    return path


def overlay_paths(workspace: str | Path, job: str) -> dict[str, list[Path]]:
    """``{site: [PNG]}``: the overlays the sites of ``job`` drew in ``<workspace>/state/<site>/<job>/overlays``."""
    state = Path(workspace) / "state"
    out = {}
    for folder in sorted(state.glob(f"*/{job}/overlays")):
        site = folder.parent.parent.name
        if site != "server":
            out[site] = sorted(folder.glob("*.png"))
    return out


def write_results(results: dict, workspace: str | Path) -> list[str]:
    """Write ``<workspace>/results/`` (see the module docstring); return the lines to print."""
    workspace = Path(workspace)
    out = workspace / "results"
    private_dir(out)
    job = results.get("job", "job")
    lines, written = [], []
    entry = METHODS.get(results.get("method"))
    if entry is not None and entry.table is not None:  # post-training jobs: their table, predictions at the sites
        (out / f"{job}.md").write_text(entry.table(results) + "\n")
        written.append(out / f"{job}.md")
        for folder in sorted((workspace / "state").glob(f"*/{job}/predictions")):
            lines.append(f"predictions at {folder.parent.parent.name}: {folder}")
    if "report" in results:  # a job's own report (e.g. cross_site: FLARE's cross_val_results.json and its table)
        for name, content in results["report"].get("files", {}).items():
            (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
            written.append(out / name)
        (out / f"{job}.md").write_text(results["report"]["markdown"] + "\n")
        written.append(out / f"{job}.md")
    if results.get("test"):
        rows = metric_rows(results)
        (out / "test.md").write_text(metric_table(rows) + "\n")
        with open(out / "test.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
            w.writeheader()
            w.writerows(rows)
        written += [out / "test.md", out / "test.csv"]
    curves = val_curves(results)
    if curves:
        if have_matplotlib():
            mean = mean_curve(results)
            model = "personalized models" if reported_key(results) == "site" else "global model"
            written.append(plot_lines({**curves, "mean": mean}, out / "val_dice.png",
                                      f"{job}: validation Dice per site ({model})"))
        else:
            lines.append(PLOTS_HINT)
    overlays = overlay_paths(workspace, job)
    if overlays:
        listing = [f"- {site}: {p}" for site, paths in overlays.items() for p in paths]
        (out / "overlays.md").write_text("Overlays (image | ground truth | prediction), drawn at each site:\n\n"
                                         + "\n".join(listing) + "\n")
        written.append(out / "overlays.md")
        for site, paths in overlays.items():
            lines.append(f"overlays at {site}: {paths[0].parent}/ ({', '.join(p.name for p in paths)})")
    lines.insert(0, f"results: {', '.join(str(p) for p in written)}")
    return lines
