"""GRACE, client side (Zhang et al., MICCAI 2023): first-order meta-learning with feature alignment.

Per batch, with the round's global model phi_g frozen and h(x; theta) the feature map before the
segmentation head:

    B1, B2   = first / second half of the batch             (split=False: B1 = B2 = the batch)
    g        = grad L_task(theta; B1)
    theta'   = theta - inner_lr * D^-1 g                    (inner step, see below)
    L_meta   = L_task(theta'; B2) + beta * L_align( h(B2; theta'), h(B2; phi_g) )
    theta    <- optimizer step on theta with gradient G                               (first-order)
    G        = grad_theta' L_meta                                   (``meta_grad="meta"``: first-order MAML)
             = g + grad_theta' L_meta                               (``meta_grad="both"``: MLDG's objective)

The second-order term (d theta' / d theta) is dropped: the gradient taken at theta' is applied to theta.
The paper's Eq. 1-2 leave open whether the meta-train loss stays in the objective; its lineage (MLDG, Li et
al. AAAI 2018; FedDG-ELCFS, Liu et al. CVPR 2021) minimises L_task(theta; B1) + L_meta(theta'), whose
first-order gradient is the sum of the two plain gradients (``both``). ``meta`` is the form this project ran
first: the meta-train batch B1 then only shapes the inner step and its own gradient never reaches theta.

Inner step (``inner``). The paper writes a plain SGD step (``inner="sgd"``: D = 1). With an Adam outer
optimizer at lr 1e-3, an SGD step of the same size moves theta by 1e-3 * ||g||, orders of magnitude less
than one outer Adam step (about lr per coordinate), so theta' ~ theta and the meta-test sees the same
model. The default ``inner="adam"`` takes the step the outer Adam itself would take next if its gradient
were g, from its current moments (read, never written), at step size inner_lr:
    m'  = beta1 * m + (1 - beta1) * g,    v' = beta2 * v + (1 - beta2) * g^2      m, v, t: ``exp_avg``,
    D   = -inner_lr * (m' / (1 - beta1^(t+1))) / (sqrt(v' / (1 - beta2^(t+1))) + eps)   ``exp_avg_sq``, ``step``
so ||theta' - theta|| is the length of one outer step (``record`` logs both lengths). An earlier form kept
v' but dropped the first moment (g in place of m'): where a gradient spikes over a small v it moved a
coordinate up to lr / sqrt(1 - beta2) (31.6 lr at beta2 = 0.999): in the benchmark (5 sites, 40 rounds)
||theta' - theta|| grew to 1-3 while an outer step is 0.04-0.3, and the global model's validation Dice
fell from 0.31 to 0.02 for rounds; with this form the two lengths agree and the curve rises steadily. On an
empty state (first batch, or an optimizer without moments such as SGD) the step is Adam's first step,
inner_lr * g / (|g| + eps), of norm ~ inner_lr * sqrt(n_params).
The outer optimizer's state is read, never written.

Normalisation mode of the frozen global model. h(B2; phi_g) is computed with the normalisation layers of
phi_g in the same mode as the corresponding layers of the local model (train mode: the statistics of B2;
eval mode: running statistics), and every other module of phi_g (dropout) in eval mode; phi_g's buffers
(running statistics) are restored afterwards and its own modes too. So at theta' = phi_g (and no
dropout), the two feature maps are identical and L_align = 0; the earlier eval-mode extraction compared
batch-statistics features with running-statistics features and gave L_align != 0 there.

Honest special cases (tested): with beta = 0 and split=False the update is a plain optimizer step on the
batch with the gradient evaluated at theta' (not at theta); with inner_lr = 0 as well it is exactly one
plain optimizer step on the batch, normalisation running statistics included (the running statistics
are restored after the meta-train forward, so only the meta-test forward updates them, once).

``meta_step`` plugs into the one training loop as ``Hooks(step=functools.partial(meta_step, ...))``;
``record`` lets the caller log per round the mean inner-step length ||theta' - theta|| and the two terms of
L_meta apart: L_task(theta'; B2) and L_align (unweighted, before beta), so the alignment term's size and its
course over the rounds can be read beside the task loss (the returned L_meta mixes them through beta).
Pure torch, no I/O; the server side is in grace.py, the alignment losses in alignment.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

FeatureFn = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
AlignFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

INNER_STEPS = ("adam", "sgd")
META_GRADS = ("both", "meta")
_NORM = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)


def feature_layer(model: nn.Module) -> nn.Module:
    """The layer whose INPUT is the feature map h "before the segmentation head".

    Rule (by module type): the last ``nn.ConvTranspose2d`` registered in ``model``; if there is none,
    the last ``nn.Conv2d``. In MONAI's ``UNet`` (``pflseg.nets.build_unet``) the top up-sampling layer is
    registered last among the transposed convolutions and is the one that maps to ``out_channels``; its
    input is the concatenation of the first encoder level's output and the up-sampled decoder features,
    (B, d, H / strides[0], W / strides[0]). (The later full-resolution layers of MONAI's UNet have only
    ``out_channels`` channels, too few for a covariance to mean anything.)
    """
    last_transposed, last_conv = None, None
    for module in model.modules():
        if isinstance(module, nn.ConvTranspose2d):
            last_transposed = module
        elif isinstance(module, nn.Conv2d):
            last_conv = module
    layer = last_transposed if last_transposed is not None else last_conv
    if layer is None:
        raise ValueError(f"model: {type(model).__name__} has no Conv2d / ConvTranspose2d to take features from")
    return layer


def unet_features(
    model: nn.Module, images: torch.Tensor, full_resolution: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass returning the features before the head and the logits.

    Args:
        model: a 2-D segmentation network, e.g. MONAI ``UNet`` from ``pflseg.nets.build_unet``.
        images: (B, C, H, W).
        full_resolution: up-sample the features to (H, W) by nearest neighbour. Nearest up-sampling by
            an integer factor repeats every feature pixel equally often, so the empirical distribution
            of pixel samples that CORAL / MMD compare is unchanged (up to CORAL's N - 1).

    Returns:
        ``(features, logits)``: features (B, d, H, W) (or the layer's native resolution) taken at the
        input of :func:`feature_layer`, logits (B, out_channels, H, W); both from the same pass, with
        gradients.
    """
    layer = feature_layer(model)
    captured: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        logits = model(images)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"feature layer {type(layer).__name__} was not called in the forward pass")
    features = captured[-1]
    if full_resolution and features.shape[-2:] != images.shape[-2:]:
        features = F.interpolate(features, size=tuple(images.shape[-2:]), mode="nearest")
    return features, logits


