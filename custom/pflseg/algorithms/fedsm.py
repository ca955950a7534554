"""FedSM (Xu et al., CVPR 2022): the pure pieces of the model selector, apart from SoftPull.

The trained "super model" is (w_g, {w_p,k}, w_s). The selector w_s is a classifier over sites.

Selector input (``selector_view``)
    The segmentation nets see each image z-scored per image, which removes the brightness and contrast
    that tell scanners apart. The selector sees, with ``intensity`` (default), one site-independent rule
    applied to the image in its file's own units: x_s = asinh(x_raw), x_raw = z * std + mean (the per-image
    mean and std the data set keeps beside the z-scored image). asinh is linear near 0 and logarithmic
    beyond, so images in 0..1, 0..255 or 0..4000 units all land in |x_s| < ~10 with no constant to tune,
    and a scanner's gain becomes an offset the selector can read. ``zscore``: the segmentation input.

How the selector learns (``fedsm.selector_fit``, ``fedsm.selector_steps``)
    Every sample of site k has selector label k, so a site's local optimum is "always class k": with
    local steps (the paper's per-batch Adam, ``batch``) the averaged selector swings to one site's class.
    ``softmax`` + ``epoch`` (the reference code's full-batch training made exact): each site sends the
    gradient of its summed cross-entropy at the received selector (``selector_gradient``), the server sums
    them and takes ONE Adam step with its own moments (``pooled_adam_step``): exactly one full-batch Adam
    step of centralised training on the pooled images, whatever the label skew. (The reference code steps
    at each site with averaged moments and averages the weights; Adam normalises each site's step to about
    lr per coordinate, so the average is an n_k-weighted vote of the sites' gradient signs, not the pooled
    step.) One step a round is a small budget, though: measured, it separates sites slowly.
    ``lda`` (default): a closed-form classifier from per-site sufficient statistics, the approach of
    closed-form federated classifiers (Fed3R, Fani et al., ICML 2024; class means as in FedNCM, Legate
    et al., NeurIPS 2023): each site sends, for features phi(x) of its images (the selector's conv stack,
    global-average pooled, at its seeded initialisation: random features), the Gram matrix sum phi phi^T,
    the per-class sums and counts (``class_statistics``); the server adds them (sums over sites equal the
    pooled data's, so label skew does not matter) and fits a Gaussian discriminant with one shared,
    shrunk covariance (``lda_head``): W_c = S^-1 mu_c, b_c = -mu_c^T S^-1 mu_c / 2 (equal priors).

Calibration (``nll_at_temperatures``, ``best_temperature``)
    A temperature T for the selector's softmax, softmax(f_s(x) / T), is fitted on the inside sites'
    validation splits: each site sums its validation NLL at every T of ``TEMPERATURES``; the server adds
    the sums and takes the T of lowest total (a grid search over a convex function of 1 / T).

Training labels
    FedSM:        y_s = k for every sample of site k; a K-way classifier (classes 0..K-1 = sites).
    FedSM-extra:  y_s = argmin over candidate models of the sample's segmentation loss; a (K+1)-way
                  classifier with class 0 = the global model and class k + 1 = personalized model of
                  site k (paper 3.1.2).

Server aggregation in ``batch`` mode (the selector's parameters are averaged by ``fedavg.weighted_average``)
    m <- sum_k p_k m_k   for the selector's Adam moments (exp_avg, exp_avg_sq, step): each site sees one
    class only, so the moments must be averaged too.

Inference (Algorithm 2)
    s = softmax(f_s(w_s; x) / T);  use w_p,argmax(s) if max(s) > gamma, else w_g.
    gamma = 0 always picks a personalized model (max(s) >= 1/K > 0); gamma = 1 always the global model.
    FedSM-extra needs no gamma: the argmax class says which model, class 0 being the global one.

Both routing rules return a *model choice* per sample in one convention: ``GLOBAL`` (-1) for the global
model, k in 0..K-1 for the personalized model of site k (so ``personalized[choice]`` indexes the list of
personalized models, in site order).

Mixing (``fedsm.mixing``: ``hard`` = the paper's Algorithm 2, default | ``soft``)
    Both give each image a weight vector w (K + 1,) over the models, column 0 = w_g, column k + 1 = w_p,k, and
    the prediction  p(x) = sum_m w_m sigmoid(f(w_m; x)) > 0.5:  a mix of the models' PROBABILITIES (the sigmoid
    outputs per class channel), never of their logits (``mix_probabilities``). ``hard``: w is the one-hot of the
    routed choice (``hard_weights``). ``soft`` (``mixing_weights``): the selector's posterior s weighs the
    personalized models, and a site whose posterior does not exceed gamma gives its share to the global model:

        w_p,k = s_k if s_k > gamma else 0;    w_g = sum_{k: s_k <= gamma} s_k    (so sum_m w_m = sum_k s_k = 1)

    gamma = 1: the global model alone (as hard); gamma = 0: the posterior-weighted mix of the personalized models;
    gamma >= 0.5: at most one site passes, so p = s_k* p_k* + (1 - s_k*) p_g when s_k* > gamma, else p_g. With a
    one-hot posterior soft equals hard at every gamma. FedSM-extra (``mixing_weights_extra``): the (K+1)-way
    posterior is the weight vector itself (its class 0 is the global model); no gamma.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from pflseg.algorithms.robust import aggregate

#: Model choice returned by ``route`` / ``route_extra`` for "use the global model w_g".
GLOBAL = -1

#: Class of the global model in the FedSM-extra selector; personalized model of site k is class k + 1.
EXTRA_GLOBAL_CLASS = 0

#: Values of ``fedsm.selector_fit`` and ``fedsm.selector_steps`` (see "How the selector learns").
SELECTOR_FITS = ("lda", "softmax")
SELECTOR_STEPS = ("epoch", "batch")


# ---------------------------------------------------------------------------------------------------
# Selector labels
# ---------------------------------------------------------------------------------------------------


def selector_labels_fedsm(site_index: int, n: int, num_sites: int | None = None) -> torch.Tensor:
    """FedSM selector labels of a batch of site ``site_index``: every sample gets class ``site_index``.

    Args:
        site_index: 0-based index of the site in the federation's (fixed) site order; class of the
            K-way selector.
        n: number of samples.
        num_sites: K; when given, ``site_index`` is checked to lie in [0, K).

    Returns:
        LongTensor (n,) filled with ``site_index``.
    """
    if isinstance(site_index, bool) or not isinstance(site_index, int) or site_index < 0:
        raise ValueError(f"site_index must be an int >= 0, got {site_index!r}")
    if num_sites is not None and site_index >= num_sites:
        raise ValueError(f"site_index must be < num_sites = {num_sites}, got {site_index}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return torch.full((n,), site_index, dtype=torch.long)


def extra_class_of_site(site_index: int) -> int:
    """Class of site ``site_index``'s personalized model in the FedSM-extra selector (``site_index + 1``)."""
    if isinstance(site_index, bool) or not isinstance(site_index, int) or site_index < 0:
        raise ValueError(f"site_index must be an int >= 0, got {site_index!r}")
    return site_index + 1


