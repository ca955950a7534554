"""IOP-FL test-time routing at one outside site, with its comparators, scored and written.

Given the K local adapted models P_1..P_K and the global model w_g (the routing bundle) and a site's images,
:func:`route_site` runs the routed models and every comparator (``NORM``: each method with its normalisation
treatment) on them, unlabeled; labels, where present, only score. What each method computes, the router variants'
settings (:func:`settings`), the step budget, the learning-rate grid, the diagnostics and mixed
precision (``train.amp``): pflseg/algorithms/METHODS.md, "IOP-FL", "Outside: test-time routing".
"""

from __future__ import annotations

import copy
import math
import time
from collections import defaultdict
from collections.abc import Sequence
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
    relative_distances,
    router_parameters,
    unsupervised_loss,
    use_batch_stats,
)
from pflseg.progress import Progress
from pflseg.train.evaluate import amp_forward, amp_model
from pflseg.train.loop import Hooks, amp_dtype, backward_step, make_loader, seed_everything, train_epochs
from pflseg.train.predictions import case_dice, case_names, case_sources, write_predictions

#: every method :func:`route_site` scores, in table order, with its normalisation treatment (METHODS.md)
NORM = {"global": "running", "global_bn": "batch", "average": "running", "average_bn": "batch",
        "ensemble": "running", "ensemble_bn": "batch", "tent": "batch", "tent_epochs": "batch",
        "tent_average": "batch", "routing_global": "batch", "routing_layer": "batch", "routing": "batch",
        "routing_final": "batch"}
METHODS = tuple(NORM)
#: the methods scored beside routing (``iopfl.comparators``'s default: every one)
COMPARATORS = tuple(m for m in METHODS if m not in ("routing", "routing_final"))
#: the routing variants' display names, the one naming of every table (bench, demo, ``pflseg run``) and docs/methods.md
LABELS = {"routing": "IOP-FL routing", "routing_global": "IOP-FL routing (Global)",
          "routing_layer": "IOP-FL routing (per layer, ours)", "routing_final": "IOP-FL routing (final model)"}


def _key(batch: dict, i: int) -> tuple:
    return (str(batch["site"][i]), str(batch["case"][i]), int(batch["slice"][i]))


class StaticComparators(nn.Module):
    """The non-adaptive comparators under both normalisation treatments.

    Args:
        experts: [P_1, ..., P_K, w_g], one architecture (image (B, C_in, H, W) -> logits (B, C, H, W)). They are
            held, not copied (``.to`` and ``.eval`` apply to them); the batch-statistics versions are copies.
        amp: ``train.amp`` of the forward passes (METHODS.md).

    ``forward(images)``: images (B, C_in, H, W) -> {method: (B, C, H, W) sigmoid probabilities} for ``global``,
    ``average``, ``ensemble`` (running statistics) and ``global_bn``, ``average_bn``, ``ensemble_bn`` (the
    statistics of ``images``), and every expert alone, ``expert<e>`` and ``expert<e>_bn`` (e = 0..E-1, in
    expert order; diagnostics, not methods).
    """

    NAMES = ("global", "average", "ensemble", "global_bn", "average_bn", "ensemble_bn")

    def __init__(self, experts: Sequence[nn.Module], amp: str = "off"):
        super().__init__()
        self.amp = amp
        average = copy.deepcopy(experts[-1])
        average.load_state_dict(average_states([m.state_dict() for m in experts]))
        self.running = nn.ModuleList([*experts, average])
        self.batch = nn.ModuleList([use_batch_stats(copy.deepcopy(m)) for m in self.running])
        self.eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        dtype = amp_dtype(self.amp, images.device)
        for suffix, models in (("", self.running), ("_bn", self.batch)):
            probs = [torch.sigmoid(amp_forward(m, images, dtype)) for m in models]  # P_1..P_K, w_g, average
            out[f"global{suffix}"], out[f"average{suffix}"] = probs[-2], probs[-1]
            out[f"ensemble{suffix}"] = torch.stack(probs[:-1]).mean(0)
            out.update({f"expert{e}{suffix}": p for e, p in enumerate(probs[:-1])})
        return out


