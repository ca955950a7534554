"""Does the routing objective track Dice? Routing variants judged on VALIDATION outside sites, never the judged ones.

Test-time routing (``pflseg.infer.routing``) can only choose its rate, its stopping point and its per-sample
predictions by its unsupervised loss. That choice is worth something only where a lower loss means a better
mask. This report measures it where labels may be used to choose: pseudo-outside sites the federation owns
(the generator's ``near_copy`` / ``extrapolate`` validation sites, or an inside site left out of a training run),
never the site a table judges.

For each variant (a set of ``iopfl`` overrides), each rate and each validation site it adapts the routed model of
a trained bundle from one start for the variant's step budget and, every ``every`` steps (and at step 0), records
the site's mean unsupervised loss (the variant's own, :func:`pflseg.infer.routing.final_loss`), the predicted
foreground fraction and the mean per-case Dice of the current routed model (labels score only). Per variant it
reports Spearman's rank correlation between loss and Dice over every (rate, step) point of every site (a loss that
tracks Dice gives a clearly negative rho), per site the Dice the loss would pick (the lowest-loss point and the
lowest final loss over the rates, which is what routing does) against the start, and how far the routers moved.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from torch.utils.data import ConcatDataset

from pflseg.algorithms.routing import build_routed_model, loss_weights
from pflseg.data import site_dataset
from pflseg.flare.methods import METHODS
from pflseg.flare.state import load_file, private_dir, unprefixed
from pflseg.flare.wire import GLOBAL, model_prefix
from pflseg.infer.routing import _trainable, adapt, budget, final_loss, predict, settings
from pflseg.markdown import markdown_table
from pflseg.nets import build_net
from pflseg.train.loop import seed_everything

#: the variants compared by default: today's loss (the paper's summed shape term), the per-pixel mean form, the mean
#: form with the size prior at two weights, and the reference code's entropy-dominant profile (with the prior)
VARIANTS = {
    "sum": {"shape_reduction": "sum", "size_prior": 0.0},
    "mean": {"shape_reduction": "mean", "size_prior": 0.0},
    "mean+prior1": {"shape_reduction": "mean", "size_prior": 1.0},
    "mean+prior10": {"shape_reduction": "mean", "size_prior": 10.0},
    "refcode": {"router": "refcode", "size_prior": 0.0},
}


def case_dice(preds: dict, labels: dict) -> float:
    """Mean over cases of the per-case Dice (slices of a case pooled, classes averaged; 1 when both are empty).

    ``preds`` and ``labels``: {(site, case, slice): (C, H, W) bool}."""
    inter: dict = {}
    sizes: dict = {}
    for key, p in preds.items():
        g = labels[key]
        case = key[:2]
        inter[case] = inter.get(case, 0) + (p & g).flatten(1).sum(1).double()
        sizes[case] = sizes.get(case, 0) + (p.flatten(1).sum(1) + g.flatten(1).sum(1)).double()
    per_case = [torch.where(sizes[c] > 0, 2 * inter[c] / sizes[c].clamp(min=1), torch.ones_like(sizes[c])).mean()
                for c in inter]
    return float(torch.stack(per_case).mean())


def _labels(dataset) -> dict:
    out = {}
    for i in range(len(dataset)):
        item = dataset[i]
        out[(str(item["site"]), str(item["case"]), int(item["slice"]))] = torch.as_tensor(item["label"]) > 0.5
    return out


def site_images(root: str | Path, site: str, size: int):
    """Every labelled image of ``site`` (its three splits), as an outside site sees them."""
    return ConcatDataset([site_dataset(root, site, split, size=size) for split in ("training", "validation",
                                                                                   "testing")])


def label_fraction(root: str | Path, sites: list[str], size: int) -> list[float]:
    """The size prior: per class, the mean over ``sites`` of each site's training-label foreground fraction."""
    fractions = []
    for site in sites:
        labels = torch.stack([torch.as_tensor(x["label"]).float()
                              for x in site_dataset(root, site, "training", size=size)])
        fractions.append(labels.transpose(0, 1).flatten(1).mean(1))
    return torch.stack(fractions).mean(0).tolist()


