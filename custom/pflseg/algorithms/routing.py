"""IOP-FL outside personalization: test-time routing of K + 1 frozen experts (Jiang et al., IEEE TMI 2023).

Experts: the K local adapted models P_1..P_K and the global model w_g, all of one architecture. The
routed model is a copy of that network in which every convolution and transposed convolution is a
``RoutedConv`` holding the E = K + 1 expert kernels; for each sample x of a batch and each layer::

    r = router(GAP(layer input))  in R^E          W(x) = sum_e r_e W_e ,  b(x) = sum_e r_e b_e

Routers (``router``); what is the paper's, the reference code's and ours:
    paper         per sample, per layer, the paper's Eq. 6: r = sigmoid(W GAP(x) + b), one linear map and an
                  INDEPENDENT sigmoid per expert (the coefficients need not sum to 1), initialised as the
                  paper does so that every coefficient starts at exactly 1/E (W = 0, b = log(1 / (E - 1)),
                  E = K + 1): the routed model starts at the experts' average. Once trained, the sums drift
                  from 1, and a layer's kernel scale with them.
    normalised    ours: as ``paper`` with r divided by its sum (the mixed kernel stays a convex combination)
                  and W, b starting at 0 (r_e = 1/E). Called ``paper`` before; it is not the paper's. The
                  routing job's default (chosen by measurement, see ``pflseg.infer.routing``).
    refcode       per sample, per layer: the reference code's router, Linear(C, 2C) -> Dropout(0.2) ->
                  Linear(2C, E) -> independent sigmoids, default PyTorch init (it does not start at the
                  average: each coefficient starts near 0.5).
    model         the paper's "IOP-FL (Global)" ablation: ONE coefficient vector for the whole model, shared
                  by every routed layer and every sample (a single (E,) Parameter).
    layer_global  ours, not in the paper: one coefficient vector per layer, shared by all samples. Called
                  ``global`` before; that name is refused now because it was not the paper's ablation.
    ``model`` and ``layer_global`` use independent sigmoids starting at 1/E (as ``paper``), or with
    ``normalised=True`` ours (divided by their sum, logits starting at 0).

All E experts are in every routed layer and every router is trained (the reference code drops a source
site in some layers and leaves the bottleneck routers untrained). The other parameters (normalisation,
PReLU) are the experts' average (``rest="average"``: with a router that starts at 1/E the routed model then
starts exactly at the averaged model) or, as the reference code does, the global model's (``rest="global"``:
it loads w_g and replaces only the convolutions); batch norm uses the test batch's statistics (instance norm
needs nothing); only routers, and optionally the normalisation layers' affine parameters (the reference
code trains them), are trainable. Per-sample kernels are applied as ONE grouped convolution over the batch
(B * groups groups), never a Python loop over samples (``RoutedConv.forward_loop`` is the reference loop the
tests compare with).

A router sees its layer's input pooled per channel (GAP), as in the paper. The first routed layer's input is
the image, z-scored per image and channel by the data pipeline: its per-channel mean is 0 and its standard
deviation 1 for EVERY image, so any router fed per-channel moments of it (mean, or mean and std) sees a
constant: that layer's per-sample router is effectively its bias alone, one coefficient vector for all
images (``pflseg.infer.routing`` reports the spread of each layer's coefficients over the images). The
deeper layers' inputs differ from image to image.

Unsupervised test-time loss per sample, on sigmoid probabilities p (B, C, H, W)::

    L = w_cons L_cons + w_shape L_shape + w_ent L_ent + w_size L_size      paper: (1, beta, beta, 0), beta = 0.01
    L_cons  = mean (p(x) - p(x + eps))^2, eps ~ N(0, sigma^2) on the normalised image (sigma = 0.5), option
              a random rot90/flip of the noisy input that is undone on its output
    L_shape = sum_c MEAN_pixels (max_{(2d+1)^2 window} p_c - min_{window} p_c)     (``shape_reduction="mean"``)
    L_ent   = mean pixel binary entropy
    L_size  = sum_c KL( Bernoulli(q_c) || Bernoulli(pi_c) ),  q_c = the batch's mean p_c (its predicted foreground
              fraction), pi_c = the size prior: the inside sites' training-label foreground fraction of class c

Scales (``tests/unit/algorithms/test_routing.py``). Every term is 0 on a constant 0/1 map (L_size when that map's
fraction is the prior). Each term is a per-pixel MEAN, so none grows with the image: on a 64 x 64 disc of radius
12 with a soft 2 px edge, the paper's weights give beta L_shape and beta L_ent of the order of 1e-4 - 1e-3, L_cons
of 1e-4 - 1e-2 under the project's noise, and a fraction 20 % off the prior costs L_size of 1e-3 - 1e-2: the
weighted terms stay within a factor 100 of each other. The paper's Eq. 9 writes the shape term as a SUM over
pixels (``shape_reduction="sum"``, kept as an option); with beta = 0.01 that sum weighs H x W times the mean form
and, at 64 x 64 with a small foreground, outweighs the entropy and consistency terms ~1e3-fold: minimising it
shrinks the mask (a perimeter penalty), which is what every routing run on the bench preset did. The size prior
is the counterweight to that trivial minimum (an empty or shrinking map is consistent, smooth and certain) inside
the objective; its weight ``w_size`` is chosen on validation sites (``pflseg.eval.routing_validation``).
``refcode`` weights are what the reference code optimises, rewritten per sample: 10 times its
entropy, which it SUMS over the batch (a sum over dim 0 where the classes were meant) in bits and averages
over its two softmax classes, i.e. 10 B / (2 ln 2) times our per-sample mean entropy in nats at batch size
B, plus 0.1 L_cons; its shape term (1e-6 times the L2 norm of the max - min maps) is negligible and dropped.
Per sample, the prediction made at its lowest loss is kept (``BestPredictions``); labels never choose.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pflseg.algorithms.iopfl import average_states

ROUTERS = ("paper", "normalised", "refcode", "model", "layer_global")
LOSS_WEIGHTS = ("paper", "refcode")
SHAPE_REDUCTIONS = ("mean", "sum")
RESTS = ("average", "global")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_T = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_NORM = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm, nn.LayerNorm)


def uniform_logit(n_experts: int) -> float:
    """The logit whose sigmoid is exactly 1/E: log(1 / (E - 1)) (E >= 2)."""
    if n_experts < 2:
        raise ValueError(f"n_experts must be >= 2, got {n_experts}")
    return -math.log(n_experts - 1)


# ---------------------------------------------------------------------------------------------------
# Routers: pooled layer input (B, C) -> coefficients (B, E) (or (1, E) for the coefficient routers)
# ---------------------------------------------------------------------------------------------------


class PaperRouter(nn.Module):
    """The paper's router (Eq. 6): independent sigmoids of one linear map, each starting at exactly 1/E.

    W = 0 and b = log(1 / (E - 1)) (the paper initialises every coefficient at 1/(K + 1)); the coefficients
    are not normalised and need not sum to 1 once trained. (B, C) -> (B, E).
    """

    per_sample = True

    def __init__(self, in_channels: int, n_experts: int):
        super().__init__()
        self.fc = nn.Linear(in_channels, n_experts)
        nn.init.zeros_(self.fc.weight)
        nn.init.constant_(self.fc.bias, uniform_logit(n_experts))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled layer input (B, C) -> coefficients (B, E), each in (0, 1)."""
        return torch.sigmoid(self.fc(pooled))