#: what a router variant does where the config leaves a key null (METHODS.md); an empty lr_grid = iopfl.lr.
#: Every variant adapts at ``iopfl.lr``: on validation outside sites the grid's lowest final loss picked 1e-1,
#: which scored below 1e-3 (``pflseg report routing-validation``; docs/benchmark.md)
_PAPER = {"loss_weights": "paper", "norm_affine": False, "rot_flip": False, "rest": "average", "lr_grid": []}
VARIANTS = {"paper": _PAPER, "normalised": dict(_PAPER),
            "refcode": {"loss_weights": "refcode", "norm_affine": True, "rot_flip": True, "rest": "global",
                        "lr_grid": []}}


def settings(cfg: dict) -> dict:
    """The effective routing settings of the ``iopfl`` config section: ``router``, and ``loss_weights``,
    ``norm_affine``, ``rot_flip``, ``rest``, ``lr_grid`` with null values taken from the router's variant
    (``VARIANTS``: ``refcode`` and ``normalised`` their own, every other router the paper's), the rates tried
    (``lr_grid``, [``lr``] when it is empty) and ``normalised`` (the coefficient routers of the ablations follow
    the ``normalised`` router)."""
    own = VARIANTS.get(cfg["router"], VARIANTS["paper"])
    out = {"router": cfg["router"], **{k: own[k] if cfg.get(k) is None else cfg[k] for k in own}}
    out["lr_grid"] = [float(x) for x in out["lr_grid"] or [cfg["lr"]]]
    out["normalised"] = cfg["router"] == "normalised"
    out["shape_reduction"] = cfg.get("shape_reduction", "mean")
    out["size_prior"] = float(cfg.get("size_prior", 0.0))
    return out


def budget(n_samples: int, cfg: dict) -> int:
    """Optimizer steps of one adaptation: ``iopfl.steps``, or when 0, ``iopfl.epochs`` passes of
    ceil(n_samples / ``iopfl.batch_size``) steps."""
    return cfg.get("steps") or cfg["epochs"] * math.ceil(n_samples / cfg["batch_size"])


