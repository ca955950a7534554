"""IOP-FL test-time routing at one outside site, with its comparators, scored and written.

Given the K local adapted models P_1..P_K and the global model w_g (the routing bundle) and a site's
images, :func:`route_site` runs, on all of them, unlabeled:

    global          w_g as trained (running batch-norm statistics)
    average         the experts' weight average (P_1..P_K, w_g)
    ensemble        the mean of the experts' probabilities
    tent            w_g with batch statistics, its norm affine parameters adapted by entropy minimisation
    routing_global  the paper's "IOP-FL (Global)" ablation: ONE coefficient per expert for the whole model,
                    shared by every layer and every sample (router ``model``)
    routing_layer   ours: one coefficient vector per layer, shared by the samples (router ``layer_global``)
    routing         the routed model with per-sample, per-layer routers (``iopfl.router``)

The adaptive ones (tent, routing_global, routing_layer, routing) run ``iopfl.epochs`` epochs of Adam through the
project's one training loop (``Hooks.step``) and keep, per sample, the prediction made at its lowest
unsupervised loss (``pflseg.algorithms.routing``). Labels, where present, only score. Per-case Dice and
the predictions' files (NIfTI per volume, PNG per 2D image) reuse ``pflseg.train.predictions``.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from pflseg.algorithms.iopfl import average_states
from pflseg.algorithms.routing import (
    BestPredictions,
    RoutedConv,
    build_routed_model,
    loss_weights,
    norm_affine_parameters,
    router_parameters,
    unsupervised_loss,
    use_batch_stats,
)
from pflseg.train.predictions import case_dice, case_names, write_predictions
from pflseg.train.loop import Hooks, make_loader, seed_everything, train_epochs

METHODS = ("global", "average", "ensemble", "tent", "routing_global", "routing_layer", "routing")


def _key(batch: dict, i: int) -> tuple:
    return (str(batch["site"][i]), str(batch["case"][i]), int(batch["slice"][i]))


def adapt(model: nn.Module, params: list, dataset: Dataset, device, weights: dict, cfg: dict, seed: int) -> tuple[BestPredictions, float]:
    """Adam on ``params`` for ``cfg["epochs"]`` epochs of the unsupervised loss over ``dataset`` (the one
    training loop with a custom step). Returns (per-sample lowest-loss predictions, seconds)."""
    optimizer = torch.optim.Adam(params, lr=cfg["lr"])
    best = BestPredictions()

    def step(m, batch, opt, _):
        opt.zero_grad(set_to_none=True)
        loss, probs = unsupervised_loss(m, batch["image"], weights, cfg["noise_std"], cfg["rot_flip"], cfg["shape_radius"])
        best.update([_key(batch, i) for i in range(len(batch["case"]))], loss, probs > 0.5)
        loss.mean().backward()
        opt.step()
        return float(loss.mean().detach())

    seed_everything(seed)
    loader = make_loader(dataset, cfg["batch_size"], shuffle=True, seed=seed)
    t0 = time.time()
    train_epochs(model, loader, optimizer, None, cfg["epochs"], device, Hooks(step=step))
    return best, time.time() - t0


def mean_coefficients(routed: nn.Module, dataset: Dataset, device, batch_size: int = 32) -> dict:
    """What a routed model learned to mix: the routing coefficients of every routed layer, averaged over the
    site's images, in expert order (P_1..P_K, w_g). Returns {"layers": [[E floats] per layer, forward order],
    "mean": [E floats] over the layers}."""
    layers = [m for m in routed.modules() if isinstance(m, RoutedConv)]
    sums = [torch.zeros(layers[0].n_experts, dtype=torch.float64) for _ in layers]
    count = 0

    def hook(i):
        def add(module, args):  # returns None: the layer's input stays as it is
            sums[i].add_(module.coefficients(args[0]).detach().double().sum(0).cpu())
        return add

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for batch in make_loader(dataset, batch_size, shuffle=False):
                routed(batch["image"].to(device))
                count += batch["image"].shape[0]
    finally:
        for h in handles:
            h.remove()
    per_layer = [(s / count).tolist() for s in sums]
    return {"layers": per_layer, "mean": (torch.stack([s / count for s in sums]).mean(0)).tolist()}


def route_site(experts: list[nn.Module], global_model: nn.Module, dataset: Dataset, device, cfg: dict, seed: int = 0,
               out_dir: str | Path | None = None, label_encoding: str = "nested", comparators: bool = True,
               batch_size: int = 32) -> dict:
    """Route ``dataset`` through the bundle and score every method (see the module docstring).

    Args:
        experts: the K local adapted models P_1..P_K (one architecture; logits (B, C, H, W)).
        global_model: w_g.
        dataset: the site's samples ({"image", "label", "case", "slice", "site", "has_label"}).
        cfg: the ``iopfl`` config section (router, loss_weights, beta, noise_std, rot_flip, shape_radius,
            epochs, lr, batch_size, norm_affine).
        out_dir: where the routing predictions are written (one file per case).
        comparators: also run global, average, ensemble, tent, routing_global, routing_layer.

    Returns:
        {"n_images", "n_cases", "methods": {name: {"dice", "dice_per_class", "per_case", "seconds"}},
        "predictions": str(out_dir) or None, "seconds_per_sample": routing adaptation per sample and epoch,
        "coefficients": {adaptive method: :func:`mean_coefficients`}}.
    """
    if len(dataset) == 0:
        raise ValueError("dataset: empty, nothing to route")
    device = torch.device(device)
    all_experts = [*experts, global_model]
    weights = loss_weights(cfg["loss_weights"], cfg["beta"])
    methods = list(METHODS) if comparators else ["routing"]
    preds: dict[str, dict] = defaultdict(dict)
    seconds: dict[str, float] = {}

    # one ordered pass: labels, and the non-adaptive comparators
    average = copy.deepcopy(global_model)
    average.load_state_dict(average_states([m.state_dict() for m in all_experts]))
    samples: dict[tuple, dict] = {}
    t0 = time.time()
    with torch.no_grad():
        for m in all_experts + [average]:
            m.to(device).eval()
        for batch in make_loader(dataset, batch_size, shuffle=False):
            x = batch["image"].to(device)
            out = {}
            if comparators:
                probs = [torch.sigmoid(m(x)) for m in all_experts]
                out = {"global": probs[-1] > 0.5, "ensemble": torch.stack(probs).mean(0) > 0.5,
                       "average": torch.sigmoid(average(x)) > 0.5}
            has_label = batch["has_label"].tolist() if torch.is_tensor(batch["has_label"]) else list(batch["has_label"])
            for i in range(x.shape[0]):
                key = _key(batch, i)
                samples[key] = {"case": key[:2], "slice": key[2], "has_label": bool(has_label[i]),
                                "label": batch["label"][i] > 0.5 if has_label[i] else None, "preds": {}, "choice": {}}
                for name, p in out.items():
                    preds[name][key] = p[i].cpu()
    static_s = time.time() - t0
    seconds.update({m: static_s for m in ("global", "average", "ensemble") if m in methods})

    adaptive = {"routing": cfg["router"], "routing_global": "model", "routing_layer": "layer_global"}
    coefficients = {}
    for name in [m for m in methods if m in adaptive]:
        routed = build_routed_model(all_experts, router=adaptive[name], norm_affine=cfg["norm_affine"]).to(device)
        params = router_parameters(routed) + (norm_affine_parameters(routed) if cfg["norm_affine"] else [])
        best, seconds[name] = adapt(routed, params, dataset, device, weights, cfg, seed)
        preds[name] = best.pred
        coefficients[name] = mean_coefficients(routed, dataset, device, batch_size)
    tent_note = None
    if "tent" in methods:
        tent = use_batch_stats(copy.deepcopy(global_model)).requires_grad_(False)
        params = norm_affine_parameters(tent)
        if params:
            for p in params:
                p.requires_grad_(True)
            best, seconds["tent"] = adapt(tent.to(device), params, dataset, device, {"ent": 1.0}, cfg, seed)
            preds["tent"] = best.pred
        else:
            tent_note = "the network's normalisation layers have no affine parameters: Tent has nothing to adapt"
            methods.remove("tent")

    by_case: dict[tuple, list] = defaultdict(list)
    for key, s in samples.items():
        for name in methods:
            if key not in preds[name]:
                raise RuntimeError(f"{name}: no prediction for sample {key} (its loss was never finite)")
            s["preds"][name] = preds[name][key]
            s["choice"][name] = name
        by_case[s["case"]].append(s)
    for items in by_case.values():
        items.sort(key=lambda s: s["slice"])
    names = case_names(list(by_case))
    result = {"n_images": len(samples), "n_cases": len(by_case), "methods": {}, "predictions": None,
              "seconds_per_sample": seconds["routing"] / (len(samples) * cfg["epochs"])}
    if tent_note:
        result["tent_note"] = tent_note
    if coefficients:
        result["coefficients"] = coefficients
    for name in methods:
        result["methods"][name] = {**case_dice(by_case, names, lambda s, n=name: n), "seconds": seconds[name]}
    if out_dir is not None:
        write_predictions(by_case, names, "routing", Path(out_dir), label_encoding)
        result["predictions"] = str(out_dir)
    return result