class NormalisedRouter(nn.Module):
    """Ours: sigmoid(Linear(C, E)) divided by its sum; zero init = uniform 1/E. (B, C) -> (B, E)."""

    per_sample = True

    def __init__(self, in_channels: int, n_experts: int):
        super().__init__()
        self.fc = nn.Linear(in_channels, n_experts)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled layer input (B, C) -> coefficients (B, E), each row summing to 1."""
        r = torch.sigmoid(self.fc(pooled))
        return r / r.sum(dim=1, keepdim=True)


class RefcodeRouter(nn.Module):
    """Linear(C, 2C) -> Dropout -> Linear(2C, E) -> independent sigmoids (reference code). (B, C) -> (B, E)."""

    per_sample = True

    def __init__(self, in_channels: int, n_experts: int, dropout: float = 0.2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_channels, 2 * in_channels), nn.Dropout(dropout),
                                 nn.Linear(2 * in_channels, n_experts))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled layer input (B, C) -> coefficients (B, E), each in (0, 1)."""
        return torch.sigmoid(self.net(pooled))


class CoefficientRouter(nn.Module):
    """Coefficients that ignore the input: r = sigmoid(l), l (E,), output (1, E) the same for every sample.

    ``normalised=False`` (the paper's independent sigmoids): l starts at log(1 / (E - 1)), r_e = 1/E.
    ``normalised=True`` (ours): r = sigmoid(l) / sum sigmoid(l), l starting at 0 (r_e = 1/E).
    One instance per layer is ``layer_global``; ONE instance shared by every routed layer is ``model``
    (the paper's "IOP-FL (Global)").
    """

    per_sample = False

    def __init__(self, n_experts: int, normalised: bool = False):
        super().__init__()
        self.normalised = normalised
        start = 0.0 if normalised else uniform_logit(n_experts)
        self.logits = nn.Parameter(torch.full((n_experts,), start))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """Coefficients (1, E), the same for every sample; ``pooled`` (B, C) is not read."""
        r = torch.sigmoid(self.logits)
        return (r / r.sum() if self.normalised else r)[None]


