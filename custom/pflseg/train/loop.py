"""The one local training loop. Methods plug in through ``Hooks``; nothing else trains a model.

    for epoch: for batch: loss = loss_fn(model(x), y) + hooks.extra_loss(...); step

``Hooks.step`` replaces the whole step (meta-learning, alternating schedules); ``Hooks.extra_loss`` adds
a term (FedProx's proximal term, alignment losses).

GPU options (``train.amp``, ``train.channels_last``; both off by default, and then every operation is the one
of plain float32 training: results bit for bit as without them):

- ``amp`` (``amp_dtype``): the forward passes run under ``torch.autocast`` on the model's device, bf16 or fp16;
  the task loss is computed in float32 outside autocast (``Float32Loss``: the logits are cast up first). fp16
  uses a ``torch.amp.GradScaler`` (a new one per call: its scale starts at 2^16 every round) and exists on
  CUDA only (a CPU site trains in float32, with a log line). A method whose own step replaces the loop's
  (``Hooks.step``) runs that whole step inside autocast and is handed the float32 task loss; bf16 only (fp16
  would need the step to scale its own backward: refused on every device, ConfigError). Terms such a step
  computes without ``loss_fn`` (GRACE's alignment, LC-Fed's site contrast) run under autocast as they are.
- ``channels_last``: the model's 4-D weights and the images in ``torch.channels_last`` memory format while the
  loop runs; the model is back in the contiguous format afterwards (its state dict as always).
- On CUDA, batches come from pinned memory (``make_loader(device=...)``) and are copied without blocking.
- ``peak_gpu_memory``: the device's peak allocated bytes, reported by ``train_epochs`` (None on a CPU).

Stopping an aborted task: ``with stop_when(condition):`` around a site's task (``pflseg.flare.executor.SiteExecutor``
sets ``abort_signal.triggered`` in its worker thread) makes ``train_epochs`` look at ``condition()`` before every
batch and raise ``TaskAborted`` once it holds: the task stops within a batch, its model and optimizer left mid-way
(its caller saves nothing of them). The condition belongs to the thread (a context variable, looked up once per
``train_epochs`` call, then called before every batch): nothing else changes where none is set (scripts, tests,
the Client API route), and no torch operation or random number is added to the loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pflseg.config import AMP_MODES, ConfigError

log = logging.getLogger("pflseg.train")

#: ``train.amp`` (``pflseg.config.AMP_MODES``) -> the dtype autocast runs its lower-precision ops in (None: float32)
AMP_DTYPES: dict[str, torch.dtype | None] = dict(zip(AMP_MODES, (None, torch.bfloat16, torch.float16)))


#: the running task's stop condition in this thread (``stop_when``); None: none
_STOP: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("pflseg_stop", default=None)


class TaskAborted(BaseException):
    """``train_epochs`` stopped because the task's stop condition (``stop_when``) held: the task was aborted.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that no ``except Exception`` on the way turns it into an error
    reply or a result: ``pflseg.flare.client.answer`` lets it through, the round skeleton saves no state and sends no
    reply (``Site.run_round`` saves after the method's step only). ``site``: the site object of the task, set by
    ``client.answer`` (kept for the next task)."""

    site: object | None = None


@contextlib.contextmanager
def stop_when(condition: Callable[[], bool] | None):
    """Inside the block, in this thread, ``train_epochs`` raises ``TaskAborted`` before a batch once ``condition()``
    is true (e.g. ``lambda: abort_signal.triggered``: cheap, it is read before every batch). None: no condition."""
    token = _STOP.set(condition)
    try:
        yield
    finally:
        _STOP.reset(token)


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
    # torch.use_deterministic_algorithms(True, warn_only=True) sets the same switch but first imports TorchInductor's
    # config (and with it sympy): 2.3-3.3 s of every site and server process's start, for a compiler pflseg never uses
    torch.set_deterministic_debug_mode("warn")
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


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int = 0,
                device: torch.device | str | None = None) -> DataLoader:
    """Batches of ``dataset`` in a seeded order. For a CUDA ``device`` they come in pinned (page-locked) host memory,
    so that the copies to the GPU (``to_device``) do not block; otherwise (None, a CPU) as they are."""
    gen = torch.Generator().manual_seed(seed)
    pin = device is not None and torch.device(device).type == "cuda"
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=gen, num_workers=0, drop_last=False,
                      pin_memory=pin)


@functools.cache
def _fallback_note(amp: str, device_type: str) -> None:
    """One log line per process and (amp, device type) that ``amp`` runs in float32 there."""
    log.warning("train.amp=%s: not on a %s device (CUDA only); this site computes in float32", amp, device_type)


def amp_dtype(amp: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype ``train.amp`` gives on ``device``; None: float32 throughout.

    ``off``: None. ``bf16``: bfloat16 on a CPU or a CUDA GPU with native bfloat16 (Ampere or later; an older GPU is
    a ConfigError pointing to fp16). ``fp16``: float16 on CUDA; on any other device None, with one log line: a CPU
    gains nothing from float16 and its training would need a gradient scaler, which pflseg uses on CUDA only.
    Any other device type (``meta``, ...): None.
    """
    if amp not in AMP_DTYPES:
        raise ConfigError(f"train.amp must be one of {', '.join(AMP_DTYPES)}, got {amp!r}")
    device = torch.device(device)
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return None
    if device.type == "cuda":
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ConfigError(f"train.amp=bf16: the GPU {torch.cuda.get_device_name(device)} has no native bfloat16 "
                              "(Ampere or later have it); use train.amp: fp16 or off")
        return dtype
    if device.type == "cpu" and dtype == torch.bfloat16:
        return dtype
    _fallback_note(amp, device.type)
    return None


def autocast(dtype: torch.dtype | None, device: torch.device):
    """``torch.autocast`` on ``device``'s type in ``dtype``; a no-op context for None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class Float32Loss(nn.Module):
    """``loss_fn`` computed in float32 outside autocast: the logits (and a floating-point label) are cast to float32
    first, so the loss, its reductions and the first steps of its gradient are float32 under mixed precision."""

    def __init__(self, loss_fn: nn.Module):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            return self.loss_fn(logits.float(), label.float() if label.is_floating_point() else label)


def to_device(batch: dict, device: torch.device, channels_last: bool = False) -> dict:
    """``batch``'s tensors on ``device``: copied without blocking on CUDA (from pinned memory, ``make_loader``); with
    ``channels_last`` its ``image`` as ``image_to`` makes it."""
    non_blocking = device.type == "cuda"
    out = {k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()}
    if channels_last and torch.is_tensor(out.get("image")):
        out["image"] = image_to(out["image"], device, channels_last)
    return out


def image_to(image: torch.Tensor, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """A batch of images on ``device`` (without blocking on CUDA); with ``channels_last`` a 4-D (B, C, H, W) batch in
    channels-last memory format."""
    image = image.to(device, non_blocking=device.type == "cuda")
    return image.contiguous(memory_format=torch.channels_last) if channels_last and image.ndim == 4 else image


@contextlib.contextmanager
def memory_format(model: nn.Module, channels_last: bool):
    """``model``'s 4-D weights in channels-last memory format inside the block (same parameters, new strides), back in
    the contiguous format after it; nothing without ``channels_last``."""
    if not channels_last:
        yield model
        return
    model.to(memory_format=torch.channels_last)
    try:
        yield model
    finally:
        model.to(memory_format=torch.contiguous_format)


def peak_gpu_memory(device: torch.device | str) -> int | None:
    """Peak bytes allocated by torch on a CUDA ``device`` since its last reset (``torch.cuda.max_memory_allocated``;
    ``train_epochs`` resets it when it starts); None on any other device. The counter belongs to the process: sites
    that share one process and GPU (simulator threads) share it too."""
    device = torch.device(device)
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def backward_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """``loss.backward()`` and ``optimizer.step()``; through ``scaler`` where fp16 gives one (the step is then skipped
    when the scaled gradient overflowed, and the scale adapts)."""
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def train_epochs(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    epochs: int,
    device: torch.device,
    hooks: Hooks | None = None,
    progress: Callable[[int, float], None] | None = None,
    amp: str = "off",
    channels_last: bool = False,
) -> dict:
    """Train ``model`` in place for ``epochs`` over ``loader``.

    Args:
        amp: ``train.amp`` (module docstring, ``amp_dtype``): off | bf16 | fp16.
        channels_last: ``train.channels_last``: model and images in channels-last memory format while training.

    Raises:
        TaskAborted: before a batch, once the stop condition of the thread (``stop_when``) holds; the model and the
            optimizer are then left as the batches before it made them.

    Returns:
        ``{"loss": mean batch loss, "steps": batches trained on (with fp16 the scaler may skip the optimizer step of
        a batch whose gradient overflowed), "samples": samples seen per epoch, "peak_gpu_bytes": peak_gpu_memory of
        the loop (None off CUDA)}``.
    """
    hooks = hooks or Hooks()
    if amp == "fp16" and hooks.step is not None:  # on every device: a job behaves alike at CPU and GPU sites
        raise ConfigError("train.amp=fp16 needs a gradient scaler around each backward pass, and this method's own "
                          "training step (GRACE's meta step, LC-Fed, FedRep) does not take one; use train.amp: bf16 "
                          "(or off)")
    device = torch.device(device)
    dtype = amp_dtype(amp, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    if dtype is not None and loss_fn is not None:
        loss_fn = Float32Loss(loss_fn)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.to(device).train()
    stop = _STOP.get()
    total, steps = 0.0, 0
    with memory_format(model, channels_last):
        for epoch in range(epochs):
            for batch in loader:
                if stop is not None and stop():
                    raise TaskAborted(f"training stopped after {steps} batch(es), in epoch {epoch + 1} of {epochs}: "
                                      "the task was aborted")
                batch = to_device(batch, device, channels_last)
                if hooks.step is not None:
                    with autocast(dtype, device):
                        loss_value = hooks.step(model, batch, optimizer, loss_fn)
                else:
                    optimizer.zero_grad(set_to_none=True)
                    with autocast(dtype, device):
                        logits = model(batch["image"])
                    loss = loss_fn(logits, batch["label"])
                    if hooks.extra_loss is not None:
                        with autocast(dtype, device):
                            term = hooks.extra_loss(model, batch, logits)
                        loss = loss + (term.float() if dtype is not None else term)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"training loss became {loss.item()} at step {steps}; lower train.lr")
                    backward_step(loss, optimizer, scaler)
                    loss_value = float(loss.detach())
                total += loss_value
                steps += 1
            if hooks.epoch_end is not None:
                hooks.epoch_end(model, optimizer)
            if progress is not None:
                progress(epoch, total / max(steps, 1))
    return {"loss": total / max(steps, 1), "steps": steps, "samples": len(loader.dataset),
            "peak_gpu_bytes": peak_gpu_memory(device)}
