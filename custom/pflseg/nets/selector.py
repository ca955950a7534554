"""FedSM's model selector: an image classifier over sites, built from a config dict.

Two variants (``cfg["name"]``):

- ``vgg11``: the paper's and reference code's selector, VGG-11 (configuration "A") without batch norm:
  conv3x3 stack 64-M-128-M-256-256-M-512-512-M-512-512-M (ReLU after every conv, M = 2x2 max-pool),
  adaptive average pooling to 7x7, classifier 25088-4096-4096-num_classes with ReLU + Dropout.
  About 128.8 M parameters for 1 input channel and 3 classes (~490 MiB in float32); module layout and
  state-dict keys (``features.<i>``, ``classifier.<i>``) follow the usual VGG layout.
- ``compact`` (default): the same conv stack with every width scaled by ``width`` (default 0.25), then
  global average pooling and a small head C_last -> hidden -> num_classes. With the defaults it is
  about 0.6 M parameters, two orders of magnitude fewer bytes on the wire than ``vgg11``.

``head`` (both variants): ``mlp`` (default; the classifiers above, trained by cross-entropy) or ``linear``:
global average pooling of the conv stack and ONE ``nn.Linear(C_last, num_classes)`` (``classifier``), the
form of FedSM's closed-form (LDA) head (``pflseg.algorithms.fedsm.lda_head``), which the server sets from the
sites' statistics of ``Selector.embed``; C_last = 512 for vgg11, 128 for compact with width 0.25.

Input (B, in_channels, H, W) with H, W >= 32 (five 2x2 max-pools); output logits (B, num_classes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

#: VGG-11 ("A") conv stack: output channels of each 3x3 conv, "M" = 2x2 max-pool with stride 2.
VGG11_STACK: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

#: Smallest input side: the stack halves the resolution five times.
MIN_SIZE = 32

COMMON_DEFAULTS = {"in_channels": 1, "num_classes": None, "head": "mlp"}
HEADS = ("mlp", "linear")
SELECTOR_DEFAULTS = {
    "vgg11": {**COMMON_DEFAULTS, "dropout": 0.5},
    "compact": {**COMMON_DEFAULTS, "width": 0.25, "hidden": 128, "dropout": 0.5},
}


class Selector(nn.Module):
    """Conv feature stack -> pooling -> classifier head.

    Args:
        features: conv stack mapping (B, C, H, W) to (B, C_last, H / 32, W / 32).
        pool: spatial pooling ((7, 7) adaptive average for vgg11, global average for compact).
        classifier: head mapping the flattened pooled features to (B, num_classes).
        in_channels: expected C of the input, checked in ``forward``.
    """

    def __init__(self, features: nn.Module, pool: nn.Module, classifier: nn.Module, in_channels: int) -> None:
        super().__init__()
        self.features = features
        self.avgpool = pool
        self.classifier = classifier
        self.in_channels = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images (B, in_channels, H, W), H, W >= 32, to logits (B, num_classes)."""
        self._check(x)
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Global average of the conv stack's output: (B, in_channels, H, W) -> (B, C_last), the features
        of the ``linear`` head (its ``forward`` is ``classifier(embed(x))``)."""
        self._check(x)
        return self.features(x).mean(dim=(2, 3))

    def _check(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.in_channels or x.shape[2] < MIN_SIZE or x.shape[3] < MIN_SIZE:
            raise ValueError(
                f"selector input must have shape (B, {self.in_channels}, H, W) with H, W >= {MIN_SIZE}, "
                f"got {tuple(x.shape)}"
            )


def vgg_features(stack: Sequence[int | str], in_channels: int) -> nn.Sequential:
    """3x3 conv (padding 1) + ReLU per int in ``stack``, 2x2 max-pool (stride 2) per ``"M"``."""
    layers: list[nn.Module] = []
    channels = in_channels
    for item in stack:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(channels, int(item), kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = int(item)
    return nn.Sequential(*layers)


def scaled_stack(width: float) -> tuple[int | str, ...]:
    """VGG11_STACK with every conv width multiplied by ``width`` (rounded, at least 1)."""
    return tuple(item if item == "M" else max(1, round(int(item) * width)) for item in VGG11_STACK)


def build_linear(stack: Sequence[int | str], in_channels: int, num_classes: int) -> Selector:
    """Conv stack, global average pooling, one Linear(C_last, num_classes) (the closed-form head's form)."""
    last = [c for c in stack if c != "M"][-1]
    net = Selector(vgg_features(stack, in_channels), nn.AdaptiveAvgPool2d(1), nn.Linear(last, num_classes), in_channels)
    _init_weights(net)
    return net


def build_vgg11(in_channels: int, num_classes: int, dropout: float) -> Selector:
    """The faithful VGG-11 selector (no batch norm, 7x7 pooling, 25088-4096-4096-num_classes)."""
    classifier = nn.Sequential(
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(inplace=True),
        nn.Dropout(p=dropout),
        nn.Linear(4096, 4096),
        nn.ReLU(inplace=True),
        nn.Dropout(p=dropout),
        nn.Linear(4096, num_classes),
    )
    net = Selector(vgg_features(VGG11_STACK, in_channels), nn.AdaptiveAvgPool2d((7, 7)), classifier, in_channels)
    _init_weights(net)
    return net


def build_compact(in_channels: int, num_classes: int, width: float, hidden: int, dropout: float) -> Selector:
    """The compact selector: width-scaled VGG-11 conv stack, global average pooling, C_last-hidden-K head."""
    stack = scaled_stack(width)
    last = [c for c in stack if c != "M"][-1]
    classifier = nn.Sequential(
        nn.Linear(last, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(p=dropout),
        nn.Linear(hidden, num_classes),
    )
    net = Selector(vgg_features(stack, in_channels), nn.AdaptiveAvgPool2d(1), classifier, in_channels)
    _init_weights(net)
    return net


def _init_weights(net: nn.Module) -> None:
    """VGG's usual initialisation: Kaiming-normal (fan_out) convs, N(0, 0.01) linears, zero biases."""
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


def _positive_int(cfg_name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"selector.{cfg_name} must be an int >= 1, got {value!r}")
    return value


def build_selector(cfg: Mapping) -> Selector:
    """Build the FedSM selector from ``cfg``.

    Args:
        cfg: ``name`` in {"compact", "vgg11"} (default "compact"); ``num_classes`` (required: K for FedSM,
            K + 1 for FedSM-extra); ``in_channels`` (default 1); ``head`` in {"mlp", "linear"} (default
            "mlp"); ``dropout`` (default 0.5); for compact also ``width`` (> 0, default 0.25) and ``hidden``
            (default 128). ``dropout`` and ``hidden`` do not apply to the ``linear`` head.

    Returns:
        A ``Selector`` mapping (B, in_channels, H, W), H, W >= 32, to logits (B, num_classes).

    Raises:
        ValueError: naming the key for an unknown name, an unknown key (including a key of the other
            variant, e.g. ``width`` for vgg11), a missing ``num_classes`` or an out-of-range value.
    """
    name = cfg.get("name", "compact")
    if name not in SELECTOR_DEFAULTS:
        raise ValueError(f"selector.name: unknown selector '{name}'; known: {sorted(SELECTOR_DEFAULTS)}")
    defaults = SELECTOR_DEFAULTS[name]
    unknown = sorted(set(cfg) - set(defaults) - {"name"})
    if unknown:
        raise ValueError(f"selector: unknown key(s) {unknown} for selector '{name}'; known: {sorted(defaults)}")
    args = {**defaults, **{k: v for k, v in cfg.items() if k != "name"}}
    if args["num_classes"] is None:
        raise ValueError("selector.num_classes: required (K sites for FedSM, K + 1 for FedSM-extra)")
    in_channels = _positive_int("in_channels", args["in_channels"])
    num_classes = _positive_int("num_classes", args["num_classes"])
    dropout = float(args["dropout"])
    if not (0.0 <= dropout < 1.0):
        raise ValueError(f"selector.dropout must be in [0, 1), got {dropout}")
    if args["head"] not in HEADS:
        raise ValueError(f"selector.head: unknown head {args['head']!r}; known: {list(HEADS)}")
    width = 1.0 if name == "vgg11" else float(args["width"])
    if not (width > 0.0 and width != float("inf")):
        raise ValueError(f"selector.width must be a finite number > 0, got {args['width']!r}")
    if args["head"] == "linear":
        return build_linear(VGG11_STACK if name == "vgg11" else scaled_stack(width), in_channels, num_classes)
    if name == "vgg11":
        return build_vgg11(in_channels, num_classes, dropout)
    return build_compact(in_channels, num_classes, width, _positive_int("hidden", args["hidden"]), dropout)


def selector_cfg(job_cfg: Mapping, num_classes: int, head: str | None = None) -> dict:
    """The selector's config from a pflseg job config (``fedsm.selector``, ``net.in_channels``; head ``linear``
    when ``fedsm.selector_fit`` is ``lda``, else ``mlp``); ``head`` given (a trained bundle's) wins."""
    if head is None:
        head = "linear" if job_cfg["fedsm"]["selector_fit"] == "lda" else "mlp"
    return {"name": job_cfg["fedsm"]["selector"], "num_classes": num_classes,
            "in_channels": job_cfg["net"]["in_channels"],
            "head": head}