def make_router(kind: str, in_channels: int, n_experts: int, normalised: bool = False) -> nn.Module:
    """A new router of ``kind`` for one layer.

    ``model`` here is a layer's own vector; build_routed_model shares one instance across the layers.
    ``normalised`` applies to ``model`` and ``layer_global``.
    """
    if kind == "paper":
        return PaperRouter(in_channels, n_experts)
    if kind == "normalised":
        return NormalisedRouter(in_channels, n_experts)
    if kind == "refcode":
        return RefcodeRouter(in_channels, n_experts)
    if kind in ("layer_global", "model"):
        return CoefficientRouter(n_experts, normalised)
    hint = (" ('global' was renamed: 'model' is the paper's IOP-FL (Global), one coefficient per expert for"
            " the whole model; 'layer_global' is one coefficient vector per layer)") if kind == "global" else ""
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {kind!r}{hint}")


# ---------------------------------------------------------------------------------------------------
# The routed layer
# ---------------------------------------------------------------------------------------------------


class RoutedConv(nn.Module):
    """A (transposed) convolution whose kernel is a per-sample mix of E frozen expert kernels.

    Args:
        experts: E modules of one type (``nn.Conv{1,2,3}d`` or ``nn.ConvTranspose{1,2,3}d``) and one
            configuration; their weights (and biases) become frozen buffers of shape (E, *weight.shape).
        router: ``paper`` | ``normalised`` | ``refcode`` | ``model`` | ``layer_global`` (see the module
            docstring), or a router module to use as is (``build_routed_model(router="model")`` passes the
            one shared :class:`CoefficientRouter` to every layer).
        normalised: ``model`` / ``layer_global`` coefficients divided by their sum (ours).

    Input (B, C_in, *spatial) -> output (B, C_out, *spatial_out), as the expert convolution would give.
    """

    # buffers, (E, *expert weight shape) and (E, C_out) or None
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, experts: Sequence[nn.Module], router: str | nn.Module = "paper", normalised: bool = False):
        super().__init__()
        first = experts[0]
        if not isinstance(first, _CONV + _CONV_T):
            raise TypeError(f"experts: expected convolutions, got {type(first).__name__}")
        weights, biases = [], []
        for e in experts:
            # ``isinstance`` adds no condition (``first`` passed it); it tells the type checker what ``e`` is
            if (not isinstance(e, _CONV + _CONV_T) or type(e) is not type(first)
                    or e.weight.shape != first.weight.shape or (e.bias is None) != (first.bias is None)):
                raise ValueError("experts: every expert layer must have the same type, kernel shape and bias")
            weights.append(e.weight.detach())
            if e.bias is not None:
                biases.append(e.bias.detach())
        if first.padding_mode != "zeros":
            raise ValueError(f"RoutedConv supports padding_mode='zeros' only, got {first.padding_mode!r}")
        self.transposed = isinstance(first, _CONV_T)
        self.dims = first.weight.ndim - 2
        self.stride, self.padding, self.dilation, self.groups = (first.stride, first.padding, first.dilation,
                                                                 first.groups)
        self.output_padding = first.output_padding if self.transposed else None
        self.register_buffer("weight", torch.stack(weights).clone())
        self.register_buffer("bias", torch.stack(biases).clone() if first.bias is not None else None)
        if isinstance(router, nn.Module):
            self.router_kind = "model" if isinstance(router, CoefficientRouter) else type(router).__name__
            self.router = router
        else:
            self.router_kind = router
            self.router = make_router(router, first.in_channels, len(experts), normalised)

    @property
    def n_experts(self) -> int:
        """E, the number of expert kernels mixed."""
        return self.weight.shape[0]

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, ...) -> (B, E) routing coefficients from the globally pooled input."""
        r = self.router(x.mean(dim=tuple(range(2, x.ndim))))
        return r.expand(x.shape[0], -1)

    def _conv(self, x, w, b, groups):
        if self.transposed:
            # a transposed convolution's padding is never a string and it always has an output padding
            padding = cast(tuple[int, ...], self.padding)
            output_padding = cast(tuple[int, ...], self.output_padding)
            conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.dims - 1]
            return conv_t(x, w, b, self.stride, padding, output_padding, groups, self.dilation)
        conv = (F.conv1d, F.conv2d, F.conv3d)[self.dims - 1]
        return conv(x, w, b, self.stride, self.padding, self.dilation, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, *spatial) -> (B, C_out, *spatial_out): each sample convolved with its coefficients' kernel."""
        r = self.coefficients(x)  # (B, E)
        if not getattr(self.router, "per_sample", True):  # one kernel for the whole batch: a plain convolution
            w = torch.einsum("e,e...->...", r[0], self.weight)
            b = r[0] @ self.bias if self.bias is not None else None
            return self._conv(x, w, b, self.groups)
        batch = x.shape[0]
        w = torch.einsum("be,e...->b...", r, self.weight)  # (B, *weight shape)
        w = w.reshape(batch * w.shape[1], *w.shape[2:])
        b = (r @ self.bias).reshape(-1) if self.bias is not None else None
        out = self._conv(x.reshape(1, batch * x.shape[1], *x.shape[2:]), w, b, batch * self.groups)
        return out.reshape(batch, -1, *out.shape[2:])

    def forward_loop(self, x: torch.Tensor) -> torch.Tensor:
        """Reference path: one convolution per sample (for tests; same result as ``forward``)."""
        r = self.coefficients(x)
        outs = []
        for i in range(x.shape[0]):
            w = torch.einsum("e,e...->...", r[i], self.weight)
            b = r[i] @ self.bias if self.bias is not None else None
            outs.append(self._conv(x[i:i + 1], w, b, self.groups))
        return torch.cat(outs)


