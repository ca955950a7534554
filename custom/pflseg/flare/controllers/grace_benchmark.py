"""Server aggregation time of GRACE against FedAvg, side by side in one run.

    pflseg report grace-benchmark --sites 6 --repeats 5

K local models of a MONAI UNet of about 8 M parameters (channels 36..576, 2 residual units): the global
model plus Gaussian updates. Times (median of ``repeats``) FedAvg's weighted mean, ``grace_step`` in each
similarity mode, and the K x K cosine similarity alone, from one Gram matrix and from K^2 pairwise dot
products over the same stacked (K, P) updates (the naive way), on this machine's CPU.
"""

from __future__ import annotations

import statistics
import time

import torch

from pflseg.algorithms.fedavg import weighted_average
from pflseg.algorithms.grace import grace_keys, grace_step, similarity, update_vectors
from pflseg.config import load_job_config
from pflseg.markdown import markdown_table

NET = {"channels": [36, 72, 144, 288, 576], "strides": [2, 2, 2, 2], "num_res_units": 2}


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def naive_cosine(vectors: torch.Tensor) -> torch.Tensor:
    """K^2 dot products over the flattened updates, in float64 like the Gram path."""
    vectors = vectors.to(torch.float64)
    k = vectors.shape[0]
    out = torch.empty(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(k):
            out[i, j] = torch.dot(vectors[i], vectors[j]) / (vectors[i].norm() * vectors[j].norm())
    return out


def run(n_sites: int = 6, repeats: int = 5) -> dict:
    from pflseg.nets import build_net

    torch.manual_seed(0)
    net = build_net(load_job_config("grace", overrides={"net": NET})["net"])
    g = {k: v.detach().clone() for k, v in net.state_dict().items()}
    trainable, buffers = grace_keys(net)
    params = sum(p.numel() for p in net.parameters())
    states = [{k: (v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in g.items()}
              for _ in range(n_sites)]
    weights = [1.0 + i for i in range(n_sites)]
    vectors = update_vectors(g, states, trainable)
    times = {"fedavg": _median_seconds(lambda: weighted_average(states, weights), repeats)}
    for mode in ("total", "split", "reweight"):
        times[f"grace_{mode}"] = _median_seconds(
            lambda m=mode: grace_step(g, states, weights, mode=m, trainable_keys=trainable, buffer_keys=buffers),
            repeats)
    times["similarity_gram"] = _median_seconds(lambda: similarity(vectors, mode="total"), repeats)
    times["similarity_naive"] = _median_seconds(lambda: naive_cosine(vectors), repeats)
    gap = (similarity(vectors, mode="total") - naive_cosine(vectors)).abs().max().item()
    return {"sites": n_sites, "parameters": params, "threads": torch.get_num_threads(), "seconds": times,
            "max_abs_difference_gram_vs_naive": gap}


def to_markdown(report: dict) -> str:
    t = report["seconds"]
    lines = [f"K = {report['sites']} sites, UNet of {report['parameters'] / 1e6:.2f} M parameters, "
             f"{report['threads']} torch threads (median seconds)", "",
             markdown_table(["step", "seconds", "/ FedAvg"],
                            [[n, f"{sec:.4f}", f"{sec / t['fedavg']:.2f}"] for n, sec in t.items()])]
    lines.append(f"\nGram vs naive similarity: max |difference| {report['max_abs_difference_gram_vs_naive']:.2e}, "
                 f"naive / Gram time {t['similarity_naive'] / t['similarity_gram']:.2f}")
    return "\n".join(lines)


def report(sites: int | None = None, repeats: int = 5, **_) -> str:
    """``pflseg report grace-benchmark``: ``run`` with ``sites`` (default 6) sites and ``repeats`` timings; its
    Markdown. Other keywords (the flags of other reports) are ignored."""
    return to_markdown(run(sites or 6, repeats))
