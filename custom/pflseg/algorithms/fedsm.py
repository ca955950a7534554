"""FedSM (Xu et al., CVPR 2022): the pure pieces of the model selector, apart from SoftPull.

The trained "super model" is (w_g, {w_p,k}, w_s). The selector w_s is a classifier over sites.

Training labels
    FedSM:        y_s = k for every sample of site k; a K-way classifier (classes 0..K-1 = sites).
    FedSM-extra:  y_s = argmin over candidate models of the sample's segmentation loss; a (K+1)-way
                  classifier with class 0 = the global model and class k + 1 = personalized model of
                  site k (paper 3.1.2).

Server aggregation (the selector's parameters are averaged by ``fedavg.weighted_average``)
    m <- sum_k p_k m_k   for the selector's Adam moments (exp_avg, exp_avg_sq, step): each site sees one
    class only, so the moments must be averaged too.

Inference (Algorithm 2)
    s = softmax(f_s(w_s; x));  use w_p,argmax(s) if max(s) > gamma, else w_g.
    gamma = 0 always picks a personalized model (max(s) >= 1/K > 0); gamma = 1 always the global model.
    FedSM-extra needs no gamma: the argmax class says which model, class 0 being the global one.

Both routing rules return a *model choice* per sample in one convention: ``GLOBAL`` (-1) for the global
model, k in 0..K-1 for the personalized model of site k (so ``personalized[choice]`` indexes the list of
personalized models, in site order). See ../shared/reference/ALGORITHMS.md section 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pflseg.algorithms.fedavg import weighted_average

#: Model choice returned by ``route`` / ``route_extra`` for "use the global model w_g".
GLOBAL = -1

#: Class of the global model in the FedSM-extra selector; personalized model of site k is class k + 1.
EXTRA_GLOBAL_CLASS = 0


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
    gamma = float(gamma)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    _check_probs(probs)
    top, site = probs.detach().max(dim=1)
    return torch.where(top > gamma, site.to(torch.long), torch.full_like(site, GLOBAL, dtype=torch.long))


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


def average_moments(moments: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """n_k-weighted mean of the sites' selector optimizer moments, key by key.

    Args:
        moments: K flat dicts as made by ``flatten_optimizer_state`` (``"<i>.exp_avg"``,
            ``"<i>.exp_avg_sq"``, ``"<i>.step"``), same keys and shapes at every site.
        weights: K non-negative weights (n_k); normalised here.

    Returns:
        A new flat dict ``sum_k p_k m_k`` (float64 accumulation, cast back to each dtype). Inputs are not
        modified.
    """
    if len(moments) == 0:
        raise ValueError("moments: need at least one site's moments")
    return weighted_average(moments, weights)


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
