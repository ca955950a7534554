"""LC-Fed (Wang, Jin, Wang, ECCV 2022): personalized federated segmentation via local calibration.

Site k of K trains a U-shaped net (``pflseg.nets.lcfed``) with two additions.

PCS (personalized channel selection), after the last encoder stage, on a feature x (B, C, H, W):

    e_k  = W_2 ReLU(Norm(W_1 onehot(k) + b_1)) + b_2          (widened site embedding, length E)
    h    = sigmoid(W_3 [GAP(x); e_k] + b_3)                     (channel factor, length C)
    x   <- x * h + x

PCS is shared (aggregated); personalization comes from the site's own one-hot vector. Site contrast
(``contrast_on``) pushes site k's augmented embedding away from the other sites' (computed on the same
image with their one-hot vectors through the same PCS, gradients stopped). The augmented embedding is
the channel factor h itself (paper):

    h_k'(x) = sigmoid(W_3 [GAP(x); e_k'] + b_3)  in (0, 1)^C
    L_sc    = - mean_{samples, k' != k} || h_k(x) - sg(h_k'(x)) ||_2         in (-sqrt(C), 0]

so L_sc is bounded and what it separates is what personalizes the network (the gates). Where its
gradient goes is ours to choose (the paper does not say):

    gate      (default) only into the site's own column of the first widening layer (the weights that
              one-hot(k) reads). No other site's gate depends on them, so the stopped gates of the other
              sites really stay where they are. The task loss still trains everything.
    gate_all  into everything that computes h_k (encoder, widening, W_3, b_3). The other sites' gates
              share all of that, so with their gradient stopped, any shift that moves every gate the same
              way counts as progress. Under Adam this can drive the gates into saturation, where all
              sites' gates coincide and L_sc returns to 0 (seen on tiny nets with Adam lr 1e-2: the
              descriptor grew 70-fold and the gate distance fell to 1e-4..1e-6 within 20-200 steps at
              lambda 1-10; at lambda 0.1, lr 1e-3 it rose, then shrank back within 400 steps).
    embedding the same distance on the widened one-hot embeddings e_k, e_k' (the earlier form here); the
              widening can scale them without limit, so L_sc is unbounded below.

HC (head calibration): the coarse head phi_k is personal. Site k applies all sites' heads phi_1..phi_K to
its own decoder feature f (B, F, H, W); the disagreement map is the per-class standard deviation of
their sigmoid predictions,

    U = std_j sigmoid(phi_j(f))                                  (B, C, H, W)

of which only local maxima are kept (NMS: k x k window, threshold 0.2 after max-normalisation per
sample and class), enlarged with a Gaussian filter into a map m, and the feature is calibrated with a
residual, f' = f * m + f; a second personal head psi_k predicts the calibrated map psi_k(f'). The map
carries no gradient. The site loss is

    L = Dice(phi_k(f), y) + Dice(psi_k(f'), y) + lambda * L_sc,      lambda = 0.1 (paper)

and the server takes the plain average of the shared parameters (PCS included); heads stay local.

Window sizes scale with the image. The paper's NMS window and Gaussian size (11; the reference code's NMS
window is 31) are pixel counts for its 384 x 384 inputs (prostate slices, fundus and polyp images resized
to 384): at 64 px an 11-px window covers a sixth of the image instead of a 35th, and keeps far fewer
maxima. With ``window_ref_size`` R > 0 each window w is read as w pixels at side R and used at side S (the
map's shorter side) as :func:`scaled_window`: ``w * S / R`` rounded to the nearest odd integer, at least 3
(a 1-px window keeps every pixel, no NMS at all) and at most 2 S - 1 (larger windows change nothing); an
explicit Gaussian sigma is scaled by S / R likewise. R = 0 uses the windows as given (explicit pixels).
The project's configuration sets R = 384 (``lcfed.window_ref_size``), so 11 stays 11 at 384 px and becomes
3 at 64 px.

What HC's head is fed (``hc_map``), to tell HC's effect apart from that of having a second head:

    disagreement       (paper) U = std over all sites' coarse heads, as above; needs the other heads
    zeros              the map m = 0: f' = f, so the calibrated head is a second plain 1x1 head on the
                       same feature (same loss, no calibration); needs no other head
    self_uncertainty   U = p (1 - p), p = sigmoid of the site's OWN coarse head (its predictive
                       uncertainty), then the same NMS + Gaussian; needs no other head

Only ``disagreement`` needs the other sites' heads, so only it exchanges heads (:func:`exchanges_heads`).

Choices made here: distances are Euclidean; the standard deviation is the population one (a single
head gives U = 0); NMS returns the max-normalised map at the kept maxima and 0 elsewhere; the Gaussian
kernel is scaled to a centre value of 1 (an isolated maximum of height v becomes a blob of height v) and
the enlarged map is clipped to [0, 1]; a per-class map is reduced to one channel by the maximum over
classes before it multiplies the feature. The gate forms of L_sc are bounded by sqrt(C) (C: channels of
the last encoder stage); the embedding form is unbounded below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from pflseg.algorithms.robust import aggregate

State = Mapping[str, torch.Tensor]


class _PCS(Protocol):
    """What this module calls of PCS (``pflseg.nets.lcfed.PCS``); site indices are long tensors.

    The nets layer sits above the algorithms, so the interface is stated here rather than imported.
    """

    def embed(self, site_index: torch.Tensor) -> torch.Tensor:
        """Widened embeddings of sites ``site_index`` ((M,) long) -> (M, E)."""
        ...

    def site_gates(self, descriptor: torch.Tensor, site_index: torch.Tensor) -> torch.Tensor:
        """Gates of descriptors (B, C) under each of M sites' one-hot vectors ((M,) long) -> (B, M, C)."""
        ...

    def own_gate(self, descriptor: torch.Tensor, site_index: torch.Tensor) -> torch.Tensor:
        """Gates of descriptors (B, C) for their own sites ((B,) long) -> (B, C).

        Only the first widening layer's weight gets a gradient, so site k's term moves its own column only.
        """
        ...


