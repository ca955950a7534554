"""FedSM benchmark on synthetic data: inside and outside Dice, selection, bytes, time and memory.

    pflseg report fedsm-benchmark --workspace runs/fedsm_bench --rounds 20 --seeds 0 1

(``pflseg.eval.fedsm_benchmark`` runs it: it passes the simulator runner in, the FLARE layer runs no simulator.)

Per seed: FedAvg and FedSM trained on the 3 inside sites of a 4-site synthetic set (site-4 is the set's
"outside" site, a blend of the others' styles), then the FedSM inference job at all 4 sites. Reports
per-site test Dice of the FedAvg global, the FedSM personalized and super models (inside) and super vs
global at the outside site, selection frequencies; payload bytes per site per round with the compact
and the VGG-11 selector; wall time per round and peak memory of FedSM with 3 and 6 sites.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from pflseg.config import load_job_config
from pflseg.data import make_synthetic
from pflseg.flare.controllers.fedsm import moment_reference
from pflseg.flare.jobs import export_job
from pflseg.markdown import markdown_table
from pflseg.nets import build_net
from pflseg.nets.selector import build_selector, selector_cfg


def _bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def payload_bytes(selector: str, n_sites: int) -> dict:
    """Tensor bytes of one FedSM round for one site, each way: global + own personalized + selector +
    selector Adam moments (FLARE framing not included)."""
    cfg = load_job_config("fedsm", overrides={"fedsm": {"selector": selector}})
    seg = _bytes(build_net(cfg["net"]).state_dict())
    with torch.device("meta"):
        sel = build_selector(selector_cfg(cfg, n_sites))
    sel_bytes = sum(p.numel() * 4 for p in sel.state_dict().values())
    moments = sum(p.numel() * 4 for p in moment_reference(sel).values())
    return {"segmentation_model": seg, "selector": sel_bytes, "moments": moments,
            "per_round_each_way": 2 * seg + sel_bytes + moments}


def _timing(res: dict) -> dict:
    steady = res["history"][1:]
    return {"round_seconds": statistics.mean(h["wall_seconds"] for h in steady),
            "peak_rss_gib": res["footprint"]["peak_rss_gib"], "wall_seconds": res["footprint"]["wall_seconds"]}


#: ``simulate(label, job_dir, run_dir, n_sites, data) -> results``: runs an exported job in FLARE's simulator
Simulate = Callable[[str, Path, Path, int, Path], dict]


def run_count(seeds) -> int:
    """Simulator runs of ``run``: FedAvg, FedSM and its inference job per seed, then FedSM on 6 sites."""
    return 3 * len(seeds) + 1


def run(workspace: str | Path, simulate: Simulate, bundle: Callable[[Path, str], Path], rounds: int = 20,
        seeds=(0, 1)) -> dict:
    """The benchmark (module docstring) in ``workspace``, each job run by ``simulate``; ``bundle(run_dir, job)``: the
    server state folder of a training run, whose bundle the inference job reads. Writes ``fedsm_benchmark.json``."""
    ws = Path(workspace).resolve()
    data = make_synthetic(ws / "data4", n_sites=4, seed=0)
    report = {"seeds": {}, "bytes": {s: payload_bytes(s, 3) for s in ("compact", "vgg11")}}
    for seed in seeds:
        over = {"rounds": rounds, "min_clients": 3, "seed": seed}
        out = {}
        for name in ("fedavg", "fedsm"):
            job = export_job(name, ws / f"seed{seed}" / "jobs", overrides=over)
            out[name] = simulate(f"seed {seed}: {name}", job, ws / f"seed{seed}" / name, 3, data)
        trained = bundle(ws / f"seed{seed}" / "fedsm", "fedsm")
        job = export_job("fedsm_infer", ws / f"seed{seed}" / "jobs",
                         overrides={"fedsm": {"bundle": str(trained)}, "seed": seed})
        out["infer"] = simulate(f"seed {seed}: fedsm_infer", job, ws / f"seed{seed}" / "infer", 4, data)
        report["seeds"][seed] = {
            "fedavg_global": {s: m["global"]["dice"] for s, m in out["fedavg"]["test"].items()},
            "fedsm_personalized": {s: m["site"]["dice"] for s, m in out["fedsm"]["test"].items()},
            "infer": {s: {"global": m["global"]["dice"], "personalized": (m["personalized"] or {}).get("dice"),
                          "super": {g: r["dice"] for g, r in m["super"].items()},
                          "selection": {g: r["selection"] for g, r in m["super"].items()}}
                      for s, m in out["infer"]["infer"].items()},
            "timing_3_sites": _timing(out["fedsm"]),
        }
    six = make_synthetic(ws / "data6", n_sites=6, seed=0)
    job = export_job("fedsm", ws / "six" / "jobs", overrides={"rounds": 5, "min_clients": 6})
    report["timing_6_sites"] = _timing(simulate("fedsm on 6 sites (timing)", job, ws / "six" / "run", 6, six))
    (ws / "fedsm_benchmark.json").write_text(json.dumps(report, indent=1))
    return report


def to_markdown(report: dict, gamma: str = "0.9") -> str:
    rows = []
    for seed, r in report["seeds"].items():
        for site, m in sorted(r["infer"].items()):
            fa = r["fedavg_global"].get(site)
            fa = f"{fa:.4f}" if fa is not None else f"{m['global']:.4f} (FedSM global, outside)"
            pers = f"{m['personalized']:.4f}" if m["personalized"] is not None else "-"
            sel = ", ".join(f"{x:.2f}" for x in m["selection"][gamma])
            rows.append([seed, site, fa, pers, f"{m['super'][gamma]:.4f}", f"{m['super']['0.0']:.4f}", sel])
    lines = [markdown_table(["seed", "site", "FedAvg global", "FedSM personalized", f"FedSM super (gamma {gamma})",
                             "super gamma 0", f"selection at gamma {gamma} (global, p1..pK)"], rows)]
    for name, b in report["bytes"].items():
        lines.append(f"\n- payload per site per round, each way, {name} selector: "
                     f"{b['per_round_each_way'] / 2**20:.2f} MiB "
                     f"(segmentation models {2 * b['segmentation_model'] / 2**20:.2f}, selector "
                     f"{b['selector'] / 2**20:.2f}, "
                     f"moments {b['moments'] / 2**20:.2f})")
    t3 = statistics.mean(r["timing_3_sites"]["round_seconds"] for r in report["seeds"].values())
    m3 = max(r["timing_3_sites"]["peak_rss_gib"] for r in report["seeds"].values())
    t6 = report["timing_6_sites"]
    lines.append(f"- FedSM round wall time: 3 sites {t3:.2f} s (peak memory {m3:.2f} GiB); "
                 f"6 sites {t6['round_seconds']:.2f} s (peak memory {t6['peak_rss_gib']:.2f} GiB)")
    return "\n".join(lines)