def selector_labels_extra(losses: torch.Tensor) -> torch.Tensor:
    """FedSM-extra selector labels: the candidate model with the lowest segmentation loss per sample.

    Args:
        losses: (B, K+1) per-sample segmentation losses against the ground truth; column 0 = global
            model, column k + 1 = personalized model of site k.

    Returns:
        LongTensor (B,) of classes in [0, K]; ties go to the lowest class, so to the global model first.

    Raises:
        ValueError: if ``losses`` is not 2-D with at least 2 columns, or holds NaN / inf.
    """
    if losses.ndim != 2 or losses.shape[1] < 2:
        raise ValueError(f"losses must have shape (B, K+1) with K >= 1, got {tuple(losses.shape)}")
    if not torch.isfinite(losses).all():
        raise ValueError("losses must be finite (a NaN loss would silently win the argmin)")
    return losses.detach().argmin(dim=1).to(torch.long)


# ---------------------------------------------------------------------------------------------------
# Inference routing
# ---------------------------------------------------------------------------------------------------


def route(probs: torch.Tensor, gamma: float) -> torch.Tensor:
    """FedSM inference rule (Algorithm 2): personalized model of the most likely site, if confident.

    Args:
        probs: (B, K) softmax probabilities of the K-way selector (rows sum to 1; apply softmax to the
            logits first).
        gamma: confidence threshold in [0, 1]; a personalized model is used only when max prob > gamma.

    Returns:
        LongTensor (B,): k in [0, K) = personalized model of site k, or ``GLOBAL`` (-1). Ties in the
        argmax go to the lowest site index.

    Raises:
        ValueError: naming ``gamma`` or ``probs`` when out of range or of the wrong shape.
    """
    gamma = _check_gamma(gamma)
    _check_probs(probs)
    top, site = probs.detach().max(dim=1)
    return torch.where(top > gamma, site.to(torch.long), torch.full_like(site, GLOBAL, dtype=torch.long))