class _LCFedNet(Protocol):
    """What this module reads of an LC-Fed net (``pflseg.nets.lcfed.LCFedNet``) beyond ``nn.Module``.

    The nets layer sits above the algorithms, so the interface is stated here rather than imported.
    """

    PERSONAL_MODULES: tuple[str, ...]
    pcs: _PCS | None
    head: torch.nn.Conv2d

    def parts(self, image: torch.Tensor, site_index: int) -> dict:
        """``{"feature", "coarse", "embedding", "gate", "descriptor"}`` of one forward pass."""
        ...

    def calibrated_logits(self, feature: torch.Tensor, umap: torch.Tensor) -> torch.Tensor:
        """HC's calibrated logits (B, C, H, W) from the feature (B, F, H, W) and a map (B, 1 or C, H, W)."""
        ...


def site_contrast_loss(emb_k: torch.Tensor, emb_others: torch.Tensor) -> torch.Tensor:
    """L_sc = - mean Euclidean distance of site k's (augmented) embedding to the other sites'.

    Args:
        emb_k: (E,) or (N, E) embedding(s) or gates of site k, one row per sample.
        emb_others: (M, E) the other sites' embeddings, the same for every row of ``emb_k``; or
            (N, M, E), row n's own M counterparts (e.g. the gates of sample n under the other sites'
            one-hot vectors). Detached here (no gradient reaches them).

    Returns:
        Scalar, the mean over the N x M distances, negated; 0 (still attached to ``emb_k``) when there
        are no other sites. For gates in (0, 1)^E it lies in (-sqrt(E), 0].
    """
    if emb_k.dim() == 1:
        emb_k = emb_k[None]
    shapes = f"{tuple(emb_k.shape)} and {tuple(emb_others.shape)}"
    if emb_k.dim() != 2 or emb_others.dim() not in (2, 3) or emb_others.shape[-1] != emb_k.shape[1]:
        raise ValueError(f"emb_k / emb_others: expected (N, E) and (M, E) or (N, M, E), got {shapes}")
    if emb_others.dim() == 3 and emb_others.shape[0] != emb_k.shape[0]:
        raise ValueError(f"emb_k / emb_others: (N, M, E) others need N = {emb_k.shape[0]} rows, got {shapes}")
    if emb_others.shape[-2] == 0:
        return emb_k.sum() * 0.0
    others = emb_others.detach()
    others = others[None] if others.dim() == 2 else others
    diff = emb_k[:, None, :] - others
    dist = diff.pow(2).sum(dim=-1).clamp_min(1e-12).sqrt()
    return -dist.mean()