def _halves(batch: dict, split: bool) -> tuple[dict, dict]:
    for key in ("image", "label"):
        if key not in batch:
            raise KeyError(f"batch: missing '{key}' (have {sorted(batch)})")
    images, labels = batch["image"], batch["label"]
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"batch: {images.shape[0]} images but {labels.shape[0]} labels")
    b = images.shape[0]
    if not split or b < 2:  # a single sample cannot be split: it serves as both halves
        whole = {"image": images, "label": labels}
        return whole, whole
    h = b // 2
    return {"image": images[:h], "label": labels[:h]}, {"image": images[h:], "label": labels[h:]}


def _param_groups(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_rate(name: str, value: float) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is finite and >= 0 (NaN fails)."""
    if not (value >= 0 and value != float("inf")):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def _copy_back(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each saved tensor of ``(live, saved)`` pairs back into its live tensor, outside autograd."""
    with torch.no_grad():
        for live, saved in pairs:
            live.copy_(saved)


@torch.no_grad()
def _sq_distance(params: Sequence[torch.Tensor], theta: Sequence[torch.Tensor]) -> float:
    """||params - theta||^2 over all tensors, summed in float64."""
    return float(sum((p - t).double().pow(2).sum() for p, t in zip(params, theta)))


def inner_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    optimizer: torch.optim.Optimizer,
    inner_lr: float,
    inner: str = "adam",
) -> list[torch.Tensor | None]:
    """The inner-step displacement theta' - theta for each parameter (the parameters are not changed).

    Args:
        params: the trainable tensors theta (any shapes).
        grads: grad L_task(theta; B1) per tensor, same shapes; None = no gradient (no displacement).
        optimizer: the outer optimizer; for ``adam`` its ``state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` / ``["step"]``
            (and ``max_exp_avg_sq`` with ``amsgrad``) and its group's ``betas`` / ``eps`` are read.
        inner_lr: step size, >= 0.
        inner: ``adam`` (the outer Adam's next step on g, module docstring) or ``sgd`` (-inner_lr * g).

    Returns:
        Per tensor, the displacement (same shape as the parameter) or None.
    """
    _check_choice("inner", inner, INNER_STEPS)
    groups = _param_groups(optimizer) if inner == "adam" else {}
    out: list[torch.Tensor | None] = []
    for p, g in zip(params, grads):
        if g is None:
            out.append(None)
            continue
        g = g.detach()
        if inner == "sgd":
            out.append(-inner_lr * g)
            continue
        group = groups.get(id(p), {})
        beta1, beta2 = (float(b) for b in group.get("betas", (0.9, 0.999)))
        eps = float(group.get("eps", 1e-8))
        state = optimizer.state.get(p, {})
        v = state.get("max_exp_avg_sq") if group.get("amsgrad", False) else None
        v = state.get("exp_avg_sq") if v is None else v
        m = state.get("exp_avg")
        if v is None or m is None or "step" not in state:
            m, v, t = torch.zeros_like(g), torch.zeros_like(g), 0.0
        else:
            m, v, t = m.detach().to(g.dtype), v.detach().to(g.dtype), float(state["step"])
        m_next = (beta1 * m + (1.0 - beta1) * g) / (1.0 - beta1 ** (t + 1.0))
        v_next = beta2 * v + (1.0 - beta2) * g * g
        denom = (v_next / (1.0 - beta2 ** (t + 1.0))).sqrt() + eps
        out.append(-inner_lr * m_next / denom)
    return out