def calibrate_gamma(folds: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    gammas: Sequence[float]) -> tuple[float, list[dict]]:
    """Gamma by leave-one-inside-site-out: the threshold whose super model scores best at held-out inside sites.

    Choosing gamma on the inside sites' own validation can only pick 0 (each site's own personalized model is best
    there). Here each fold is a federation trained WITHOUT one inside site h, scored at h, which then looks to the
    selector as an unseen site does: unfamiliar images should fall back to the global model. h's labels are
    validation data the federation owns; the judged outside sites are never used.

    Args:
        folds: per held-out site, (probs (N, K) the fold's selector softmax on h's N images, personal (N, K) the
            Dice of each of the fold's K personalized models on each image, global_ (N,) the global model's Dice).
        gammas: the thresholds tried, each in [0, 1].

    Returns:
        (the gamma of the highest mean over folds of the mean super-model Dice; ties keep the smaller gamma,
        [{"gamma", "dice" (the mean over folds), "per_fold": [...]} per gamma, in order]).
    """
    if not folds or not gammas:
        raise ValueError("calibrate_gamma needs at least one fold and one gamma")
    table: list[dict] = []
    for gamma in gammas:
        per_fold: list[float] = []
        for probs, personal, global_ in folds:
            if personal.shape != probs.shape or global_.shape != probs.shape[:1]:
                raise ValueError(f"folds: probs {tuple(probs.shape)}, personal {tuple(personal.shape)} and global "
                                 f"{tuple(global_.shape)} disagree (expected (N, K), (N, K), (N,))")
            choice = route(probs, gamma)
            mine = personal.gather(1, choice.clamp(min=0)[:, None])[:, 0]
            per_fold.append(float(torch.where(choice == GLOBAL, global_, mine).double().mean()))
        table.append({"gamma": float(gamma), "dice": sum(per_fold) / len(per_fold), "per_fold": per_fold})
    best = max(table, key=lambda row: (row["dice"], -row["gamma"]))
    return float(best["gamma"]), table


def route_extra(scores: torch.Tensor) -> torch.Tensor:
    """FedSM-extra inference rule: the argmax class names the model, class 0 being the global one.

    Args:
        scores: (B, K+1) logits or probabilities of the (K+1)-way selector (argmax is the same).

    Returns:
        LongTensor (B,) in the same convention as ``route``: ``GLOBAL`` (-1) when class 0 wins, else
        k = class - 1 = personalized model of site k. Ties go to the lowest class (global first).
    """
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must have shape (B, K+1) with K >= 1, got {tuple(scores.shape)}")
    return extra_class_to_choice(scores.detach().argmax(dim=1))


def extra_class_to_choice(classes: torch.Tensor) -> torch.Tensor:
    """Map FedSM-extra classes (0 = global, k + 1 = site k) to model choices (``GLOBAL``, k)."""
    return classes.to(torch.long) - 1  # class 0 -> -1 == GLOBAL


# ---------------------------------------------------------------------------------------------------
# Mixing: per-image model weights (column 0 = global, k + 1 = personalized k) and the mixed prediction
# ---------------------------------------------------------------------------------------------------

#: Values of ``fedsm.mixing`` (see "Mixing" in the module docstring).
MIXINGS = ("hard", "soft")


def hard_weights(choices: torch.Tensor, num_sites: int) -> torch.Tensor:
    """The one-hot weights of routed choices (``route`` / ``route_extra``).

    Args:
        choices: (B,) in {``GLOBAL``, 0..K-1}.
        num_sites: K.

    Returns:
        float32 (B, K+1): column 0 = global model, column k + 1 = personalized model k.
    """
    if choices.ndim != 1 or (choices.numel() and (choices.min() < GLOBAL or choices.max() >= num_sites)):
        raise ValueError(f"choices must be (B,) in [{GLOBAL}, {num_sites}), got shape {tuple(choices.shape)}")
    return torch.nn.functional.one_hot(choices.long() + 1, num_sites + 1).float()