# ---------------------------------------------------------------------------------------------------
# Building the routed model from any network
# ---------------------------------------------------------------------------------------------------


def use_batch_stats(model: nn.Module) -> nn.Module:
    """Batch-norm layers of ``model`` use the current batch's statistics in train and eval mode alike."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
            m.num_batches_tracked = None
    return model


def norm_affine_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Affine parameters of the normalisation layers (found by module type)."""
    return [p for m in model.modules() if isinstance(m, _NORM) for p in m.parameters(recurse=False)]


def router_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routers' parameters, each once (the ``model`` router's one vector is shared by all layers)."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, RoutedConv):
            for p in m.router.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def build_routed_model(experts: Sequence[nn.Module], router: str = "paper", norm_affine: bool = False,
                       rest: str = "average", normalised: bool = False) -> nn.Module:
    """The routed model of ``experts`` (E networks of one architecture, e.g. [P_1, ..., P_K, w_g]).

    Every ``nn.Conv*`` / ``nn.ConvTranspose*`` becomes a ``RoutedConv`` over the E corresponding layers;
    every other parameter and buffer comes from ``rest``; batch norm uses batch statistics. Only the
    routers (and, with ``norm_affine``, the norm layers' affine parameters) require gradients. The
    experts are not modified.

    Args:
        experts: E >= 2 networks of one architecture; the last is the global model w_g.
        router: ``paper`` (default) | ``normalised`` | ``refcode`` | ``model`` | ``layer_global`` (module
            docstring). With ``model`` every routed layer holds the SAME :class:`CoefficientRouter`: one
            (E,) Parameter for the whole model (:func:`router_parameters` lists it once).
        norm_affine: also train the normalisation layers' affine parameters.
        rest: the parameters and buffers that are not routed: ``average`` (the experts' average) or
            ``global`` (the last expert's, as the reference code).
        normalised: ``model`` / ``layer_global`` coefficients divided by their sum (ours; default the
            paper's independent sigmoids).

    Returns:
        The routed model: input and output as the experts'.
    """
    if len(experts) < 2:
        raise ValueError(f"experts: need at least 2 networks to route between, got {len(experts)}")
    if rest not in RESTS:
        raise ValueError(f"rest must be one of {', '.join(RESTS)}, got {rest!r}")
    keys = list(experts[0].state_dict())
    for i, e in enumerate(experts[1:], 1):
        if list(e.state_dict()) != keys:
            raise ValueError(f"experts[{i}] has another architecture than experts[0] (state keys differ)")
    model = copy.deepcopy(experts[0])
    if rest == "average":
        model.load_state_dict(average_states([e.state_dict() for e in experts]))
    else:
        model.load_state_dict(experts[-1].state_dict())
    model.requires_grad_(False)
    by_name = [dict(e.named_modules()) for e in experts]
    targets = routed_layer_names(model)
    make_router(router, 1, len(experts))  # checks the name before any work
    shared = CoefficientRouter(len(experts), normalised) if router == "model" else None
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = RoutedConv([m[name] for m in by_name], shared if shared is not None else router, normalised)
        setattr(parent, attr, layer)
    use_batch_stats(model)
    for p in norm_affine_parameters(model) if norm_affine else []:
        p.requires_grad_(True)
    return model


