"""FedSM inference (Algorithm 2): the super model scored and its predictions written, per site.

The trained super model is (w_g, {w_p,k}, w_s) with the selector's temperature T (fitted on the inside
sites' validation splits during training). For every test sample x::

    s = softmax(f_s(w_s; v(x)) / T);  prediction = f(w_p,argmax(s); x) if max(s) > gamma else f(w_g; x)

where v is the selector's input rule (``pflseg.algorithms.fedsm.selector_view``: ``intensity`` or ``zscore``)
and T its temperature (``pflseg.algorithms.fedsm.route``). FedSM-extra uses a (K+1)-way selector whose argmax
names the model directly, class 0 being the global one (``route_extra``); no gamma.

Mixing (``mixing``: ``fedsm.mixing``, see "Mixing" in ``pflseg.algorithms.fedsm``): ``hard`` (default) is the rule
above. ``soft`` predicts each image with the weighted mix of every model's probabilities (sigmoid outputs, not
logits), ``sum_m w_m sigmoid(f(w_m; x)) > 0.5``, the weights w over [global, personalized 0..K-1] being the
selector's posterior with every site at or below gamma giving its share to the global model (``mixing_weights``;
FedSM-extra: the (K+1)-way posterior, ``mixing_weights_extra``). The fallback below sets an unfamiliar image's
weights to the global model alone under either mixing. Every route's ``selection`` is the mean weight per model
over the images (hard: the fraction of images routed to it) and ``selected`` counts images by their model of
largest weight (ties: the global model first, then the lowest site); the result says which ``mixing`` it used.

Familiarity fallback (outside sites; ``familiarity`` + ``familiar_tau``): the selector's posterior is only
meaningful for images like the ones its head was fitted on. With the LDA head's Gaussians (class means and
shared precision, ``pflseg.algorithms.fedsm.lda_gaussians``) every image gets d2_min, its squared
Mahalanobis distance to the nearest class mean (``min_mahalanobis``) in the selector's features
(``Selector.embed``); an image with d2_min > tau goes to the global model whatever the selector says, at every
gamma (and the extra route). The result then holds both: ``super`` with the fallback (the reported super model)
and ``super_nofallback`` as routed by the selector alone.

One pass over the dataset (in order, no shuffle) computes the selector's probabilities and the
``sigmoid(logits) > 0.5`` predictions of the models that any routing rule (or the report) needs for the
batch (soft: every model, and each route's mixed prediction); every gamma is then a choice of already computed
predictions. Dice is per case: a case's slices
are stacked in slice order into a (C, H, W, D) volume and scored by ``pflseg.train.evaluate.dice_scores``
(the project's one Dice). Only samples with ``has_label`` count for Dice; selection frequencies count
every sample.

Written predictions (``out_dir``): one file per case, the super model's prediction at ``save_gamma`` (or
the extra route), in the input file's geometry (``pflseg.train.predictions``): a NIfTI case -> ``<case>.nii.gz``,
uint8, the input's shape, affine and header; a PNG/JPEG case -> ``<case>.png``, uint8, the input's size. Pixel
value = class index: for the ``nested`` label encoding it is the *channel sum* (the number of positive
channels: fundus 0 = background, 1 = disc rim, 2 = cup); for ``exclusive`` it is c + 1 of the highest positive
channel c (0 where none).

Mixed precision (``amp``: ``train.amp``): every forward pass (selector, its features, the segmentation models) runs
under autocast on the models' device and its output is cast to float32 before the softmax, the temperature, the
distances and the sigmoid (``pflseg.train.evaluate.amp_forward``); off (the default) changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from pflseg.algorithms.fedsm import (
    GLOBAL,
    MIXINGS,
    hard_weights,
    min_mahalanobis,
    mix_probabilities,
    mixing_weights,
    mixing_weights_extra,
    route,
    route_extra,
    selector_view,
)
from pflseg.progress import Progress
from pflseg.train.evaluate import amp_forward
from pflseg.train.loop import amp_dtype, make_loader
from pflseg.train.predictions import case_dice, case_names, case_sources, write_predictions

#: Key of the FedSM-extra route in the result's ``"super"`` dict.
EXTRA = "extra"

#: Model key of the global model in the per-sample prediction store (personalized model k is k).
_G = GLOBAL

#: Suffix of a route's key for the selector's own choice when the familiarity fallback overrides it.
_RAW = ":raw"


def evaluate_super_model(
    global_model: nn.Module,
    personalized: Sequence[nn.Module],
    selector: nn.Module,
    dataset: Dataset,
    device: torch.device | str,
    gammas: Sequence[float] = (0.0, 0.5, 0.9, 0.99, 1.0),
    own_index: int | None = None,
    extra: bool = False,
    batch_size: int = 32,
    out_dir: str | Path | None = None,
    save_gamma: float = 0.9,
    label_encoding: str = "nested",
    selector_input: str = "zscore",
    temperature: float = 1.0,
    familiarity: dict | None = None,
    familiar_tau: float | None = None,
    amp: str = "off",
    mixing: str = "hard",
) -> dict:
    """Score the FedSM super model (and the global / own personalized model) on one site's data.

    Args:
        global_model: w_g; image (B, C_in, H, W) -> logits (B, C, H, W).
        personalized: the K personalized models w_p,k in site order (same input / output shapes).
        selector: w_s; image (B, C_in, H, W) -> logits (B, K), or (B, K+1) when ``extra`` (class 0 =
            global model, class k + 1 = personalized model k).
        dataset: items ``{"image": (C_in, H, W), "label": (C, H, W) in {0, 1}, "case": str, "slice": int,
            "site": str, "has_label": bool, "intensity": (C_in, 2)}`` (``site`` defaults to "" and
            ``has_label`` to True; ``intensity``, the per-image (mean, std), is needed for
            ``selector_input="intensity"`` only).
        device: where the models run.
        gammas: confidence thresholds in [0, 1] to report (ignored when ``extra``).
        own_index: index of this site's own personalized model (an inside site); its Dice is reported
            under ``"personalized"``. None (outside site): ``"personalized"`` is None.
        extra: FedSM-extra routing (``route_extra``), reported under the key ``"extra"``.
        batch_size: samples per forward pass.
        out_dir: when given, the super model's prediction at ``save_gamma`` (or the extra route) is
            written there per case (see the module docstring); created if missing.
        save_gamma: the threshold whose predictions are written (config default 0.9); need not be one
            of ``gammas``.
        label_encoding: "nested" (written value = channel sum) or "exclusive" (c + 1 of the highest
            positive channel), the dataset's label encoding.
        selector_input: what the selector sees (``selector_view``): "zscore" (the image as the models get it)
            or "intensity"; the trained run's rule.
        temperature: T > 0 of the selector's softmax (1 = none).
        familiarity: ``{"mean": (C, D), "precision": (D, D)}`` (``lda_gaussians``) of the selector's features;
            when given, every sample's d2_min is computed (``selector.embed`` must exist) and returned.
        familiar_tau: with ``familiarity``: samples with d2_min > tau go to the global model (the fallback);
            None: no fallback.
        amp: ``train.amp`` (off | bf16 | fp16) of the forward passes (module docstring).
        mixing: ``fedsm.mixing``: "hard" (one model per image, the paper's) or "soft" (the posterior-weighted mix
            of the models' probabilities; module docstring).

    Returns:
        ``{"n_images", "n_cases", "global": {"dice", "dice_per_class", "per_case"},
        "personalized": {...} or None, "super": {str(float(gamma)) or "extra": {"dice", "dice_per_class",
        "per_case", "selection", "selected"}}, "temperature", "mixing", "predictions": str(out_dir) or None}``.
        ``dice``
        is the mean over labelled cases and classes, ``dice_per_class`` the per-class mean over labelled
        cases; both are None (and ``per_case`` empty) when no sample has a label. ``selected`` has K + 1
        counts of images (the selection histogram; soft: by each image's model of largest weight): index 0 =
        global model, index k + 1 = personalized model k; ``selection`` the mean weight per model over all
        samples (hard: the fraction of samples routed to it; they sum to 1).
        ``n_cases`` counts all cases, labelled or not. ``per_case`` maps a case's file name (the
        sanitised case id, see ``out_dir``) to its per-class Dice. With ``familiarity`` also ``"d2_min"``:
        one float per sample in dataset order; with ``familiar_tau`` also ``"super_nofallback"`` (the ``super``
        entries without the fallback) and ``"fallback": {"tau", "n_fallback", "n_images"}``; ``super`` and the
        written predictions are then the fallback's.

    Raises:
        ValueError: naming the argument: empty ``personalized`` or dataset, a gamma outside [0, 1],
            ``own_index`` out of range, a selector output of the wrong shape, an unknown encoding,
            ``familiar_tau`` without ``familiarity`` or not a number >= 0, an unknown ``mixing``.
    """
    num_sites = len(personalized)
    _check_arguments(num_sites, len(dataset), own_index, mixing, label_encoding, temperature)
    routes = [EXTRA] if extra else [_gamma_key(g, "gammas") for g in gammas]
    if not routes:
        raise ValueError("gammas: need at least one gamma (or extra=True)")
    save_route = EXTRA if extra else _gamma_key(save_gamma, "save_gamma")
    all_routes = routes + ([save_route] if out_dir is not None and save_route not in routes else [])
    _check_fallback(familiarity, familiar_tau)

    device = torch.device(device)
    dtype = amp_dtype(amp, device)
    models = {_G: global_model, **dict(enumerate(personalized))}
    for m in (*models.values(), selector):
        m.to(device).eval()

    # Per sample: (site, case), slice, has_label, {prediction key: pred (C, H, W) bool}, label, route -> choice (the
    # key of its prediction: the model's under hard, the route's mixed one under soft), route -> weights (K + 1,).
    samples: list[dict] = []
    progress = Progress("FedSM super model: selector and models", total=len(dataset), unit="images")
    with torch.no_grad():
        for batch in make_loader(dataset, batch_size, shuffle=False):
            images = batch["image"].to(device)
            n = images.shape[0]
            progress.step(n)
            has_label = _as_bools(batch.get("has_label"), n)
            intensity = batch.get("intensity")
            seen = selector_view(images, intensity.to(device) if intensity is not None else None, selector_input)
            weights = _weights_batch(amp_forward(selector, seen, dtype) / float(temperature), all_routes, num_sites,
                                     extra, mixing)
            d2 = _distances(selector, seen, dtype, familiarity, n)
            if familiar_tau is not None:  # unfamiliar images: the global model, whatever the selector says
                weights = _fall_back(weights, d2, float(familiar_tau), num_sites)
            choices = ({r: [int(c) for c in w.argmax(dim=1) - 1] for r, w in weights.items()} if mixing == "hard"
                       else {r: [r] * n for r in weights})
            needed = _needed(has_label, choices, own_index, save_route if out_dir is not None else None)
            preds = _predictions(models, images, dtype, set().union(*needed), weights, num_sites)
            samples += _batch_samples(batch, has_label, needed, preds, choices, weights, d2)
    progress.done()

    by_case = _by_case(samples)
    names = case_names(list(by_case))
    result = {
        "n_images": len(samples),
        "n_cases": len(by_case),
        "global": case_dice(by_case, names, lambda s: _G),
        "personalized": None if own_index is None else case_dice(by_case, names, lambda s: own_index),
        "super": {},
        "temperature": float(temperature),
        "mixing": mixing,
        "predictions": None,
    }
    result["super"] = {r: _super_entry(by_case, names, samples, r, num_sites) for r in routes}
    if familiarity is not None:
        result["d2_min"] = [float(s["d2"]) for s in samples]
    if familiar_tau is not None:
        result["super_nofallback"] = {r: _super_entry(by_case, names, samples, r + _RAW, num_sites) for r in routes}
        fell = sum(1 for s in samples if s["d2"] > float(familiar_tau))
        result["fallback"] = {"tau": float(familiar_tau), "n_fallback": fell, "n_images": len(samples)}
    if out_dir is not None:
        write_predictions(by_case, names, save_route, Path(out_dir), label_encoding,
                          sources=case_sources(dataset))
        result["predictions"] = str(out_dir)
    return result


# ---------------------------------------------------------------------------------------------------
# Routing and scoring
# ---------------------------------------------------------------------------------------------------


def _check_arguments(num_sites: int, n_samples: int, own_index, mixing: str, label_encoding: str,
                     temperature: float) -> None:
    """Refuses, naming the argument, what ``evaluate_super_model`` cannot score (before any gamma)."""
    if num_sites < 1:
        raise ValueError("personalized: need at least one personalized model")
    if n_samples == 0:
        raise ValueError("dataset: empty dataset, nothing to evaluate")
    if own_index is not None and (isinstance(own_index, bool) or not isinstance(own_index, int)
                                  or not 0 <= own_index < num_sites):
        raise ValueError(f"own_index must be None or an int in [0, {num_sites}), got {own_index!r}")
    if mixing not in MIXINGS:
        raise ValueError(f"mixing={mixing!r}: expected one of {MIXINGS} (fedsm.mixing)")
    if label_encoding not in ("nested", "exclusive"):
        raise ValueError(f"label_encoding={label_encoding!r}: expected 'nested' or 'exclusive'")
    if not (float(temperature) > 0.0 and float(temperature) != float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_fallback(familiarity: dict | None, familiar_tau: float | None) -> None:
    """Refuses a familiarity fallback without the selector's Gaussians or with a tau that is not a number >= 0."""
    if familiar_tau is None:
        return
    if familiarity is None:
        raise ValueError("familiar_tau: the fallback needs familiarity (the selector's class means and precision)")
    if isinstance(familiar_tau, bool) or not float(familiar_tau) >= 0.0:
        raise ValueError(f"familiar_tau must be a number >= 0, got {familiar_tau!r}")


def _gamma_key(gamma, name: str) -> str:
    g = float(gamma)
    if not 0.0 <= g <= 1.0:
        raise ValueError(f"{name}: every gamma must lie in [0, 1], got {gamma!r}")
    return str(g)


def _weights_batch(logits: torch.Tensor, route_keys: Sequence[str], num_sites: int, extra: bool,
                   mixing: str) -> dict:
    """Selector logits (B, K) or (B, K+1) -> {route key: (B, K+1) weights over [global, personalized 0..K-1]}:
    one-hot of the routed choice (hard) or the posterior's mix (soft)."""
    want = num_sites + 1 if extra else num_sites
    if logits.ndim != 2 or logits.shape[1] != want:
        rule = "FedSM-extra needs K + 1" if extra else "FedSM needs K"
        raise ValueError(f"selector: output must have shape (B, {want}) ({rule} classes, K = {num_sites} "
                         f"personalized models), got {tuple(logits.shape)}")
    probs = torch.softmax(logits.detach().float(), dim=1).cpu()
    if extra:
        return {EXTRA: hard_weights(route_extra(probs), num_sites) if mixing == "hard" else mixing_weights_extra(probs)}
    if mixing == "hard":
        return {r: hard_weights(route(probs, float(r)), num_sites) for r in route_keys}
    return {r: mixing_weights(probs, float(r)) for r in route_keys}


def _distances(selector: nn.Module, seen: torch.Tensor, dtype, familiarity: dict | None, n: int) -> list:
    """Every image's d2_min to the selector's class Gaussians (``min_mahalanobis``); None each without them."""
    if familiarity is None:
        return [None] * n
    return min_mahalanobis(amp_forward(selector.embed, seen, dtype), familiarity["mean"],
                           familiarity["precision"]).tolist()


def _fall_back(weights: dict, d2: list, tau: float, num_sites: int) -> dict:
    """The routes' weights with every image farther than tau on the global model alone; the selector's own under
    ``<route>:raw``."""
    far = torch.tensor([v > tau for v in d2])[:, None]
    alone = hard_weights(torch.full((len(d2),), GLOBAL), num_sites)
    return {**{f"{r}{_RAW}": w for r, w in weights.items()},
            **{r: torch.where(far, alone, w) for r, w in weights.items()}}


def _needed(has_label: list[bool], choices: dict, own_index: int | None, save_route: str | None) -> list[set]:
    """Per image of a batch, the prediction keys it must keep: for Dice (labelled: the global, every route's
    choice, the own model) and for the written prediction (``save_route``; None: nothing written)."""
    needed: list[set] = [set() for _ in has_label]
    for i, labelled in enumerate(has_label):
        if labelled:
            needed[i].add(_G)
            needed[i].update(c[i] for c in choices.values())  # every route, with and without fallback
            if own_index is not None:
                needed[i].add(own_index)
        if save_route is not None:
            needed[i].add(choices[save_route][i])
    return needed


def _predictions(models: dict, images: torch.Tensor, dtype, keys: set, weights: dict, num_sites: int) -> dict:
    """A batch's ``sigmoid > 0.5`` predictions under the given keys: a model's (key k) or a soft route's mix (key
    r, which needs every model's probabilities); only the models the keys need run."""
    mixed = sorted(k for k in keys if isinstance(k, str))  # soft routes some sample needs
    preds = {}
    probs = {}
    for key in sorted(set(models) if mixed else keys):  # only models some sample of the batch needs
        probs[key] = torch.sigmoid(amp_forward(models[key], images, dtype)).cpu()
        preds[key] = probs[key] > 0.5
    if mixed:
        stacked = torch.stack([probs[k] for k in (_G, *range(num_sites))], dim=1)  # (B, K+1, C, H, W)
        for r in mixed:
            preds[r] = mix_probabilities(stacked, weights[r]) > 0.5
    return preds


def _batch_samples(batch: dict, has_label: list[bool], needed: list[set], preds: dict, choices: dict,
                   weights: dict, d2: list) -> list[dict]:
    """One per-sample record (see ``evaluate_super_model``) for every image of a batch."""
    sites = batch.get("site", [""] * len(has_label))
    return [{
        "case": (str(sites[i]), str(batch["case"][i])),
        "slice": int(batch["slice"][i]),
        "has_label": has_label[i],
        "preds": {k: preds[k][i] for k in needed[i]},
        "label": batch["label"][i] > 0.5 if has_label[i] else None,
        "choice": {r: c[i] for r, c in choices.items()},
        "weight": {r: w[i] for r, w in weights.items()},
        "d2": d2[i],
    } for i in range(len(has_label))]


def _by_case(samples: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Samples grouped by (site, case) in order of first appearance, each case's in slice order."""
    by_case: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in samples:
        by_case[s["case"]].append(s)
    for items in by_case.values():
        items.sort(key=lambda s: s["slice"])
    return by_case


def _super_entry(by_case: dict, names: dict, samples: list[dict], route_key: str, num_sites: int) -> dict:
    """Dice of the super model along one route, with its selection histogram (counts by largest weight) and the
    mean weight per model (``selection``; hard: the fractions of samples)."""
    entry = case_dice(by_case, names, lambda s: s["choice"][route_key])
    weights = torch.stack([s["weight"][route_key] for s in samples]).double()
    entry["selected"] = torch.bincount(weights.argmax(dim=1), minlength=num_sites + 1).tolist()
    entry["selection"] = [float(v) for v in weights.mean(dim=0)]
    return entry


def _as_bools(values, n: int) -> list[bool]:
    if values is None:
        return [True] * n
    if torch.is_tensor(values):
        return [bool(v) for v in values.tolist()]
    return [bool(v) for v in values]