def mixing_weights(probs: torch.Tensor, gamma: float) -> torch.Tensor:
    """Soft FedSM: each model's share of an image's prediction from the selector's posterior.

    w_p,k = s_k if s_k > gamma else 0;  w_g = sum of the s_k <= gamma (the sites the selector is not confident
    enough about give their share to the global model). Rows are renormalised to sum to exactly 1.

    Args:
        probs: (B, K) softmax probabilities of the K-way selector (after the temperature).
        gamma: threshold in [0, 1], the hard rule's (``route``): gamma = 1 gives the global model alone.

    Returns:
        float32 (B, K+1): column 0 = global model, column k + 1 = personalized model k; each row >= 0, summing to 1.
        A one-hot row of ``probs`` gives ``hard_weights(route(probs, gamma))``.

    Raises:
        ValueError: naming ``gamma`` or ``probs`` when out of range or of the wrong shape.
    """
    gamma = _check_gamma(gamma)
    _check_probs(probs)
    s = probs.detach().to(torch.float64)
    keep = s > gamma
    personal = torch.where(keep, s, torch.zeros_like(s))
    weights = torch.cat([(s - personal).sum(dim=1, keepdim=True), personal], dim=1)
    return (weights / weights.sum(dim=1, keepdim=True)).float()


def mixing_weights_extra(probs: torch.Tensor) -> torch.Tensor:
    """Soft FedSM-extra: the (K+1)-way posterior is the weight vector (class 0 = global model = column 0).

    Args:
        probs: (B, K+1) softmax probabilities of the FedSM-extra selector, K >= 1.

    Returns:
        float32 (B, K+1), rows renormalised to sum to exactly 1; a one-hot row gives ``hard_weights(route_extra)``.
    """
    if probs.ndim != 2 or probs.shape[1] < 2:
        raise ValueError(f"probs must have shape (B, K+1) with K >= 1, got {tuple(probs.shape)}")
    _check_probs(probs)
    s = probs.detach().to(torch.float64)
    return (s / s.sum(dim=1, keepdim=True)).float()