def _loss(model, images: torch.Tensor, weights: dict, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsupervised loss with the routing config's settings (``cfg["prior"]``: the size prior, a (C,) tensor)."""
    return unsupervised_loss(model, images, weights, cfg["noise_std"], cfg["rot_flip"], cfg["shape_radius"],
                             cfg.get("shape_reduction", "mean"), cfg.get("prior"))


class _Steps:
    """``steps`` batches of ``loader``, pass after pass (each pass shuffled anew by the loader's generator)."""

    def __init__(self, loader, steps: int):
        self.loader, self.steps, self.dataset = loader, steps, loader.dataset

    def __iter__(self):
        left = self.steps
        while left > 0:
            for batch in self.loader:
                yield batch
                left -= 1
                if left == 0:
                    return


def adapt(model: nn.Module, params: list, dataset: Dataset, device, weights: dict, cfg: dict, seed: int,
          lr: float, steps: int, amp: str = "off", on_step=None, what: str = "test-time adaptation") -> dict:
    """Adam (``lr``) on ``params`` for ``steps`` optimizer steps of the unsupervised loss over ``dataset``, in
    batches of ``cfg["batch_size"]`` in a shuffled order seeded by ``seed``, pass after pass (the one training
    loop with a custom step). Each step predicts with the forward pass before its update. ``amp``: ``train.amp``
    (METHODS.md; fp16 on CUDA: a gradient scaler). ``on_step(model, step)``, when given, is called after
    every optimizer step (1, 2, ...; validation curves, ``pflseg.eval.routing_validation``). A progress line with
    an ETA (``pflseg.progress``, FLARE's log at the site) names ``what`` every 10 s of a long run.

    Returns:
        {"best": per-sample lowest-loss predictions ((C, H, W) bool each), "seconds", "steps", "visits":
        samples seen}.
    """
    optimizer = torch.optim.Adam(params, lr=lr)
    best = BestPredictions()
    visits, done = 0, 0
    progress = Progress(f"{what} at lr {lr:g}", total=steps, unit="steps")
    dtype = amp_dtype(amp, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

    def step(m, batch, opt, _):
        nonlocal visits, done
        opt.zero_grad(set_to_none=True)
        loss, probs = _loss(amp_model(m, dtype), batch["image"], weights, cfg)
        best.update([_key(batch, i) for i in range(len(batch["case"]))], loss, probs > 0.5)
        backward_step(loss.mean(), opt, scaler)
        visits += len(batch["case"])
        done += 1
        progress.step()
        if on_step is not None:
            on_step(m, done)
        return float(loss.mean().detach())

    seed_everything(seed)
    loader = _Steps(make_loader(dataset, cfg["batch_size"], shuffle=True, seed=seed), steps)
    t0 = time.time()
    stats = train_epochs(model, loader, optimizer, None, 1, device, Hooks(step=step))
    progress.done()
    return {"best": best, "seconds": time.time() - t0, "steps": stats["steps"], "visits": visits}


@torch.no_grad()
def final_loss(model: nn.Module, dataset: Dataset, device, weights: dict, cfg: dict, seed: int,
               reference: dict | None = None, amp: str = "off") -> tuple[float, float, float | None]:
    """Mean per-sample unsupervised loss of ``model`` (eval mode) over ``dataset``: one pass in the seeded
    shuffled batches of ``cfg["batch_size"]``, the noise seeded by ``seed`` (the same for every model).

    Args:
        reference: {sample key: (C, H, W) bool} (:func:`predict` of the starting model in the same batches), or None.
        amp: ``train.amp`` of the forward passes (METHODS.md).
    Returns:
        (the loss, the fraction of pixels predicted foreground: a label-free sign of a collapse, and the agreement
        with ``reference``: the Dice of the two predicted foregrounds pooled over every pixel of the site, 1.0 when
        both are empty; None without a reference).
    """
    was_training = model.training
    model.eval()
    forward = amp_model(model, amp_dtype(amp, device))
    seed_everything(seed)
    total, count, foreground, overlap, sizes = 0.0, 0, 0.0, 0.0, 0.0
    try:
        for batch in make_loader(dataset, cfg["batch_size"], shuffle=True, seed=seed):
            loss, probs = _loss(forward, batch["image"].to(device), weights, cfg)
            total += float(loss.double().sum())
            pred = (probs > 0.5).cpu()
            foreground += float(pred.flatten(1).double().mean(1).sum())
            count += loss.shape[0]
            if reference is not None:
                ref = torch.stack([reference[_key(batch, i)] for i in range(pred.shape[0])])
                overlap += float((pred & ref).sum())
                sizes += float(pred.sum() + ref.sum())
    finally:
        model.train(was_training)
    agreement = None if reference is None else (2 * overlap / sizes if sizes else 1.0)
    return total / count, foreground / count, agreement


def choose_lr(grid: Sequence[float], trial) -> tuple[float, list[dict]]:
    """The rate of ``grid`` to adapt at, from ``trial(lr)`` -> (final unsupervised loss, final foreground fraction):
    the lowest loss wins, ties keep the first, a non-finite loss never wins.

    Returns:
        (rate, [{"lr", "final_loss", "foreground"} per rate, grid order]).
    """
    table = []
    for lr in grid:
        loss, foreground = trial(lr)
        table.append({"lr": float(lr), "final_loss": float(loss), "foreground": float(foreground)})
    finite = [x for x in table if math.isfinite(x["final_loss"])]
    if not finite:
        raise FloatingPointError(f"routing: the unsupervised loss is not finite at any rate of iopfl.lr_grid "
                                 f"{list(grid)}; lower the rates")
    return min(finite, key=lambda x: x["final_loss"])["lr"], table


def _trainable(routed: nn.Module, norm_affine: bool) -> list:
    return router_parameters(routed) + (norm_affine_parameters(routed) if norm_affine else [])


def route_with_lr(build, dataset: Dataset, device, weights: dict, cfg: dict, seed: int,
                  reference: dict | None = None, amp: str = "off") -> tuple[nn.Module, dict]:
    """Adapt the routed model ``build()`` makes at the rate :func:`choose_lr` picks from the grid
    (METHODS.md), or at the one rate. Every model is built after ``seed_everything(seed)`` (one router init).

    Args:
        reference: the starting model's :func:`predict` (the agreement diagnostic), or None.
        amp: ``train.amp`` of the runs and their final losses (METHODS.md).

    Returns:
        (the adapted model, {"best", "seconds" (trials included), "steps", "visits", "run_seconds" (the run at
        the rate), "lr", "lr_grid": [{"lr", "final_loss", "foreground", "agreement"}] after ``lr_trial_steps``
        (None for one rate), "final_loss", "foreground" and "agreement" of the run at the rate}).
    """
    s = settings(cfg)
    steps = budget(len(dataset), cfg)
    trial_steps = min(cfg.get("lr_trial_steps") or steps, steps)
    runs: dict[float, tuple] = {}

    def run(lr, n):
        seed_everything(seed)
        model = build().to(device)
        out = adapt(model, _trainable(model, s["norm_affine"]), dataset, device, weights, cfg, seed, lr, n, amp,
                    what=f"routing ({s['router']}, {n} steps)")
        out["final_loss"], out["foreground"], out["agreement"] = final_loss(model, dataset, device, weights, cfg, seed,
                                                                            reference, amp)
        return model, out

    def trial(lr):
        runs[lr] = run(lr, trial_steps)
        return runs[lr][1]["final_loss"], runs[lr][1]["foreground"]

    grid = s["lr_grid"]
    if len(grid) == 1:
        model, out = run(grid[0], steps)
        return model, {**out, "run_seconds": out["seconds"], "lr": grid[0], "lr_grid": None}
    lr, losses = choose_lr(grid, trial)
    for entry in losses:
        entry["agreement"] = runs[entry["lr"]][1]["agreement"]
    spent = sum(r[1]["seconds"] for r in runs.values())
    model, out = runs[lr] if trial_steps == steps else run(lr, steps)
    runs.clear()
    run_seconds = out["seconds"]
    if trial_steps != steps:
        spent += run_seconds
    return model, {**out, "seconds": spent, "run_seconds": run_seconds, "lr": lr, "lr_grid": losses}


def tent(model: nn.Module, dataset: Dataset, device, cfg: dict, seed: int,
         steps: int | None = None, amp: str = "off") -> dict | None:
    """Tent (Wang et al., ICLR 2021) on ``model``, in place: batch statistics, only the normalisation layers'
    affine parameters trainable, Adam (``cfg["lr"]``) on the batch-mean binary entropy of the sigmoid outputs.

    ``steps=None`` is standard online Tent (``tent``): one pass over ``dataset`` in the seeded shuffled order
    of :func:`adapt`, each batch predicted before its own update. More steps (``tent_epochs``: the routing
    budget) keep per sample its lowest-entropy prediction. ``amp``: ``train.amp`` (METHODS.md, :func:`adapt`).

    Returns:
        As :func:`adapt`; None when the network's normalisation layers have no affine parameter.
    """
    use_batch_stats(model).requires_grad_(False)
    params = norm_affine_parameters(model)
    if not params:
        return None
    for p in params:
        p.requires_grad_(True)
    steps = steps or math.ceil(len(dataset) / cfg["batch_size"])
    return adapt(model.to(device), params, dataset, device, {"ent": 1.0}, cfg, seed, cfg["lr"], steps, amp)


@torch.no_grad()
def predict(model: nn.Module, dataset: Dataset, device, batch_size: int, seed: int, amp: str = "off") -> dict:
    """{sample key: (C, H, W) bool} of ``model`` (eval mode) in the seeded shuffled batches (batch statistics
    depend on them); ``amp``: ``train.amp`` of the forward passes (METHODS.md)."""
    was_training = model.training
    model.eval()
    dtype = amp_dtype(amp, device)
    out = {}
    try:
        for batch in make_loader(dataset, batch_size, shuffle=True, seed=seed):
            probs = torch.sigmoid(amp_forward(model, batch["image"].to(device), dtype))
            out.update({_key(batch, i): probs[i].cpu() > 0.5 for i in range(probs.shape[0])})
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def sample_coefficients(routed: nn.Module, dataset: Dataset, device, batch_size: int = 32,
                        amp: str = "off") -> list[torch.Tensor]:
    """The routing coefficients of every routed layer (forward order) for every image of ``dataset`` (in its
    order), routed in eval mode: [(N, E) float64 per layer], experts in order (P_1..P_K, w_g). ``amp``: ``train.amp``
    of the forward passes (METHODS.md): the coefficients as the routed model computes them under it."""
    layers = [m for m in routed.modules() if isinstance(m, RoutedConv)]
    rows: list[list] = [[] for _ in layers]

    def hook(i):
        def add(module, args):  # returns None: the layer's input stays as it is
            rows[i].append(module.coefficients(args[0]).detach().double().cpu())
        return add

    was_training = routed.training
    routed.eval()
    dtype = amp_dtype(amp, device)
    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for batch in make_loader(dataset, batch_size, shuffle=False):
            amp_forward(routed, batch["image"].to(device), dtype)
    finally:
        for h in handles:
            h.remove()
        routed.train(was_training)
    return [torch.cat(r) for r in rows]


def mean_coefficients(routed: nn.Module, dataset: Dataset, device, batch_size: int = 32,
                      start: list[torch.Tensor] | None = None, amp: str = "off") -> dict:
    """What a routed model learned to mix, over the site's images, in expert order (P_1..P_K, w_g).

    Returns:
        {"layers": [[E floats] mean per layer, forward order], "mean": [E floats] over the layers, "spread":
        [per layer: std over the images, mean over the experts]} and, given ``start`` (the
        :func:`sample_coefficients` of the model before adaptation), "movement": [per layer: mean over images
        and experts of |coef - coef_0|] and "movement_mean" (over the layers). ``amp``: as :func:`sample_coefficients`.
    """
    coefs = sample_coefficients(routed, dataset, device, batch_size, amp)
    out = {"layers": [c.mean(0).tolist() for c in coefs],
           "mean": torch.stack([c.mean(0) for c in coefs]).mean(0).tolist(),
           "spread": [float(c.std(0, unbiased=False).mean()) for c in coefs]}
    if start is not None:
        movement = [float((c - c0).abs().mean()) for c, c0 in zip(coefs, start)]
        out.update(movement=movement, movement_mean=sum(movement) / len(movement))
    return out


def _methods(comparators) -> list[str]:
    """The methods :func:`route_site` scores, in table order: ``routing`` and ``routing_final``, and the comparators
    named (``COMPARATORS`` or some of them; [] = routing only; an unknown name raises)."""
    unknown = [m for m in comparators if m not in COMPARATORS]
    if unknown:
        raise ValueError(f"iopfl.comparators: unknown {unknown}; known: {', '.join(COMPARATORS)}")
    return [m for m in METHODS if m in ("routing", "routing_final") or m in comparators]


def _first_pass(static: StaticComparators | None, dataset: Dataset, device, batch_size: int, seed: int,
                preds: dict[str, dict]) -> dict[tuple, dict]:
    """{sample key: its record (case, slice, label)} from one pass in the adaptive methods' seeded batches; the
    static comparators' predictions of the same pass go into ``preds`` ({name: {key: (C, H, W) bool}})."""
    samples: dict[tuple, dict] = {}
    for batch in make_loader(dataset, batch_size, shuffle=True, seed=seed):
        x = batch["image"].to(device)
        out = {name: p > 0.5 for name, p in static(x).items()} if static is not None else {}
        has_label = batch["has_label"].tolist() if torch.is_tensor(batch["has_label"]) else list(batch["has_label"])
        for i in range(x.shape[0]):
            key = _key(batch, i)
            samples[key] = {"case": key[:2], "slice": key[2], "has_label": bool(has_label[i]),
                            "label": batch["label"][i] > 0.5 if has_label[i] else None, "preds": {}, "choice": {}}
            for name, p in out.items():
                preds[name][key] = p[i].cpu()
    return samples


def _adapt_router(kind: str, experts: list[nn.Module], s: dict, dataset: Dataset, device, weights: dict, cfg: dict,
                  seed: int, batch_size: int, amp: str) -> tuple[nn.Module, dict, dict]:
    """One routed method: its starting model (after ``seed_everything(seed)``) measured, then :func:`route_with_lr`.

    Returns:
        (the adapted routed model, :func:`route_with_lr`'s run, the start: {"coef": :func:`sample_coefficients`,
        "loss", "foreground": :func:`final_loss`, "preds": :func:`predict`}).
    """
    def build():
        return build_routed_model(experts, router=kind, norm_affine=s["norm_affine"], rest=s["rest"],
                                  normalised=s["normalised"])

    seed_everything(seed)
    model = build().to(device)  # the routers' common start (one init for every rate)
    coef = sample_coefficients(model, dataset, device, batch_size, amp)
    loss, foreground, _ = final_loss(model, dataset, device, weights, cfg, seed, amp=amp)
    preds = predict(model, dataset, device, cfg["batch_size"], seed, amp)
    del model
    routed, run = route_with_lr(build, dataset, device, weights, cfg, seed, preds, amp)
    return routed, run, {"coef": coef, "loss": loss, "foreground": foreground, "preds": preds}


def _by_case(samples: dict[tuple, dict], preds: dict[str, dict], names: list[str]) -> dict[tuple, list]:
    """{case: its samples in slice order}, each sample given its prediction by every method of ``names``; a sample a
    method never predicted raises, naming both."""
    by_case: dict[tuple, list] = defaultdict(list)
    for key, smp in samples.items():
        for name in names:
            if key not in preds[name]:
                raise RuntimeError(f"{name}: no prediction for sample {key} (its loss was never finite)")
            smp["preds"][name] = preds[name][key]
            smp["choice"][name] = name
        by_case[smp["case"]].append(smp)
    for items in by_case.values():
        items.sort(key=lambda x: x["slice"])
    return by_case


def route_site(experts: list[nn.Module], global_model: nn.Module, dataset: Dataset, device, cfg: dict, seed: int = 0,
               out_dir: str | Path | None = None, label_encoding: str = "nested", comparators=COMPARATORS,
               batch_size: int = 32, amp: str = "off", prior: Sequence[float] | None = None) -> dict:
    """Route ``dataset`` through the bundle and score every method (METHODS.md, IOP-FL, outside).

    Args:
        experts: the K local adapted models P_1..P_K (one architecture; logits (B, C, H, W)).
        global_model: w_g.
        dataset: the site's samples ({"image" (C_in, H, W), "label", "case", "slice", "site", "has_label"}).
        cfg: the ``iopfl`` config section (router, loss_weights, norm_affine, rot_flip, rest, beta, noise_std,
            shape_radius, epochs, steps, lr, lr_grid, lr_trial_steps, batch_size). ``batch_size`` is every
            method's test batch.
        seed: the shuffled order of the batches (the same for every method), the router init and the noise.
        out_dir: where the routing predictions are written (one file per case).
        comparators: the methods scored beside routing (default: every one of ``COMPARATORS``; [] = routing only).
        batch_size: batch of :func:`mean_coefficients` (no gradient).
        amp: ``train.amp`` (off | bf16 | fp16) of every method's forward passes (METHODS.md).
        prior: the size prior, one foreground fraction per class (the inside sites' training labels, shared with
            the bundle); needed when ``cfg["size_prior"]`` > 0.

    Returns:
        {"n_images", "n_cases", "methods": {name: {"dice", "dice_per_class", "per_case", "seconds"}},
        "norm": {name: "running" | "batch"} for every method scored, "predictions": str(out_dir) or None,
        "seconds_per_sample": routing's kept run per sample visit (per sample and pass), "coefficients":
        {routed method: :func:`mean_coefficients` with its movement}, "diagnostics" (METHODS.md) and
        "tent_note" when Tent had nothing to adapt (tent and tent_epochs are then not scored)}.
    """
    if len(dataset) == 0:
        raise ValueError("dataset: empty, nothing to route")
    device = torch.device(device)
    all_experts = [*experts, global_model]
    expert_names = [f"P_{k + 1}" for k in range(len(experts))] + ["w_g"]
    s = settings(cfg)
    weights = loss_weights(s["loss_weights"], cfg["beta"], cfg["batch_size"], s["size_prior"])
    if s["size_prior"] and prior is None:
        raise ValueError("iopfl.size_prior > 0 needs the inside sites' foreground fractions, which this bundle does "
                         "not hold: route a bundle of a training run of this version, or set iopfl.size_prior: 0")
    prior_values = None if prior is None else [float(x) for x in prior]
    cfg = {**cfg, "rot_flip": s["rot_flip"], "shape_reduction": s["shape_reduction"],
           "prior": None if prior_values is None else torch.tensor(prior_values, device=device)}
    steps = budget(len(dataset), cfg)
    methods = _methods(comparators)
    preds: dict[str, dict] = defaultdict(dict)
    seconds: dict[str, float] = {}

    # one pass in the adaptive methods' batches: labels, and the non-adaptive comparators in both treatments
    static = StaticComparators(all_experts, amp).to(device) if set(methods) & set(StaticComparators.NAMES) else None
    t0 = time.time()
    samples = _first_pass(static, dataset, device, cfg["batch_size"], seed, preds)
    seconds.update(dict.fromkeys(preds, time.time() - t0))  # the static comparators share the one pass

    routers = {"routing": s["router"], "routing_global": "model", "routing_layer": "layer_global"}
    coefficients, adaptation, kept_seconds = {}, {}, {}
    for name in [m for m in methods if m in routers]:
        routed, run, start = _adapt_router(routers[name], all_experts, s, dataset, device, weights, cfg, seed,
                                           batch_size, amp)
        if name == "routing":  # its start, and the final routed model itself beside its per-sample lowest-loss ones
            preds["routing_step0"] = start["preds"]
            preds["routing_final"] = predict(routed, dataset, device, cfg["batch_size"], seed, amp)
            seconds["routing_final"] = run["seconds"]
        preds[name] = run["best"].pred
        seconds[name] = run["seconds"]
        kept_seconds[name] = run["run_seconds"] / run["visits"]
        coefficients[name] = mean_coefficients(routed, dataset, device, batch_size, start=start["coef"], amp=amp)
        adaptation[name] = {"lr": run["lr"], "lr_grid": run["lr_grid"], "steps": run["steps"],
                            "start_loss": start["loss"], "final_loss": run["final_loss"],
                            "start_foreground": start["foreground"], "foreground": run["foreground"],
                            "agreement": run["agreement"]}
    tent_note = None
    tent_steps = {"tent": None, "tent_epochs": steps, "tent_average": None}
    average = copy.deepcopy(global_model)
    average.load_state_dict(average_states([m.state_dict() for m in all_experts]))
    for name in [m for m in methods if m in tent_steps]:
        start_model = average if name == "tent_average" else global_model  # online Tent from w_g or the Average
        adapted = tent(copy.deepcopy(start_model), dataset, device, cfg, seed, tent_steps[name], amp)
        if adapted is None:
            tent_note = "the network's normalisation layers have no affine parameters: Tent has nothing to adapt"
            methods.remove(name)
            continue
        preds[name], seconds[name] = adapted["best"].pred, adapted["seconds"]

    extra = ["routing_step0"]
    if static is not None:
        extra += [f"expert{e}{t}" for e in range(len(all_experts)) for t in ("", "_bn")]
    by_case = _by_case(samples, preds, methods + extra)
    names = case_names(list(by_case))

    def dice(name):
        return case_dice(by_case, names, lambda _, n=name: n)["dice"]

    result = {"n_images": len(samples), "n_cases": len(by_case), "methods": {}, "norm": {m: NORM[m] for m in methods},
              "predictions": None, "seconds_per_sample": kept_seconds["routing"]}
    if tent_note:
        result["tent_note"] = tent_note
    result["coefficients"] = coefficients
    for name in methods:
        result["methods"][name] = {**case_dice(by_case, names, lambda _, n=name: n), "seconds": seconds[name]}
    result["diagnostics"] = {
        "settings": {**s, "steps": steps, "lr_trial_steps": min(cfg.get("lr_trial_steps") or steps, steps),
                     "loss_weights_values": weights, "prior": prior_values},
        "experts": {"names": expert_names, "relative_distance": relative_distances(all_experts),
                    **({"dice": [dice(f"expert{e}") for e in range(len(all_experts))],
                        "dice_bn": [dice(f"expert{e}_bn") for e in range(len(all_experts))]} if static is not None
                        else {})},
        "adaptation": adaptation,
        "start": {"routing": result["methods"]["routing"]["dice"], "routing_step0": dice("routing_step0"),
                  **({"average_bn": dice("average_bn")} if "average_bn" in methods else {})},
    }
    if out_dir is not None:
        write_predictions(by_case, names, "routing", Path(out_dir), label_encoding,
                          sources=case_sources(dataset))
        result["predictions"] = str(out_dir)
    return result