def _curve(experts, dataset, labels, cfg, rate, seed, every, prior, device="cpu") -> dict:
    s = settings(cfg)
    weights = loss_weights(s["loss_weights"], cfg["beta"], cfg["batch_size"], s["size_prior"])
    run_cfg = {**cfg, "rot_flip": s["rot_flip"], "shape_reduction": s["shape_reduction"],
               "prior": torch.tensor(prior)}
    steps = budget(len(dataset), cfg)
    seed_everything(seed)
    model = build_routed_model(experts, router=s["router"], norm_affine=s["norm_affine"], rest=s["rest"],
                               normalised=s["normalised"]).to(device)
    points = []

    def score(m, step):
        if step % every and step != steps:
            return
        rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        loss, fg, _ = final_loss(m, dataset, device, weights, run_cfg, seed)
        dice = case_dice(predict(m, dataset, device, cfg["batch_size"], seed), labels)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        points.append({"step": step, "loss": loss, "foreground": fg, "dice": dice})

    start = [p.detach().clone() for p in _trainable(model, s["norm_affine"])]
    score(model, 0)
    adapt(model, _trainable(model, s["norm_affine"]), dataset, device, weights, run_cfg, seed, rate, steps,
          on_step=score)
    moved = [float((p.detach() - p0).abs().mean()) for p, p0 in zip(_trainable(model, s["norm_affine"]), start)]
    return {"rate": rate, "points": points, "router_movement": sum(moved) / max(len(moved), 1)}


def validate_routing(bundle: str | Path, run_config: dict, data: str | Path, sites: list[str], variants: dict,
                     rates: list[float], every: int, seed: int = 0, steps: int = 0) -> dict:
    """The report's table (module docstring) for a routing ``bundle`` (``bundle.pt`` of an IOP-FL training run
    whose effective config is ``run_config``) at the validation ``sites`` of the data root ``data``."""
    b = load_file(Path(bundle))
    net_cfg, size = run_config["net"], run_config["data"]["size"]
    section = METHODS[run_config["method"]].sections[0]  # the run's routing settings: its method's own section
    experts = []
    for prefix in [model_prefix(s) for s in b["sites"]] + [GLOBAL]:
        net = build_net(net_cfg)
        net.load_state_dict(unprefixed(prefix, b))
        experts.append(net.eval())
    prior = label_fraction(data, list(b["sites"]), size)
    out = {"bundle": str(bundle), "inside": list(b["sites"]), "sites": sites, "prior": prior, "rates": rates,
           "variants": {}}
    for site in sites:
        dataset = site_images(data, site, size)
        labels = _labels(dataset)
        for name, over in variants.items():
            cfg = {**copy.deepcopy(run_config[section]), **over}
            if steps:
                cfg["steps"] = steps
            t0 = time.time()
            curves = [_curve(experts, dataset, labels, cfg, rate, seed, every, prior) for rate in rates]
            entry = out["variants"].setdefault(name, {"overrides": over, "sites": {}})
            start = curves[0]["points"][0]
            by_loss = min((p for c in curves for p in c["points"]), key=lambda p: p["loss"])
            final = min(curves, key=lambda c: c["points"][-1]["loss"])
            entry["sites"][site] = {
                "curves": curves, "start_dice": start["dice"], "start_foreground": start["foreground"],
                "lowest_loss_dice": by_loss["dice"], "lowest_final_loss": {"rate": final["rate"],
                                                                           "dice": final["points"][-1]["dice"]},
                "rho": float(spearmanr([p["loss"] for c in curves for p in c["points"]],
                                       [p["dice"] for c in curves for p in c["points"]])[0]),
                "seconds": time.time() - t0}
    for entry in out["variants"].values():
        pts = [p for site in entry["sites"].values() for c in site["curves"] for p in c["points"]]
        # the sites' Dice levels differ: rank within each site, then pool (the mean of the per-site rhos)
        entry["rho_mean"] = float(np.mean([site["rho"] for site in entry["sites"].values()]))
        entry["n_points"] = len(pts)
    return out


