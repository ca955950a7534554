"""GRACE, client side (Zhang et al., MICCAI 2023): first-order meta-learning with feature alignment.

Per batch, with the round's global model phi_g frozen and h(x; theta) the feature map before the
segmentation head:

    B1, B2   = first / second half of the batch             (split=False: B1 = B2 = the batch)
    theta'   = theta - inner_lr * grad L_task(theta; B1)
    L_meta   = L_task(theta'; B2) + beta * L_align( h(B2; theta'), h(B2; phi_g) )
    theta    <- optimizer step on theta with gradient grad_theta' L_meta      (first-order MAML)

The second-order term (d theta' / d theta) is dropped: the gradient taken at theta' is applied to theta.
Honest special cases (tested): with beta = 0 and split=False the update is a plain optimizer step on the
batch with the gradient evaluated at theta' (not at theta); with inner_lr = 0 as well it is exactly one
plain optimizer step on the batch, normalisation running statistics included (the running statistics
are restored after the meta-train forward, so only the meta-test forward updates them, once).

``meta_step`` plugs into the one training loop as ``Hooks(step=functools.partial(meta_step, ...))``.
Pure torch, no I/O. See ../shared/reference/ALGORITHMS.md section 2; alignment losses in alignment.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FeatureFn = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
AlignFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
) -> float:
    """One first-order GRACE meta step; updates ``model`` in place through ``optimizer``.

    Args:
        model: local model theta (in train mode); its trainable parameters are those in ``optimizer``.
        batch: ``{"image": (B, C, H, W), "label": (B, K, H, W)}``.
        optimizer: outer optimizer over ``model``'s parameters (any torch optimizer).
        loss_fn: ``loss_fn(logits, label) -> scalar`` task loss.
        inner_lr: step size eta of the inner (meta-train) SGD step, >= 0; 0 skips it (theta' = theta).
        beta: weight of the alignment term, >= 0; 0 skips the global model entirely.
        align_fn: ``align_fn(f_local, f_global) -> scalar``, e.g. ``alignment.coral``; needed if beta > 0.
        global_model: the round's global model phi_g on the same device; evaluated frozen (no gradient,
            eval mode, its own mode restored afterwards); needed if beta > 0.
        feature_fn: ``feature_fn(model, images) -> (features (B, d, H, W), logits)``; needed if beta > 0.
        split: split the batch into meta-train / meta-test halves (B1 = first B // 2 samples); with
            False, or a batch of one sample, both are the whole batch.

    Returns:
        L_meta at theta' as a float.
    """
    if not (inner_lr >= 0 and inner_lr != float("inf")):
        raise ValueError(f"inner_lr must be finite and >= 0, got {inner_lr}")
    if not (beta >= 0 and beta != float("inf")):
        raise ValueError(f"beta must be finite and >= 0, got {beta}")
    if beta > 0:
        for name, value in (("align_fn", align_fn), ("global_model", global_model), ("feature_fn", feature_fn)):
            if value is None:
                raise ValueError(f"{name} is required when beta > 0 (beta={beta})")
    b1, b2 = _halves(batch, split)
    params = [p for p in model.parameters() if p.requires_grad]
    theta = [p.detach().clone() for p in params]
    buffers = [(buf, buf.detach().clone()) for buf in model.buffers()]

    try:
        if inner_lr > 0:  # theta' = theta - inner_lr * grad L_task(theta; B1)
            inner = loss_fn(model(b1["image"]), b1["label"])
            if not torch.isfinite(inner):
                raise FloatingPointError(f"meta-train loss became {inner.item()}; lower train.lr or inner_lr")
            grads = torch.autograd.grad(inner, params, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if g is not None:
                        p.sub_(inner_lr * g)
                for buf, saved in buffers:  # only the meta-test forward updates running statistics
                    buf.copy_(saved)

        optimizer.zero_grad(set_to_none=True)
        if beta > 0:
            features, logits = feature_fn(model, b2["image"])
            loss = loss_fn(logits, b2["label"])
            was_training = global_model.training
            global_model.eval()
            try:
                with torch.no_grad():
                    global_features, _ = feature_fn(global_model, b2["image"])
            finally:
                global_model.train(was_training)
            loss = loss + beta * align_fn(features, global_features.detach())
        else:
            loss = loss_fn(model(b2["image"]), b2["label"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"meta-test loss became {loss.item()}; lower train.lr, inner_lr or beta")
        loss.backward()  # gradient of L_meta at theta'
    except BaseException:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        raise
    finally:
        with torch.no_grad():  # back to theta; the gradients taken at theta' stay in .grad
            for p, saved in zip(params, theta):
                p.copy_(saved)
    optimizer.step()
    return float(loss.detach())