def frozen_features(
    global_model: nn.Module, model: nn.Module, feature_fn: FeatureFn, images: torch.Tensor
) -> torch.Tensor:
    """Features h(images; phi_g) of the frozen global model, normalised in the local model's mode.

    Each normalisation layer of ``global_model`` takes the ``training`` flag of the local module of the
    same name (``model.training`` where there is none); every other module is put in eval mode (no
    dropout). No gradient; the global model's buffers (running statistics) and modes are restored.

    Args:
        global_model: phi_g, same architecture as ``model``.
        model: the local model, whose modes are copied.
        feature_fn: ``feature_fn(model, images) -> (features, logits)``.
        images: (B, C, H, W).

    Returns:
        (B, d, H, W) detached features.
    """
    local_modes = {name: m.training for name, m in model.named_modules()}
    saved_modes = [(m, m.training) for m in global_model.modules()]
    saved_buffers = [(buf, buf.detach().clone()) for buf in global_model.buffers()]
    try:
        for name, m in global_model.named_modules():
            m.training = local_modes.get(name, model.training) if isinstance(m, _NORM) else False
        with torch.no_grad():
            features, _ = feature_fn(global_model, images)
    finally:
        _copy_back(saved_buffers)
        for m, mode in saved_modes:
            m.training = mode
    return features.detach()