def to_markdown(report: dict) -> str:
    """The report as a Markdown table: one row per variant and validation site."""
    rows = []
    for name, entry in report["variants"].items():
        for site, r in entry["sites"].items():
            chosen = next(c for c in r["curves"] if c["rate"] == r["lowest_final_loss"]["rate"])
            fg = chosen["points"][-1]["foreground"] / max(r["start_foreground"], 1e-12)
            rows.append([name, site, f"{r['rho']:+.2f}", f"{r['start_dice']:.3f}", f"{r['lowest_loss_dice']:.3f}",
                         f"{r['lowest_final_loss']['rate']:g}, {r['lowest_final_loss']['dice']:.3f}", f"{fg:.2f}",
                         f"{chosen['router_movement']:.3f}"])
    head = ["variant", "site", "rho(loss, Dice)", "start Dice", "Dice at lowest loss", "lowest final loss: rate, Dice",
            "final foreground / start", "router movement"]
    return (f"Routing objective vs Dice at validation outside sites {report['sites']} (bundle of {report['inside']}; "
            f"size prior {[round(x, 4) for x in report['prior']]}; rates {report['rates']})\n\n"
            + markdown_table(head, rows) + "\n")


def write(report: dict, out: Path) -> None:
    """``routing_validation.json`` and ``.md`` in ``out``."""
    private_dir(out)
    (out / "routing_validation.json").write_text(json.dumps(report, indent=1))
    (out / "routing_validation.md").write_text(to_markdown(report))


def check_sites(data: str | Path, sites: list[str], inside: list[str]) -> None:
    """Validation sites only: never a site of the bundle, never a generated site the bench judges (``blend``)."""
    profiles = json.loads((Path(data) / "dataset.json").read_text()).get("site_profiles", {})
    bad = [f"{s} trained in the bundle's federation" for s in sites if s in inside]
    bad += [f"{s} is the bench's judged outside site (blend): choosing on it would choose on the judged labels"
            for s in sites if profiles.get(s, {}).get("outside_kind") == "blend"]
    if bad:
        raise ValueError("--site-names: " + "; ".join(bad) + ". Use validation sites: a near_copy or "
                         "extrapolate outside site (pflseg data synth --outside near_copy extrapolate) or an inside "
                         "site left out of the training run")


def report(run: str | None = None, data: str | None = None, site_names: str | None = None, variants=None, rates=None,
           steps: int = 0, every: int = 0, seed: int = 0, out: str | None = None, **_) -> str:
    """``pflseg report routing-validation``: the table of :func:`validate_routing` for the IOP-FL training run in
    ``run`` (its workspace: ``run.json`` and the server's ``bundle.pt``), written to ``out`` (default ``run``)."""
    sites = [x for x in (site_names or "").split(",") if x]
    if not run or not data or not sites:
        raise ValueError("routing-validation needs --run (an IOP-FL training run's workspace), --data and "
                         "--site-names")
    ws = Path(run)
    record = ws / "run.json"
    bundles = sorted(ws.glob("state/server/*/bundle.pt"))
    if not record.is_file() or not bundles:
        raise ValueError(f"--run {run}: no run.json or state/server/<job>/bundle.pt there; give the workspace of a "
                         "finished `pflseg run iopfl` (iopfl.publish: true)")
    cfg = json.loads(record.read_text())["config"]
    inside = list(load_file(bundles[0])["sites"])
    check_sites(data, list(sites), inside)
    names = list(variants or VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    torch.set_num_threads(1)  # measured: 2 threads beside other work ran one step 4x slower
    result = validate_routing(bundles[0], cfg, data, list(sites), {v: VARIANTS[v] for v in names},
                              list(rates or [1e-3, 1e-2, 1e-1]), every or 38, seed, steps)
    write(result, Path(out or ws))
    return to_markdown(result)
