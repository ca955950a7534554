"""FedBN (Li et al., ICLR 2021): batch-normalisation layers stay at the site, everything else is FedAvg.

Normalisation parameters and buffers are found by module type (``torch.nn.modules.batchnorm._NormBase``
covers BatchNorm and InstanceNorm with affine or running statistics; GroupNorm and LayerNorm too), never
by guessing substrings of key names: MONAI names its norm layers ``...adn.N...``.
"""

from __future__ import annotations

from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def norm_keys(model: nn.Module) -> set[str]:
    """State-dict keys (parameters and buffers) that belong to normalisation layers of ``model``."""
    keys: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            prefix = f"{mod_name}." if mod_name else ""
            keys.update(prefix + k for k in module.state_dict().keys())
    return keys


def shared_keys(model: nn.Module) -> list[str]:
    """State-dict keys aggregated by FedBN: everything except the normalisation layers."""
    local = norm_keys(model)
    return [k for k in model.state_dict().keys() if k not in local]