def mix_probabilities(probabilities: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The super model's probability map: per image, the weighted sum of the models' probabilities.

    Probabilities (sigmoid outputs, per class channel), not logits, are mixed: the result is the probability of a
    mixture of the models, and a model with weight 1 gives back its own map exactly (threshold it at 0.5 as usual).

    Args:
        probabilities: (B, M, C, H, W) the M = K + 1 models' probabilities in [0, 1], in the weights' column order
            (global model first).
        weights: (B, M) per image, >= 0, rows summing to 1 (``hard_weights``, ``mixing_weights``,
            ``mixing_weights_extra``).

    Returns:
        (B, C, H, W) in [0, 1], the dtype of ``probabilities``.

    Raises:
        ValueError: naming the argument: shapes that disagree, negative weights or rows not summing to 1.
    """
    if probabilities.ndim < 3 or weights.ndim != 2 or tuple(weights.shape) != tuple(probabilities.shape[:2]):
        raise ValueError(f"probabilities (B, M, ...) and weights (B, M) must agree, got {tuple(probabilities.shape)} "
                         f"and {tuple(weights.shape)}")
    w = weights.detach().to(torch.float64)
    if (w < 0).any() or not torch.allclose(w.sum(dim=1), torch.ones(w.shape[0], dtype=torch.float64), atol=1e-5):
        raise ValueError("weights: every row must be >= 0 and sum to 1")
    w = weights.to(probabilities.dtype).reshape(*weights.shape, *([1] * (probabilities.ndim - 2)))
    return (w * probabilities).sum(dim=1)


def _check_gamma(gamma: float) -> float:
    """``gamma`` as a float, refused (naming it) outside [0, 1]."""
    gamma = float(gamma)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    return gamma


def _check_probs(probs: torch.Tensor) -> None:
    if probs.ndim != 2 or probs.shape[1] < 1:
        raise ValueError(f"probs must have shape (B, K), got {tuple(probs.shape)}")
    if probs.numel() == 0:
        return
    p = probs.detach().to(torch.float64)
    if not torch.isfinite(p).all() or (p < 0).any() or (p > 1).any():
        raise ValueError("probs must be probabilities in [0, 1] (apply softmax to the selector's logits)")
    if not torch.allclose(p.sum(dim=1), torch.ones(p.shape[0], dtype=torch.float64), atol=1e-3):
        raise ValueError("probs: every row must sum to 1 (apply softmax to the selector's logits)")


# ---------------------------------------------------------------------------------------------------
# Selector optimizer moments
# ---------------------------------------------------------------------------------------------------


def average_moments(moments: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], rule: str = "mean",
                    trim: float = 0.0) -> dict:
    """n_k-weighted mean of the sites' selector optimizer moments, key by key.

    Args:
        moments: K flat dicts as made by ``flatten_optimizer_state`` (``"<i>.exp_avg"``,
            ``"<i>.exp_avg_sq"``, ``"<i>.step"``), same keys and shapes at every site.
        weights: K non-negative weights (n_k); normalised here.
        rule: ``mean`` (default) or a robust rule (``pflseg.algorithms.robust.aggregate``).
        trim: fraction trimmed at each end by ``trimmed_mean`` (``pflseg.algorithms.robust.trim_count``);
            ignored by the other rules.

    Returns:
        A new flat dict ``sum_k p_k m_k`` (or the rule's combination) (float64 accumulation, cast back to each
        dtype). Inputs are not modified.
    """
    if len(moments) == 0:
        raise ValueError("moments: need at least one site's moments")
    return aggregate(moments, weights, rule=rule, trim=trim)


def flatten_optimizer_state(state_dict: Mapping) -> dict[str, torch.Tensor]:
    """Flatten a torch optimizer ``state_dict()`` (e.g. Adam's) into ``{"<param_index>.<name>": tensor}``.

    Args:
        state_dict: ``optimizer.state_dict()``: ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"}},
            "param_groups": [...]}``. Hyperparameters (``param_groups``) are not included: they come
            from the config at the receiving end.

    Returns:
        A new flat dict of detached tensor copies; a Python number (old-style ``step``) becomes a 0-d
        float32 tensor. Parameters without state (never stepped) have no keys.
    """
    if "state" not in state_dict:
        raise ValueError("state_dict: expected an optimizer state_dict with a 'state' entry")
    flat: dict[str, torch.Tensor] = {}
    for index, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            if "." in name:
                raise ValueError(f"state_dict: state name '{name}' of parameter {index} contains '.'")
            if torch.is_tensor(value):
                flat[f"{int(index)}.{name}"] = value.detach().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"{int(index)}.{name}"] = torch.tensor(float(value), dtype=torch.float32)
            else:
                kind = type(value).__name__
                raise ValueError(f"state_dict: state '{name}' of parameter {index} is {kind}, not a tensor")
    return flat


def unflatten_optimizer_state(flat: Mapping[str, torch.Tensor], param_groups: Sequence[Mapping]) -> dict:
    """Inverse of ``flatten_optimizer_state``: a state dict for ``optimizer.load_state_dict``.

    Args:
        flat: ``{"<param_index>.<name>": tensor}``.
        param_groups: the receiving optimizer's ``optimizer.state_dict()["param_groups"]`` (hyperparameters
            and parameter indices); copied into the result.

    Returns:
        ``{"state": {i: {name: tensor}}, "param_groups": [...]}`` with tensor copies.

    Raises:
        ValueError: naming the key when it is not ``<int>.<name>`` or its index is not a parameter of
            ``param_groups``.
    """
    known = {int(i) for group in param_groups for i in group["params"]}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        index, sep, name = key.partition(".")
        if not sep or not name or not index.isdigit():
            raise ValueError(f"optimizer state key '{key}' is not of the form '<param_index>.<name>'")
        if int(index) not in known:
            raise ValueError(f"optimizer state key '{key}': parameter {index} is not in param_groups {sorted(known)}")
        state.setdefault(int(index), {})[name] = value.detach().clone()
    groups = [{k: (list(v) if k == "params" else v) for k, v in group.items()} for group in param_groups]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


# ---------------------------------------------------------------------------------------------------
# Selector input
# ---------------------------------------------------------------------------------------------------

#: Values of ``fedsm.selector_input``.
SELECTOR_INPUTS = ("intensity", "zscore")


def selector_view(image: torch.Tensor, intensity: torch.Tensor | None, mode: str) -> torch.Tensor:
    """What the selector sees of a batch (see the module docstring).

    Args:
        image: (B, C, H, W) images z-scored per image and channel (the segmentation input).
        intensity: (B, C, 2) per-image, per-channel (mean, std) that z-scoring removed; needed for
            ``intensity``, ignored for ``zscore``.
        mode: ``"intensity"``: asinh(image * std + mean), the image in its own units under one fixed rule;
            ``"zscore"``: ``image`` unchanged.

    Returns:
        (B, C, H, W) float tensor.

    Raises:
        ValueError: naming ``mode`` when unknown, ``intensity`` when missing or of the wrong shape.
    """
    if mode == "zscore":
        return image
    if mode != "intensity":
        raise ValueError(f"selector input mode {mode!r}: expected one of {SELECTOR_INPUTS}")
    if intensity is None:
        raise ValueError("intensity: the samples carry no per-image (mean, std) ('intensity' key of "
                         "pflseg.data.datasets items), needed for fedsm.selector_input: intensity")
    if intensity.shape != (*image.shape[:2], 2):
        raise ValueError(f"intensity must have shape (B, C, 2) = {(*image.shape[:2], 2)}, got {tuple(intensity.shape)}")
    mean, std = intensity[..., 0, None, None], intensity[..., 1, None, None]
    return torch.asinh(image * std.to(image.dtype) + mean.to(image.dtype))


# ---------------------------------------------------------------------------------------------------
# Full-batch softmax training: one Adam step on the pooled gradient
# ---------------------------------------------------------------------------------------------------


def selector_gradient(model: torch.nn.Module,
                      batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict, float]:
    """Gradient of the SUMMED cross-entropy over all ``batches`` at ``model``'s current parameters.

    Args:
        model: the selector (its ``.grad`` fields are overwritten; its train / eval mode is the caller's);
            images (B, C, H, W) -> logits (B, K).
        batches: (images, labels) pairs, labels LongTensor (B,).

    Returns:
        ``({parameter name: gradient}, summed loss)``: detached CPU copies, zeros for parameters without a
        gradient; sums of these over sites are the gradient of the pooled data's summed loss.
    """
    ce = torch.nn.CrossEntropyLoss(reduction="sum")
    model.zero_grad(set_to_none=True)
    total = 0.0
    for images, labels in batches:
        loss = ce(model(images), labels.to(images.device))
        loss.backward()
        total += float(loss.detach())
    grads = {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).cpu()
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, total


def pooled_adam_step(params: Mapping[str, torch.Tensor], grads: Sequence[Mapping[str, torch.Tensor]],
                     moments: Mapping[str, torch.Tensor], lr: float) -> tuple[dict, dict]:
    """One ``torch.optim.Adam`` step (default betas, eps) of ``params`` on the SUM of the sites' gradients.

    Args:
        params: the selector's parameters, in the module's parameter order (a state dict of a module
            without buffers); the Adam state is keyed by position in this order.
        grads: one dict per site, the same keys as ``params`` (``selector_gradient``).
        moments: the server's Adam state from the previous step, flat (``flatten_optimizer_state``:
            ``"<i>.exp_avg"``, ``"<i>.exp_avg_sq"``, ``"<i>.step"``); empty before the first step.
        lr: Adam's learning rate.

    Returns:
        ``(new params, new moments)``; inputs are not modified.

    Raises:
        ValueError: when no site's gradient is given or a gradient misses a parameter.
    """
    if len(grads) == 0:
        raise ValueError("grads: need at least one site's gradient")
    names = list(params)
    for g in grads:
        missing = [n for n in names if n not in g]
        if missing:
            raise ValueError(f"grads: a site's gradient misses parameter '{missing[0]}'")
    leaves = [torch.nn.Parameter(params[n].detach().clone()) for n in names]
    optimizer = torch.optim.Adam(leaves, lr=lr)
    if moments:
        optimizer.load_state_dict(unflatten_optimizer_state(moments, optimizer.state_dict()["param_groups"]))
    for leaf, name in zip(leaves, names):
        leaf.grad = sum((g[name].to(leaf.dtype) for g in grads), torch.zeros_like(leaf))
    optimizer.step()
    return {n: leaf.detach().clone() for n, leaf in zip(names, leaves)}, flatten_optimizer_state(optimizer.state_dict())


# ---------------------------------------------------------------------------------------------------
# Closed-form (LDA) selector head from per-site sufficient statistics
# ---------------------------------------------------------------------------------------------------


def class_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Sufficient statistics of one site's features for ``lda_head`` (float64).

    Args:
        features: (N, D) features of the site's training images.
        labels: (N,) classes in [0, num_classes).
        num_classes: C.

    Returns:
        ``{"gram": (D, D) sum_i phi_i phi_i^T, "sum": (C, D) per-class sums, "count": (C,) per-class counts}``;
        statistics of several sites (or batches) add up key by key (``add_statistics``).
    """
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError(f"features must be (N, D) and labels (N,), got {tuple(features.shape)} and "
                         f"{tuple(labels.shape)}")
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got {labels.min().item()}..{labels.max().item()}")
    phi = features.detach().to(torch.float64).cpu()
    onehot = torch.nn.functional.one_hot(labels.detach().long().cpu(), num_classes).to(torch.float64)
    return {"gram": phi.T @ phi, "sum": onehot.T @ phi, "count": onehot.sum(0)}


