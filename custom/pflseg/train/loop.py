"""The one local training loop. Methods plug in through ``Hooks``; nothing else trains a model.

    for epoch: for batch: loss = loss_fn(model(x), y) + hooks.extra_loss(...); step

``Hooks.step`` replaces the whole step (meta-learning, alternating schedules); ``Hooks.extra_loss`` adds
a term (FedProx's proximal term, alignment losses).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class Hooks:
    """Extension points of the training loop.

    Attributes:
        extra_loss: ``f(model, batch, logits) -> scalar tensor`` added to the task loss.
        step: ``f(model, batch, optimizer, loss_fn) -> float`` replacing the default step.
        epoch_end: ``f(model, optimizer)`` after every epoch (e.g. one optimizer step per epoch over
            gradients a custom step accumulated: full-batch training).
    """

    extra_loss: Callable[[nn.Module, dict, torch.Tensor], torch.Tensor] | None = None
    step: Callable[[nn.Module, dict, torch.optim.Optimizer, nn.Module], float] | None = None
    epoch_end: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None


def pick_device(preference: str = "auto") -> torch.device:
    """``auto``: CUDA when available (respecting CUDA_VISIBLE_DEVICES: the first visible GPU), else CPU."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if preference.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"device '{preference}' requested but CUDA is not available "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use device 'auto' or 'cpu'"
        )
    return torch.device(preference)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch; deterministic kernels where torch has them."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.backends.cudnn.is_available():
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def derive_seed(*parts) -> int:
    """A stable seed from (seed, site, round, ...) that does not depend on process or hash randomisation."""
    text = "/".join(str(p) for p in parts)
    h = 1469598103934665603
    for ch in text.encode():
        h = ((h ^ ch) * 1099511628211) % 2**63
    return h % 2**31


def build_optimizer(
    model: nn.Module,
    device: torch.device,
    lr: float,
    state: dict | None = None,
    extra: list[nn.Parameter] | None = None,
) -> torch.optim.Adam:
    """Adam over ``model`` (and ``extra`` parameters as a second group), its state loaded from ``state``.

    The model is moved to ``device`` FIRST: ``Optimizer.load_state_dict`` puts the moments on the device of
    the parameters as they are at load time, so a model moved afterwards (as the loop does) would leave its
    moments behind on the CPU and the first step on a GPU would fail. Every optimizer of a site is built
    here, so parameters and optimizer state always share a device.
    """
    model.to(device)
    groups = [{"params": list(model.parameters())}] + ([{"params": extra}] if extra else [])
    optimizer = torch.optim.Adam(groups, lr=lr)
    if state:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as exc:  # torch: "... doesn't match the size of optimizer's group"
            raise ValueError(f"the optimizer state in the site's checkpoint does not fit the model ({exc}): the config "
                             "no longer matches the checkpoint (net.* changed since it was written). Run with that "
                             "config, or start afresh (resume: false; pflseg run without --resume)") from exc
    return optimizer


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=gen, num_workers=0, drop_last=False)


def train_epochs(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    epochs: int,
    device: torch.device,
    hooks: Hooks | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict:
    """Train ``model`` in place for ``epochs`` over ``loader``.

    Returns:
        ``{"loss": mean batch loss, "steps": optimizer steps, "samples": samples seen per epoch}``.
    """
    hooks = hooks or Hooks()
    model.to(device).train()
    total, steps = 0.0, 0
    for epoch in range(epochs):
        for batch in loader:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if hooks.step is not None:
                loss_value = hooks.step(model, batch, optimizer, loss_fn)
            else:
                optimizer.zero_grad(set_to_none=True)
                logits = model(batch["image"])
                loss = loss_fn(logits, batch["label"])
                if hooks.extra_loss is not None:
                    loss = loss + hooks.extra_loss(model, batch, logits)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"training loss became {loss.item()} at step {steps}; lower train.lr")
                loss.backward()
                optimizer.step()
                loss_value = float(loss.detach())
            total += loss_value
            steps += 1
        if hooks.epoch_end is not None:
            hooks.epoch_end(model, optimizer)
        if progress is not None:
            progress(epoch, total / max(steps, 1))
    return {"loss": total / max(steps, 1), "steps": steps, "samples": len(loader.dataset)}