def routed_layer_names(model: nn.Module) -> list[str]:
    """Names of the (transposed) convolutions of ``model``: the layers routing mixes, in module order."""
    names = [name for name, m in model.named_modules() if isinstance(m, _CONV + _CONV_T)]
    if not names:
        raise ValueError("experts: the network has no convolution to route")
    return names


def relative_distances(experts: Sequence[nn.Module]) -> list[float]:
    """||theta_e - theta_g|| / ||theta_g|| for every expert e, in expert order.

    The norms are over the routed layers' weights and biases (what routing mixes); theta_g is the LAST
    expert's (w_g; its own distance is 0).
    """
    names = routed_layer_names(experts[-1])

    def flat(net):
        layers = dict(net.named_modules())
        return torch.cat([p.detach().double().flatten() for n in names for p in layers[n].parameters(recurse=False)])

    ref = flat(experts[-1])
    return [float((flat(e) - ref).norm() / ref.norm()) for e in experts]


# ---------------------------------------------------------------------------------------------------
# The unsupervised test-time loss
# ---------------------------------------------------------------------------------------------------


def loss_weights(kind: str, beta: float = 0.01, batch_size: int | None = None, size: float = 0.0) -> dict:
    """Weights of (cons, shape, ent, size) of the per-sample loss.

    ``paper``: (1, beta, beta, ``size``). ``refcode``: (0.1, 0, 10 B / (2 ln 2), ``size``) with B = ``batch_size``
    (required): the reference code sums its entropy over the batch, in bits, averaged over its two softmax classes
    (module docstring); per sample that is 10 B / (2 ln 2) times the mean entropy in nats. ``size`` (>= 0) weighs
    the size prior L_size (0: not computed; neither paper nor reference code has it).
    """
    if not (size >= 0 and math.isfinite(size)):
        raise ValueError(f"size: the size prior's weight must be finite and >= 0, got {size!r}")
    if kind == "paper":
        return {"cons": 1.0, "shape": beta, "ent": beta, "size": float(size)}
    if kind == "refcode":
        if batch_size is None or batch_size < 1:
            raise ValueError(f"loss_weights('refcode') needs the batch size (its entropy is a batch sum), "
                             f"got {batch_size!r}")
        return {"cons": 0.1, "shape": 0.0, "ent": 10.0 * batch_size / (2 * math.log(2)), "size": float(size)}
    raise ValueError(f"loss_weights must be one of {', '.join(LOSS_WEIGHTS)}, got {kind!r}")


