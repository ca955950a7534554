"""FedProx (Li et al., 2020): local objective plus a proximal term towards the round's global model.

    L_k(w) = L_task(w) + mu / 2 * || w - w_global ||^2

The server side is FedAvg; only the client objective changes. ``mu = 0`` is FedAvg.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def proximal_term(model: nn.Module, global_params: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """Return ``mu / 2 * sum ||w - w_g||^2`` over the model's trainable parameters (a differentiable scalar)."""
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    total = None
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        term = (p - global_params[name].to(p.device, p.dtype)).pow(2).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total