def add_statistics(stats: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Key-by-key sum of ``class_statistics`` dicts (of sites or of batches)."""
    if len(stats) == 0:
        raise ValueError("stats: need at least one set of statistics")
    return {key: sum((s[key] for s in stats), torch.zeros_like(stats[0][key])) for key in ("gram", "sum", "count")}


def check_statistics(stats: Mapping[str, torch.Tensor], n_k: int, own_class: int | None = None) -> str | None:
    """Why one site's ``class_statistics`` cannot be statistics of its ``n_k`` images, or None.

    The class counts must be whole, non-negative and sum to ``n_k``; with ``own_class`` (FedSM's rounds: every
    image of site k has class k) every other class's count and sum must be 0. The Gram matrix must be symmetric
    and, less each present class's n_c mu_c mu_c^T, positive semi-definite (a within-class scatter; up to 1e-6 of
    its trace): sums and Gram of one set of features. A site cannot add counts or means to other sites' classes.
    """
    count, sums, gram = (stats[k].detach().to("cpu", torch.float64) for k in ("count", "sum", "gram"))
    if (count < 0).any() or not torch.equal(count, count.round()) or int(count.sum()) != n_k:
        return f"class counts {count.tolist()} are not whole, non-negative and summing to n_k = {n_k}"
    if own_class is not None:
        other = torch.ones_like(count, dtype=torch.bool)
        other[own_class] = False
        foreign = torch.nonzero(other & ((count != 0) | (sums != 0).any(1))).flatten().tolist()
        if foreign:
            return f"statistics for class(es) {foreign}: a site's images all have its own class {own_class}"
    if not torch.allclose(gram, gram.T) or (gram.diagonal() < 0).any():
        return "the Gram matrix is not symmetric with a non-negative diagonal"
    present = count > 0
    mu = sums[present] / count[present, None]
    scatter = gram - (mu.T * count[present]) @ mu
    scatter = (scatter + scatter.T) / 2
    low = float(torch.linalg.eigvalsh(scatter).min()) if scatter.numel() else 0.0
    if low < -1e-6 * max(float(torch.trace(gram)), 1e-300):
        return (f"the Gram matrix less the class means' part has an eigenvalue {low:.3g} < 0: not the statistics "
                "of one set of features")
    return None


def scale_statistics(stats: Mapping[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    """``stats`` counted ``factor`` times (same class means and covariance, that much weight in the sum)."""
    return {key: value * factor for key, value in stats.items()}


#: Bias of a class that no site has samples of: never chosen.
ABSENT_CLASS_BIAS = -1e9


def lda_head(stats: Mapping[str, torch.Tensor], shrinkage: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear discriminant (shared covariance, equal priors) from pooled ``class_statistics``.

    mu_c = sum_c / n_c;  S = (gram - sum_c n_c mu_c mu_c^T) / N, shrunk: S <- (1 - a) S + a tr(S) / D I;
    W_c = S^-1 mu_c;  b_c = -mu_c^T S^-1 mu_c / 2. A class with n_c = 0 gets W_c = 0, b_c = ``ABSENT_CLASS_BIAS``.

    Args:
        stats: ``add_statistics`` of every site.
        shrinkage: a in (0, 1]: weight of the scaled identity (the covariance of a few hundred images in
            D = 128..512 dimensions is singular without it).

    Returns:
        ``(weight (C, D), bias (C,))`` float32, the ``nn.Linear`` that maps features to the class logits.
    """
    mu, scatter, present = _means_and_shrunk_covariance(stats, shrinkage)
    weight = torch.linalg.solve(scatter, mu.T).T
    bias = -0.5 * (weight * mu).sum(1)
    weight[~present], bias[~present] = 0.0, ABSENT_CLASS_BIAS
    return weight.float(), bias.float()