def shape_loss(probs: torch.Tensor, radius: int = 2, reduction: str = "mean") -> torch.Tensor:
    """Per sample: sum over classes of (local max - local min) over a (2r+1)^2 window, pooled over pixels.

    The pixels are averaged (``reduction="mean"``, the default: commensurate with the other terms at any image
    size) or summed (``"sum"``: the paper's Eq. 9, H x W times the mean; module docstring).

    Args:
        probs: (B, C, H, W) probabilities.
        radius: r >= 1, the window's half side.
        reduction: ``mean`` or ``sum`` (the paper's) over the pixels.

    Returns:
        (B,) losses; 0 for a constant map.
    """
    if radius < 1:
        raise ValueError(f"radius must be >= 1, got {radius}")
    if reduction not in SHAPE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(SHAPE_REDUCTIONS)}, got {reduction!r}")
    k = 2 * radius + 1
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[probs.ndim - 3]
    local_max = pool(probs, k, stride=1, padding=radius)
    local_min = -pool(-probs, k, stride=1, padding=radius)
    per_pixel = (local_max - local_min).flatten(2)
    return (per_pixel.sum(2) if reduction == "sum" else per_pixel.mean(2)).sum(1)


def entropy(probs: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per sample mean binary entropy (nats) of sigmoid probabilities (B, C, ...) -> (B,); maximal at 0.5."""
    p = probs.clamp(eps, 1 - eps)
    return -(p * p.log() + (1 - p) * (1 - p).log()).flatten(1).mean(1)


def consistency(probs: torch.Tensor, probs_aug: torch.Tensor) -> torch.Tensor:
    """Per sample mean squared difference of two probability maps (B, C, ...) -> (B,)."""
    return (probs - probs_aug).pow(2).flatten(1).mean(1)


def size_prior(probs: torch.Tensor, prior: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL(Bernoulli(q_c) || Bernoulli(pi_c)) summed over the classes, q_c = the batch's mean probability of class c.

    The batch's predicted foreground fraction against the prior fraction (one number per class): 0 when they are
    equal, growing as the prediction shrinks or swells away from the prior; d/dq_c = log(q_c (1 - pi_c) / ((1 -
    q_c) pi_c)) pulls q_c towards pi_c. Judged over the batch, not per image: one slice may hold no foreground.

    Args:
        probs: (B, C, ...) probabilities.
        prior: (C,) foreground fractions in (0, 1) (clamped to [eps, 1 - eps]).
        eps: the clamp of q_c and pi_c (keeps the logarithms finite).

    Returns:
        (B,): the batch's value for every sample of it.
    """
    if prior.ndim != 1 or prior.shape[0] != probs.shape[1]:
        raise ValueError(f"prior: expected ({probs.shape[1]},) foreground fractions, one per class, got "
                         f"{tuple(prior.shape)}")
    q = probs.transpose(0, 1).flatten(1).mean(1).clamp(eps, 1 - eps)  # (C,)
    pi = prior.to(q).clamp(eps, 1 - eps)
    kl = q * (q / pi).log() + (1 - q) * ((1 - q) / (1 - pi)).log()
    return kl.sum().expand(probs.shape[0])


def _rot_flip(x: torch.Tensor, k: int, flip: bool, undo: bool = False) -> torch.Tensor:
    if undo:
        x = x.flip(-1) if flip else x
        return torch.rot90(x, -k, dims=(-2, -1))
    x = torch.rot90(x, k, dims=(-2, -1))
    return x.flip(-1) if flip else x


def unsupervised_loss(model: nn.Module, images: torch.Tensor, weights: dict, noise_std: float = 0.5,
                      rot_flip: bool = False, radius: int = 2, shape_reduction: str = "mean",
                      prior: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample test-time loss and the probabilities of the clean input.

    Args:
        model: image (B, C_in, H, W) -> logits (B, C, H, W).
        images: the normalised images.
        weights: {"cons", "shape", "ent", "size"} (``loss_weights``); a zero (or absent) weight skips its term
            (and the second forward pass when ``cons`` is 0).
        noise_std: sigma of the Gaussian noise of the consistency term.
        rot_flip: also apply a random rot90/flip to the noisy input, undone on its output (2D only).
        radius: window radius d of the shape term.
        shape_reduction: ``mean`` (default) or ``sum`` (the paper's) over the pixels (:func:`shape_loss`).
        prior: (C,) the size prior's foreground fractions (:func:`size_prior`); needed when ``weights["size"]``.

    Returns:
        (loss (B,), probs (B, C, H, W)).
    """
    probs = torch.sigmoid(model(images))
    loss = torch.zeros(images.shape[0], device=images.device)
    if weights.get("cons", 0.0):
        noisy = images + noise_std * torch.randn_like(images)
        if rot_flip:
            k, flip = int(torch.randint(0, 4, ())), bool(torch.randint(0, 2, ()))
            p_aug = _rot_flip(torch.sigmoid(model(_rot_flip(noisy, k, flip))), k, flip, undo=True)
        else:
            p_aug = torch.sigmoid(model(noisy))
        loss = loss + weights["cons"] * consistency(probs, p_aug)
    if weights.get("shape", 0.0):
        loss = loss + weights["shape"] * shape_loss(probs, radius, shape_reduction)
    if weights.get("ent", 0.0):
        loss = loss + weights["ent"] * entropy(probs)
    if weights.get("size", 0.0):
        if prior is None:
            raise ValueError("the size prior's weight is > 0 but no prior (foreground fractions) was given")
        loss = loss + weights["size"] * size_prior(probs, prior)
    return loss, probs


class BestPredictions:
    """Per sample, the prediction made when its unsupervised loss was lowest (ties keep the first)."""

    def __init__(self):
        self.loss: dict = {}
        self.pred: dict = {}

    def update(self, keys: Sequence, losses: torch.Tensor, preds: torch.Tensor) -> None:
        """keys: B hashable sample ids; losses (B,); preds (B, ...) (stored detached on the CPU)."""
        if len(keys) != losses.shape[0] or len(keys) != preds.shape[0]:
            raise ValueError(f"keys ({len(keys)}), losses {tuple(losses.shape)} and preds {tuple(preds.shape)} "
                             "disagree")
        for key, loss, pred in zip(keys, losses.detach().cpu().tolist(), preds.detach().cpu()):
            if math.isfinite(loss) and (key not in self.loss or loss < self.loss[key]):
                self.loss[key], self.pred[key] = loss, pred.clone()