def disagreement_map(probs_list: Sequence[torch.Tensor]) -> torch.Tensor:
    """U = per-class (population) standard deviation over heads of their sigmoid predictions.

    Args:
        probs_list: J >= 1 tensors (B, C, H, W) of probabilities, one per head.

    Returns:
        (B, C, H, W); zero where all heads agree.
    """
    if len(probs_list) == 0:
        raise ValueError("probs_list: need at least one head's predictions")
    shape = probs_list[0].shape
    for j, p in enumerate(probs_list):
        if p.dim() != 4 or p.shape != shape:
            raise ValueError(f"probs_list[{j}]: expected shape {tuple(shape)} (B, C, H, W), got {tuple(p.shape)}")
    return torch.stack(list(probs_list)).std(dim=0, correction=0)


def nms(umap: torch.Tensor, window: int = 11, threshold: float = 0.2) -> torch.Tensor:
    """Keep the local maxima of a map, after max-normalisation per sample and class.

    Args:
        umap: (B, C, H, W) non-negative map.
        window: odd side of the square neighbourhood (11 paper, 31 reference code).
        threshold: keep maxima whose normalised value is strictly above it.

    Returns:
        (B, C, H, W): ``umap / max`` (max over H, W) at the kept positions, 0 elsewhere; an all-zero
        map stays zero. Plateaus (equal neighbouring maxima) are all kept.
    """
    if umap.dim() != 4:
        raise ValueError(f"umap: expected (B, C, H, W), got shape {tuple(umap.shape)}")
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window: expected a positive odd int, got {window}")
    peak = umap.amax(dim=(2, 3), keepdim=True)
    norm = torch.where(peak > 0, umap / peak.clamp_min(torch.finfo(umap.dtype).tiny), torch.zeros_like(umap))
    local_max = F.max_pool2d(norm, kernel_size=window, stride=1, padding=window // 2)
    keep = (norm == local_max) & (norm > threshold)
    return norm * keep


def gaussian_kernel(size: int = 11, sigma: float | None = None) -> torch.Tensor:
    """(size, size) Gaussian with centre value 1.

    ``sigma`` defaults to OpenCV's rule 0.3 * ((size - 1) / 2 - 1) + 0.8 (2.0 for size 11).
    """
    if size < 1 or size % 2 == 0:
        raise ValueError(f"size: expected a positive odd int, got {size}")
    if sigma is None:
        sigma = 0.3 * ((size - 1) / 2 - 1) + 0.8
    if sigma <= 0:
        raise ValueError(f"sigma: expected > 0, got {sigma}")
    r = torch.arange(size, dtype=torch.float64) - size // 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    return torch.outer(g, g)


def gaussian_enlarge(umap: torch.Tensor, size: int = 11, sigma: float | None = None) -> torch.Tensor:
    """Spread each kept maximum into a Gaussian blob (per channel), clipped to [0, 1].

    Args:
        umap: (B, C, H, W), typically the output of :func:`nms`.
        size: odd kernel side (11 paper).
        sigma: Gaussian width (see :func:`gaussian_kernel`).

    Returns:
        (B, C, H, W).
    """
    if umap.dim() != 4:
        raise ValueError(f"umap: expected (B, C, H, W), got shape {tuple(umap.shape)}")
    c = umap.shape[1]
    kernel = gaussian_kernel(size, sigma).to(umap.device, umap.dtype).expand(c, 1, size, size)
    out = F.conv2d(umap, kernel, padding=size // 2, groups=c)
    return out.clamp(0.0, 1.0)


def calibrate(feature: torch.Tensor, umap: torch.Tensor) -> torch.Tensor:
    """Residual calibration f' = f * m + f.

    Args:
        feature: (B, F, H, W) decoder feature.
        umap: (B, 1, H, W) or (B, C, H, W) map; several classes are reduced by their maximum.

    Returns:
        (B, F, H, W); equals ``feature`` where the map is zero.
    """
    if feature.dim() != 4 or umap.dim() != 4:
        raise ValueError(f"feature / umap: expected 4-D tensors, got {tuple(feature.shape)} and {tuple(umap.shape)}")
    if umap.shape[0] != feature.shape[0] or umap.shape[2:] != feature.shape[2:]:
        raise ValueError(f"umap: shape {tuple(umap.shape)} does not match feature {tuple(feature.shape)} in B, H, W")
    m = umap.amax(dim=1, keepdim=True) if umap.shape[1] > 1 else umap
    return feature * m + feature


def uncertainty_map(probs_list: Sequence[torch.Tensor], window: int = 11, threshold: float = 0.2,
                    size: int = 11, sigma: float | None = None) -> torch.Tensor:
    """The full HC map: disagreement -> NMS -> Gaussian enlargement, without gradient. (B, C, H, W)."""
    with torch.no_grad():
        return gaussian_enlarge(nms(disagreement_map(probs_list), window, threshold), size, sigma)


def self_uncertainty_map(probs: torch.Tensor) -> torch.Tensor:
    """U = p (1 - p): the site's own predictive uncertainty, the ``self_uncertainty`` control of HC.

    Args:
        probs: (B, C, H, W) sigmoid probabilities of the site's own coarse head.

    Returns:
        (B, C, H, W) in [0, 0.25]; 0 where the head is certain (p = 0 or 1), 0.25 at p = 0.5.
    """
    if probs.dim() != 4:
        raise ValueError(f"probs: expected (B, C, H, W), got shape {tuple(probs.shape)}")
    return probs * (1.0 - probs)


def scaled_window(window: int, side: int, reference: int) -> int:
    """A window given in pixels at image side ``reference``, for a map of side ``side``.

    Args:
        window: odd window side at the reference size (e.g. the paper's 11 at 384 px).
        side: side of the map it is used on (the shorter of H and W).
        reference: the image side ``window`` was chosen for; 0 = ``window`` is used as given.

    Returns:
        ``window`` when ``reference`` is 0; otherwise ``window * side / reference`` rounded to the nearest
        odd integer (2 floor(x / 2) + 1: ties at even values go up), at least 3 (a window of 1 would keep
        every pixel: no suppression) and at most ``2 side - 1`` (a wider window changes nothing).
        E.g. 11 at 384 -> 11, 11 at 64 -> 3, 11 at 256 -> 7, 31 at 64 -> 5.
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window: expected a positive odd int, got {window}")
    if side < 1 or reference < 0:
        raise ValueError(f"side must be >= 1 and reference >= 0, got side={side}, reference={reference}")
    if reference == 0:
        return window
    odd = 2 * math.floor(window * side / reference / 2) + 1
    return max(3, min(odd, 2 * side - 1))


def hc_windows(cfg: Mapping, side: int) -> tuple[int, int, float | None]:
    """``(nms_window, gauss_size, gauss_sigma)`` for a map of side ``side``.

    ``cfg`` holds the keys of STEP_DEFAULTS. The windows are scaled by :func:`scaled_window` with
    ``cfg["window_ref_size"]``, an explicit sigma by the same ratio; a None sigma is derived from the scaled
    size.
    """
    ref = cfg["window_ref_size"]
    sigma = cfg["gauss_sigma"]
    if sigma is not None and ref:
        sigma = sigma * side / ref
    return scaled_window(cfg["nms_window"], side, ref), scaled_window(cfg["gauss_size"], side, ref), sigma


def lcfed_loss(
    coarse_logits: torch.Tensor,
    calib_logits: torch.Tensor | None,
    label: torch.Tensor,
    l_sc: torch.Tensor,
    lam: float = 0.1,
    dice: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """L = Dice(coarse) + Dice(calibrated) + lam * L_sc.

    Args:
        coarse_logits: (B, C, H, W) logits of the coarse head.
        calib_logits: (B, C, H, W) logits of HC, or None when HC is off (the term is dropped).
        label: (B, C, H, W) binary masks.
        l_sc: scalar site-contrast loss (:func:`site_contrast_loss`).
        lam: site-contrast weight (0.1 paper; 0 turns it off).
        dice: loss on (logits, label); default MONAI DiceLoss(sigmoid=True, batch=True).

    Returns:
        Scalar.
    """
    if lam < 0:
        raise ValueError(f"lam: expected >= 0, got {lam}")
    if dice is None:
        from monai.losses import DiceLoss

        dice = DiceLoss(sigmoid=True, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)
    loss = dice(coarse_logits, label)
    if calib_logits is not None:
        loss = loss + dice(calib_logits, label)
    return loss + lam * l_sc


def average_shared(states: Sequence[State], keys: Sequence[str], rule: str = "mean", trim: float = 0.0) -> list[dict]:
    """Plain average of the shared parameters; personal entries stay each site's own.

    Args:
        states: K site states with the same keys and shapes.
        keys: shared keys (:func:`pflseg.nets.lcfed.shared_keys`), averaged with equal weights.
        rule: ``mean`` (default) or a robust rule (``pflseg.algorithms.robust.aggregate``).
        trim: fraction trimmed at each end by ``trimmed_mean`` (``pflseg.algorithms.robust.trim_count``);
            ignored by the other rules.

    Returns:
        K new dicts: the average at ``keys``, the site's own tensor at every other key. Inputs are not
        modified.
    """
    if not states:
        raise ValueError("states: need at least one site state")
    avg = aggregate(states, [1.0] * len(states), keys, rule, trim)
    return [{k: (avg[k].clone() if k in avg else v) for k, v in s.items()} for s in states]


CONTRAST_ON = ("gate", "gate_all", "embedding")
HC_MAPS = ("disagreement", "zeros", "self_uncertainty")

STEP_DEFAULTS = {
    "lam": 0.1,  # site-contrast weight (paper 0.1; reference code 0)
    "contrast_on": "gate",  # gate (PCS's channel factor h, own one-hot weights) | gate_all | embedding
    "hc": True,  # head calibration on/off
    "hc_map": "disagreement",  # what HC's head is fed: disagreement (paper) | zeros | self_uncertainty
    "nms_window": 11,
    "nms_threshold": 0.2,
    "gauss_size": 11,
    "gauss_sigma": None,
    "window_ref_size": 0,  # image side the windows are given for (0: pixels as given; the job config sets 384)
}


def _step_cfg(cfg: Mapping | None) -> dict:
    cfg = dict(cfg or {})
    unknown = set(cfg) - set(STEP_DEFAULTS)
    if unknown:
        raise ValueError(f"cfg: unknown key(s) {sorted(unknown)}; known: {sorted(STEP_DEFAULTS)}")
    cfg = {**STEP_DEFAULTS, **cfg}
    if cfg["contrast_on"] not in CONTRAST_ON:
        raise ValueError(f"cfg: contrast_on must be one of {', '.join(CONTRAST_ON)}, got {cfg['contrast_on']!r}")
    if cfg["hc_map"] not in HC_MAPS:
        raise ValueError(f"cfg: hc_map must be one of {', '.join(HC_MAPS)}, got {cfg['hc_map']!r}")
    return cfg


def exchanges_heads(cfg: Mapping | None) -> bool:
    """Whether site k needs the other sites' coarse heads (and so sends its own).

    It does with HC on and the paper's ``disagreement`` map; the ``zeros`` and ``self_uncertainty`` controls
    use the site's own head only. ``cfg`` is a mapping with (some of) the keys of STEP_DEFAULTS, e.g. the
    job's ``lcfed`` section; other keys are ignored.
    """
    cfg = {**STEP_DEFAULTS, **(cfg or {})}
    return bool(cfg["hc"]) and cfg["hc_map"] == "disagreement"


def site_contrast(
    model: torch.nn.Module, parts: Mapping, site_index: int, n_sites: int, contrast_on: str = "gate"
) -> torch.Tensor:
    """L_sc of one forward pass of site ``site_index`` (module docstring).

    Args:
        model: an LC-Fed net with ``pcs`` (``pflseg.nets.lcfed.PCS``).
        parts: ``model.parts(image, site_index)`` of this pass ("gate", "descriptor", "embedding").
        site_index: k; the others are [0, n_sites) minus k.
        n_sites: K.
        contrast_on: ``gate`` / ``gate_all`` — the sample's gate h_k (B, C) against its gates under the
            other sites' one-hot vectors (B, K - 1, C), computed without gradient; with ``gate`` the
            gradient reaches only site k's own first-layer widening weights (``PCS.own_gate``), with
            ``gate_all`` everything that computed ``parts["gate"]``. ``embedding`` — the widened
            embedding e_k (B, E) against the others' (K - 1, E).

    Returns:
        Scalar.
    """
    if contrast_on not in CONTRAST_ON:
        raise ValueError(f"contrast_on must be one of {', '.join(CONTRAST_ON)}, got {contrast_on!r}")
    pcs = cast(_PCS, model.pcs)  # a net with PCS: L_sc is computed only then
    device = parts["embedding"].device
    others = torch.tensor([j for j in range(n_sites) if j != site_index], dtype=torch.long, device=device)
    if contrast_on == "embedding":
        return site_contrast_loss(parts["embedding"], pcs.embed(others).detach())
    with torch.no_grad():
        other_gates = pcs.site_gates(parts["descriptor"].detach(), others)
    if contrast_on == "gate_all":
        return site_contrast_loss(parts["gate"], other_gates)
    own = torch.full((parts["descriptor"].shape[0],), site_index, dtype=torch.long, device=device)
    return site_contrast_loss(pcs.own_gate(parts["descriptor"], own), other_gates)


def head_map(model: torch.nn.Module, feature: torch.Tensor, other_heads: Sequence[State], cfg: Mapping) -> torch.Tensor:
    """HC's map for site features (B, F, H, W), without gradient. (B, C, H, W), C = the heads' classes.

    ``cfg`` (keys of STEP_DEFAULTS) ``hc_map`` picks the source (module docstring): ``disagreement`` applies
    the site's own coarse head and the other sites' heads (1x1 conv states ``{"weight": (C, F, 1, 1),
    "bias": (C,)}``) to the feature and takes their std; ``self_uncertainty`` takes p (1 - p) of the
    site's own coarse head (``other_heads`` unused); both then go through NMS and the Gaussian
    enlargement with the windows of :func:`hc_windows` at side min(H, W). ``zeros`` returns an all-zero
    map (no calibration: the calibrated head sees the plain feature).
    """
    cfg = _step_cfg(cfg)
    head = cast(_LCFedNet, model).head
    with torch.no_grad():
        feature = feature.detach()
        if cfg["hc_map"] == "zeros":
            b, _, h, w = feature.shape
            return feature.new_zeros(b, head.out_channels, h, w)
        own = torch.sigmoid(head(feature))
        if cfg["hc_map"] == "self_uncertainty":
            raw = self_uncertainty_map(own)
        else:
            probs = [own]
            for j, other in enumerate(other_heads):
                if "weight" not in other:
                    raise KeyError(f"other_heads[{j}]: needs 'weight' (and optionally 'bias') of a 1x1 conv")
                weight = other["weight"].to(feature.device, feature.dtype)
                bias = other["bias"].to(feature.device, feature.dtype) if "bias" in other else None
                probs.append(torch.sigmoid(F.conv2d(feature, weight, bias)))
            raw = disagreement_map(probs)
        window, size, sigma = hc_windows(cfg, min(feature.shape[-2:]))
        return gaussian_enlarge(nms(raw, window, cfg["nms_threshold"]), size, sigma)


def set_phase(model: torch.nn.Module, phase: str) -> None:
    """Choose which parameters the next steps train.

    ``phase`` is ``head`` (the personal modules, ``model.PERSONAL_MODULES``), ``body`` (everything else) or
    ``all``; the others get ``requires_grad`` False (no gradient, so the optimizer leaves them unchanged).
    The reference code's / FedRep's schedule is head, then body.
    """
    if phase not in ("head", "body", "all"):
        raise ValueError(f"phase: expected head, body or all, got {phase!r}")
    personal = tuple(f"{m}." for m in cast(_LCFedNet, model).PERSONAL_MODULES)
    for name, p in model.named_parameters():
        p.requires_grad_(phase == "all" or name.startswith(personal) == (phase == "head"))


class SitePredictor(torch.nn.Module):
    """Site k's segmentation model as ``forward(image) -> logits``.

    The logits are the calibrated head's when HC is on (map by :func:`head_map`: from its own and
    ``other_heads`` with ``hc_map`` disagreement), the coarse head's otherwise. Wraps (does not copy)
    ``model``.
    """

    def __init__(self, model: torch.nn.Module, site_index: int, other_heads: Sequence[State],
                 cfg: Mapping | None = None):
        super().__init__()
        self.model, self.site_index, self.other_heads, self.cfg = model, site_index, list(other_heads), _step_cfg(cfg)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Logits (B, C, H, W) of site k for an image batch (B, in_channels, H, W)."""
        net = cast(_LCFedNet, self.model)
        out = net.parts(image, self.site_index)
        if not self.cfg["hc"]:
            return out["coarse"]
        return net.calibrated_logits(out["feature"], head_map(self.model, out["feature"], self.other_heads, self.cfg))


def lcfed_step(
    model: torch.nn.Module,
    batch,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    other_heads: Sequence[State],
    site_index: int,
    n_sites: int,
    cfg: Mapping | None = None,
) -> dict[str, float]:
    """One optimizer step of site ``site_index``: Dice(coarse) + Dice(calibrated) + lam * L_sc.

    Args:
        model: an LC-Fed net (``pflseg.nets.lcfed.LCFedNet``: ``parts(image, site) -> dict``, ``head``,
            ``pcs`` (may be None: no L_sc), ``calibrated_logits``).
        batch: ``(image, label)`` or ``{"image": ..., "label": ...}``; image (B, in, H, W), label (B, C, H, W).
        optimizer: over the parameters to train (parameters with ``requires_grad`` False are not updated).
        loss_fn: Dice on (logits, label).
        other_heads: the other sites' coarse heads as 1x1 conv states ``{"weight": (C, F, 1, 1),
            "bias": (C,)}``, applied to this site's own feature; with the site's own head they give the
            disagreement map (computed without gradient). Used only with HC on and ``cfg["hc_map"]``
            ``disagreement`` (:func:`exchanges_heads`).
        site_index: k in [0, n_sites).
        n_sites: K; the other sites' gates / embeddings (for L_sc, :func:`site_contrast`) use the one-hot
            vectors of [0, K) minus k.
        cfg: keys of STEP_DEFAULTS (``contrast_on``: gate (default) | gate_all | embedding; ``hc_map``:
            disagreement (default) | zeros | self_uncertainty, see :func:`head_map`).

    Returns:
        ``{"loss": total, "sc": L_sc}`` (values before the step).
    """
    cfg = _step_cfg(cfg)
    if not 0 <= site_index < n_sites:
        raise ValueError(f"site_index: expected a value in [0, {n_sites}), got {site_index}")
    image, label = (batch["image"], batch["label"]) if isinstance(batch, Mapping) else batch

    net = cast(_LCFedNet, model)
    model.train()
    optimizer.zero_grad()
    out = net.parts(image, site_index)
    if net.pcs is not None:
        l_sc = site_contrast(model, out, site_index, n_sites, cfg["contrast_on"])
    else:
        l_sc = torch.zeros((), device=image.device)
    calib = None
    if cfg["hc"]:
        calib = net.calibrated_logits(out["feature"], head_map(model, out["feature"], other_heads, cfg))
    loss = lcfed_loss(out["coarse"], calib, label, l_sc, lam=cfg["lam"], dice=loss_fn)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"LC-Fed loss became {loss.item()}; lower train.lr")
    loss.backward()
    optimizer.step()
    return {"loss": float(loss.detach()), "sc": float(l_sc.detach())}