def _means_and_shrunk_covariance(stats: Mapping[str, torch.Tensor], shrinkage: float):
    """``(mu (C, D), S (D, D), present (C,))`` of ``lda_head``, float64; mu_c = 0 for an absent class."""
    if not 0.0 < shrinkage <= 1.0:
        raise ValueError(f"shrinkage must lie in (0, 1], got {shrinkage}")
    gram, sums, count = (stats[k].to(torch.float64) for k in ("gram", "sum", "count"))
    present = count > 0
    if not present.any():
        raise ValueError("stats: no class has any sample")
    d = gram.shape[0]
    mu = torch.zeros_like(sums)
    mu[present] = sums[present] / count[present, None]
    scatter = (gram - (mu[present].T * count[present]) @ mu[present]) / count.sum()
    scatter = (1.0 - shrinkage) * scatter + shrinkage * (torch.trace(scatter) / d) * torch.eye(d, dtype=scatter.dtype)
    return mu, scatter, present


# ---------------------------------------------------------------------------------------------------
# Familiarity: Mahalanobis distance to the nearest class of the LDA model (outside sites)
# ---------------------------------------------------------------------------------------------------


def lda_gaussians(stats: Mapping[str, torch.Tensor], shrinkage: float) -> dict[str, torch.Tensor]:
    """The Gaussian model behind ``lda_head``: the present classes' means and the shrunk shared precision.

    Same pooled statistics and same shrinkage as ``lda_head`` (mu_c = sum_c / n_c; S = (gram - sum_c n_c mu_c
    mu_c^T) / N, S <- (1 - a) S + a tr(S) / D I), so the distance below is measured in the geometry the
    selector's head was fitted in.

    Args:
        stats: pooled ``class_statistics`` (``add_statistics`` of every site), float64 preferred.
        shrinkage: a in (0, 1] (``fedsm.lda_shrinkage``).

    Returns:
        ``{"mean": (C', D) means of the C' classes with n_c > 0, "precision": (D, D) S^-1 (symmetric)}``,
        float64.

    Raises:
        ValueError: naming ``shrinkage`` out of (0, 1], or ``stats`` without any sample.
    """
    mu, scatter, present = _means_and_shrunk_covariance(stats, shrinkage)
    precision = torch.linalg.inv(scatter)
    return {"mean": mu[present].contiguous(), "precision": (0.5 * (precision + precision.T)).contiguous()}