def _task_grads(
    model: nn.Module,
    b1: dict,
    params: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Sequence[torch.Tensor | None]:
    """The meta-train gradient g = grad L_task(theta; B1), None where unused; a non-finite loss raises."""
    inner_loss = loss_fn(model(b1["image"]), b1["label"])
    if not torch.isfinite(inner_loss):
        raise FloatingPointError(f"meta-train loss became {inner_loss.item()}; lower train.lr or inner_lr")
    return torch.autograd.grad(inner_loss, params, allow_unused=True)


def _meta_test_loss(
    model: nn.Module,
    b2: dict,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    beta: float,
    align_fn: AlignFn | None,
    global_model: nn.Module | None,
    feature_fn: FeatureFn | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L_meta, L_task, L_align or None at beta = 0) on B2 at the current parameters; a non-finite L_meta raises."""
    align = None
    if beta > 0:  # then align_fn, global_model and feature_fn are given (checked on entry)
        features_of = cast(FeatureFn, feature_fn)
        global_features = frozen_features(cast(nn.Module, global_model), model, features_of, b2["image"])
        features, logits = features_of(model, b2["image"])
        task = loss_fn(logits, b2["label"])
        align = cast(AlignFn, align_fn)(features, global_features)
        loss = task + beta * align
    else:
        task = loss = loss_fn(model(b2["image"]), b2["label"])
    if not torch.isfinite(loss):
        raise FloatingPointError(f"meta-test loss became {loss.item()}; lower train.lr, inner_lr or beta")
    return loss, task, align


def _add_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add ``grads`` into the parameters' ``.grad`` (a copy where there is none yet); None adds nothing."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def _add_record(
    record: dict, inner_norm: float, outer_norm: float, task: torch.Tensor, align: torch.Tensor | None
) -> None:
    """Add one step's inner / outer step lengths and loss terms to ``record``'s sums (``meta_step``'s ``record``)."""
    record["inner_norm_sum"] = record.get("inner_norm_sum", 0.0) + inner_norm
    record["outer_norm_sum"] = record.get("outer_norm_sum", 0.0) + outer_norm
    record["inner_steps"] = record.get("inner_steps", 0) + 1
    record["task_loss_sum"] = record.get("task_loss_sum", 0.0) + float(task.detach())
    if align is not None:
        record["align_loss_sum"] = record.get("align_loss_sum", 0.0) + float(align.detach())


def meta_step(
    model: nn.Module,
    batch: dict,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    inner_lr: float,
    beta: float,
    align_fn: AlignFn | None,
    global_model: nn.Module | None,
    feature_fn: FeatureFn | None = unet_features,
    split: bool = True,
    inner: str = "adam",
    record: dict | None = None,
    meta_grad: str = "meta",
) -> float:
    """One first-order GRACE meta step; updates ``model`` in place through ``optimizer``.

    Args:
        model: local model theta (in train mode); its trainable parameters are those in ``optimizer``.
        batch: ``{"image": (B, C, H, W), "label": (B, K, H, W)}``.
        optimizer: outer optimizer over ``model``'s parameters (any torch optimizer).
        loss_fn: ``loss_fn(logits, label) -> scalar`` task loss.
        inner_lr: step size eta of the inner (meta-train) step, >= 0; 0 skips it (theta' = theta).
        beta: weight of the alignment term, >= 0; 0 skips the global model entirely.
        align_fn: ``align_fn(f_local, f_global) -> scalar``, e.g. ``alignment.coral``; needed if beta > 0.
        global_model: the round's global model phi_g on the same device; evaluated frozen by
            :func:`frozen_features` (no gradient, normalisation layers in the local model's mode, dropout
            off, its buffers and modes restored afterwards); needed if beta > 0.
        feature_fn: ``feature_fn(model, images) -> (features (B, d, H, W), logits)``; needed if beta > 0.
        split: split the batch into meta-train / meta-test halves (B1 = first B // 2 samples); with
            False, or a batch of one sample, both are the whole batch.
        inner: ``adam`` (default: the step the outer Adam would take next on the meta-train gradient,
            from its moments; sign-like inner_lr * g / (|g| + eps) where it has none) or ``sgd`` (the
            paper's plain step); see :func:`inner_update`.
        record: optional dict; each call adds ||theta' - theta|| (L2 over all trainable parameters, a
            float) to ``record["inner_norm_sum"]``, the length of the outer step it then takes to
            ``record["outer_norm_sum"]`` and 1 to ``record["inner_steps"]`` (all created at 0), so
            ``inner_norm_sum / inner_steps`` is the mean inner-step length, comparable with
            ``outer_norm_sum / inner_steps``. It also adds L_task(theta'; B2) to ``record["task_loss_sum"]``
            and, when beta > 0, the unweighted L_align (the value of ``align_fn``; for ``adv`` the
            discriminator's loss) to ``record["align_loss_sum"]`` (absent with beta = 0: not computed), so
            ``task_loss_sum / inner_steps`` and ``align_loss_sum / inner_steps`` are the round's means of the
            two terms, L_meta = L_task + beta * L_align. Left untouched when the call fails.
        meta_grad: ``meta`` (grad L_meta(theta') only) or ``both`` (plus the meta-train gradient grad
            L_task(theta; B1), taken even when inner_lr = 0); module docstring.

    Returns:
        L_meta at theta' as a float.
    """
    _check_rate("inner_lr", inner_lr)
    _check_rate("beta", beta)
    _check_choice("inner", inner, INNER_STEPS)
    _check_choice("meta_grad", meta_grad, META_GRADS)
    if beta > 0:
        for name, value in (("align_fn", align_fn), ("global_model", global_model), ("feature_fn", feature_fn)):
            if value is None:
                raise ValueError(f"{name} is required when beta > 0 (beta={beta})")
    b1, b2 = _halves(batch, split)
    params = [p for p in model.parameters() if p.requires_grad]
    theta = [p.detach().clone() for p in params]
    buffers = [(buf, buf.detach().clone()) for buf in model.buffers()]
    inner_sq = 0.0

    try:
        grads: Sequence[torch.Tensor | None] = ()
        if inner_lr > 0 or meta_grad == "both":  # g = grad L_task(theta; B1); theta' = theta + inner_update(g)
            grads = _task_grads(model, b1, params, loss_fn)
            with torch.no_grad():
                if inner_lr > 0:
                    for p, delta in zip(params, inner_update(params, grads, optimizer, inner_lr, inner)):
                        if delta is not None:
                            p.add_(delta)
                _copy_back(buffers)  # only the meta-test forward updates running statistics
                inner_sq = _sq_distance(params, theta)

        optimizer.zero_grad(set_to_none=True)
        loss, task, align = _meta_test_loss(model, b2, loss_fn, beta, align_fn, global_model, feature_fn)
        loss.backward()  # gradient of L_meta at theta'
        if meta_grad == "both":  # + the meta-train gradient taken at theta
            _add_grads(params, grads)
    except BaseException:
        _copy_back(buffers)
        raise
    finally:
        _copy_back(zip(params, theta))  # back to theta; the gradients taken at theta' stay in .grad
    optimizer.step()
    if record is not None:
        _add_record(record, inner_sq**0.5, _sq_distance(params, theta) ** 0.5, task, align)
    return float(loss.detach())