def min_mahalanobis(features: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distance of each feature to the NEAREST class mean (d2_min; Lee et al., NeurIPS 2018).

    d2_min = min_c (phi - mu_c)^T P (phi - mu_c). A large value means the feature is unlike every class the
    selector was fitted on: an image the selector's posterior says nothing reliable about.

    Args:
        features: (N, D) selector features (``Selector.embed``).
        mean: (C, D) class means, C >= 1.
        precision: (D, D) shared precision (``lda_gaussians``).

    Returns:
        float64 (N,) on the CPU, each >= 0 (up to rounding) when ``precision`` is positive definite.
    """
    if features.ndim != 2 or mean.ndim != 2 or mean.shape[0] < 1 or features.shape[1] != mean.shape[1] \
            or precision.shape != (mean.shape[1], mean.shape[1]):
        raise ValueError("features (N, D), mean (C >= 1, D) and precision (D, D) must agree, got "
                         f"{tuple(features.shape)}, "
                         f"{tuple(mean.shape)} and {tuple(precision.shape)}")
    phi = features.detach().to(torch.float64).cpu()
    diff = phi[:, None, :] - mean.to(torch.float64).cpu()[None]  # (N, C, D)
    d2 = torch.einsum("ncd,de,nce->nc", diff, precision.to(torch.float64).cpu(), diff)
    return d2.min(dim=1).values


# ---------------------------------------------------------------------------------------------------
# Temperature of the selector's softmax, fitted on validation
# ---------------------------------------------------------------------------------------------------

#: The temperatures the validation NLL is summed at: 2^(k/4), k = -20..20 (0.031 .. 32).
TEMPERATURES: tuple[float, ...] = tuple(2.0 ** (k / 4) for k in range(-20, 21))


def nll_at_temperatures(logits: torch.Tensor, labels: torch.Tensor,
                        temperatures: Sequence[float] = TEMPERATURES) -> torch.Tensor:
    """Summed negative log-likelihood of ``labels`` under softmax(logits / T), for every T.

    Args:
        logits: (N, K) selector logits.
        labels: (N,) classes.
        temperatures: T > 0 values.

    Returns:
        float64 tensor (len(temperatures),); sums of several sites' add up.
    """
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"logits must be (N, K) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if any(not t > 0 for t in temperatures):
        raise ValueError(f"temperatures must be > 0, got {list(temperatures)}")
    z = logits.detach().to(torch.float64).cpu()
    y = labels.detach().long().cpu()
    t = torch.tensor(list(temperatures), dtype=torch.float64)[:, None, None]
    return torch.nn.functional.cross_entropy((z[None] / t).flatten(0, 1), y.repeat(len(temperatures)),
                                             reduction="none").view(len(temperatures), -1).sum(1)


def best_temperature(nll: Sequence[float], temperatures: Sequence[float] = TEMPERATURES) -> float:
    """The temperature of lowest summed NLL (ties: the one closest to 1, no rescaling)."""
    if len(nll) != len(temperatures) or len(nll) == 0:
        raise ValueError(f"nll: expected {len(temperatures)} values (one per temperature), got {len(nll)}")
    values = [float(v) for v in nll]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("nll: every value must be finite")
    return float(min(zip(values, temperatures), key=lambda vt: (vt[0], abs(math.log(vt[1]))))[1])
