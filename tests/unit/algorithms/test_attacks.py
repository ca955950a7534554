"""One lying site (or two colluders) inside the bounds, as pure-function experiments (issue 39 F1, F2, F5, F6, F7;
and the parts bounded since: FedSM's epoch-mode selector gradients, FedSM-extra's LDA statistics, LC-Fed's coarse
heads, IOP-FL's published P_k).

Each experiment runs the project's own functions the way the server does in a round (``pflseg.flare.guard``:
n_k capped against the others, each update clipped at ``robust.clip`` x the others' median, then the method's
aggregation) at K = 3 and K = 5, once with the defaults (``app_configs/defaults.yaml``) and once with the bounds
of before issue 39 (n_k cap 100, norm bound 100, no clipping, weighted trimmed mean; FedSM's moments and LDA
statistics as checked then). ``attack_table`` gives the figures; ``python -m tests.unit.algorithms.test_attacks``
prints the markdown table of docs/privacy.md.

Movement multiple: ||w_after - w_before|| of the global model in the attacked round over the median norm of the
honest sites' updates that round. Honest updates share a direction (cosine about 0.5 between sites) and their
norms differ up to 1.3 : 0.7; honest n_k are equal (100) so that "99x the others' median" is the issue's claim.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from pflseg.algorithms.fedsm import (
    add_statistics,
    average_moments,
    check_statistics,
    class_statistics,
    flatten_optimizer_state,
    lda_head,
    pooled_adam_step,
)
from pflseg.algorithms.grace import grace_step
from pflseg.algorithms.lcfed import disagreement_map
from pflseg.algorithms.robust import (
    aggregate,
    bound_moments,
    bounded_weights,
    check_moments,
    clip_statistics,
    clip_updates,
    combine_rows,
    norm_outliers,
)
from pflseg.config import load_job_config

SHAPES = {"conv.weight": (16, 8, 3, 3), "conv.bias": (16,), "head.weight": (4, 16)}
N_HONEST = 100
SEEDS = (0, 1, 2)


def defaults() -> dict:
    """The ``robust`` section of the job config's defaults."""
    return dict(load_job_config("fedavg")["robust"])


#: the bounds before issue 39: n_k cap and norm bound 100, no clipping, trimmed mean weighted by n_k
BEFORE = {"aggregation": "mean", "trim": 0.2, "clip": 0.0, "n_k_ratio": 100.0, "norm_ratio": 100.0}


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in state.values()])


def _unflat(vec: torch.Tensor) -> dict:
    out, i = {}, 0
    for key, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        out[key] = vec[i:i + n].reshape(shape).float()
        i += n
    return out


def honest_round(k: int, seed: int) -> tuple[dict, list[torch.Tensor]]:
    """The global model and K honest update vectors (shared direction, norms 0.7 .. 1.3)."""
    gen = torch.Generator().manual_seed(seed)
    p = sum(torch.Size(s).numel() for s in SHAPES.values())
    g0 = _unflat(torch.randn(p, generator=gen, dtype=torch.float64))
    common = torch.randn(p, generator=gen, dtype=torch.float64)
    updates = []
    for i in range(k):
        u = common / common.norm() + torch.randn(p, generator=gen, dtype=torch.float64) / p ** 0.5
        updates.append(u / u.norm() * (0.7 + 0.6 * i / max(k - 1, 1)) * 0.01)
    return g0, updates


def _weighted_trimmed(states, weights, trim):
    """Before issue 39: the trimmed mean weighted by n_k among the survivors of each coordinate."""
    out = {}
    for key in states[0]:
        block = torch.stack([s[key].double().reshape(-1) for s in states])
        k = block.shape[0]
        values, order = torch.sort(block, dim=0)
        b = min(int(-(-trim * k // 1)), (k - 1) // 2)
        w = torch.tensor(weights, dtype=torch.float64)[order][b:k - b]
        out[key] = ((w * values[b:k - b]).sum(0) / w.sum(0)).reshape(states[0][key].shape).float()
    return out


def server_round(g0: dict, states: list[dict], n_k: list[float], bounds: dict, method: str = "fedavg") -> dict:
    """What the server makes of one round's answers under ``bounds`` (``guard.screen``, then the aggregation)."""
    sent = {str(i): g0 for i in range(len(states))}
    out = norm_outliers({str(i): s for i, s in enumerate(states)}, sent, bounds["norm_ratio"])
    keep = [i for i in range(len(states)) if str(i) not in out]
    states, n_k = [states[i] for i in keep], [n_k[i] for i in keep]
    states, _, _ = clip_updates(g0, states, bounds["clip"])
    weights = bounded_weights(n_k, bounds["n_k_ratio"])
    if method == "grace":
        new, _ = grace_step(g0, states, weights, rule=bounds["aggregation"], trim=bounds["trim"])
        return new
    if bounds is BEFORE and bounds["aggregation"] == "trimmed_mean":
        return _weighted_trimmed(states, weights, bounds["trim"])
    return aggregate(states, weights, rule=bounds["aggregation"], trim=bounds["trim"])


def liar_update(kind: str, updates: list[torch.Tensor], seed: int) -> torch.Tensor:
    """The lying site's update (it is site 0; ``updates[0]`` its honest one)."""
    honest = updates[1:]
    med = statistics.median(float(u.norm()) for u in honest)
    if kind == "scaled":
        return 99 * updates[0]
    if kind == "sign_flipped":
        return -99 * sum(honest) / len(honest)
    if kind == "fixed_direction":
        gen = torch.Generator().manual_seed(1000)  # the same direction every round and seed
        e = torch.randn(updates[0].numel(), generator=gen, dtype=torch.float64)
        return 99 * med * e / e.norm()
    raise ValueError(kind)


def movement(g0: dict, new: dict, honest: list[torch.Tensor]) -> float:
    return float((_flat(new) - _flat(g0)).norm()) / statistics.median(float(u.norm()) for u in honest)


def model_attack(kind: str, k: int, lying_n_k: bool, bounds: dict, method: str = "fedavg",
                 colluders: int = 1) -> float:
    """Largest movement multiple over ``SEEDS`` of one round with ``colluders`` lying sites (sites 0 ..)."""
    worst = 0.0
    for seed in SEEDS:
        g0, updates = honest_round(k, seed)
        bad = liar_update(kind, updates, seed)
        vectors = [bad] * colluders + updates[colluders:]
        n_k = [99.0 * N_HONEST if lying_n_k and i < colluders else float(N_HONEST) for i in range(k)]
        states = [_unflat(_flat(g0) + u) for u in vectors]
        new = server_round(g0, states, n_k, bounds, method)
        worst = max(worst, movement(g0, new, updates[colluders:]))
    return worst


# ---- FedSM: the selector's Adam moments (F7) and LDA statistics (F2) ----------------------------------------------

def _site_data(k: int, n: int, seed: int, dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(k, dim, generator=gen)
    feats = [means[i] + torch.randn(n, dim, generator=gen) for i in range(k)]
    return means, feats


def honest_moments(k: int, seed: int, steps: int = 5, lr: float = 1e-2) -> tuple[dict, list[dict], list]:
    """FedSM batch mode, for real: a linear selector; each site trains it with Adam on its own class only (the 1000x
    spread of honest exp_avg_sq comes from that). Returns the selector, the sites' moments, their next gradients."""
    _, feats = _site_data(k, 32, seed)
    torch.manual_seed(seed)
    sel = torch.nn.Linear(feats[0].shape[1], k)
    start = {n: p.detach().clone() for n, p in sel.named_parameters()}
    moments, grads = [], []
    for site in range(k):
        model = torch.nn.Linear(feats[0].shape[1], k)
        model.load_state_dict(start)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        labels = torch.full((feats[site].shape[0],), site)
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(feats[site]), labels).backward()
            opt.step()
        moments.append(flatten_optimizer_state(opt.state_dict()))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(feats[site]), labels).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return start, moments, grads


def next_steps(moments: dict, grads: list, lr: float = 1e-2) -> list[torch.Tensor]:
    """Each honest site's next Adam step (flattened) from the aggregated ``moments`` and its own gradient."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    out = []
    for g in grads:
        parts = []
        for i, gi in enumerate(g):
            m = b1 * moments[f"{i}.exp_avg"].double() + (1 - b1) * gi.double()
            v = b2 * moments[f"{i}.exp_avg_sq"].double() + (1 - b2) * gi.double() ** 2
            t = float(moments[f"{i}.step"]) + 1
            parts.append((lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)).reshape(-1))
        out.append(torch.cat(parts))
    return out


def moments_attack(kind: str, k: int, bounds: dict) -> float:
    """Largest ratio over seeds and honest sites of an honest site's next selector step with the liar's moments in the
    aggregate to the same step from the honest sites' moments alone. ``zero_sq``: exp_avg = +V, exp_avg_sq = 0 (the
    issue's); ``max_ratio``: the most Adam allows, exp_avg = 7.27 sqrt(V), exp_avg_sq = V, V 99^2 x the honest."""
    before = bounds is BEFORE
    worst = 0.0
    for seed in SEEDS:
        _, moments, grads = honest_moments(k, seed)
        honest = moments[1:]
        scale = {key: max(float(m[key].abs().max()) for m in honest) for key in honest[0]}
        liar = {}
        for key, value in honest[0].items():
            if key.endswith(".exp_avg"):
                liar[key] = torch.full_like(value, 99 * scale[key])
                if kind == "max_ratio":
                    liar[key] = torch.full_like(value, 7.27 * 99 * scale[key + "_sq"] ** 0.5)
            elif key.endswith(".exp_avg_sq"):
                big = torch.full_like(value, 99 ** 2 * scale[key])
                liar[key] = torch.zeros_like(value) if kind == "zero_sq" else big
            else:
                liar[key] = value.clone()
        answers = [liar] + honest
        n_k = [99.0 * N_HONEST] + [float(N_HONEST)] * (k - 1)
        if not before and check_moments(liar, None, 10**6):
            answers, n_k = honest, n_k[1:]  # refused on arrival (``FedSMController.check_result``)
        weights = bounded_weights(n_k, bounds["n_k_ratio"])
        combined = average_moments(answers, weights, rule=bounds["aggregation"], trim=bounds["trim"])
        if not before:
            combined = bound_moments(combined, answers)
        reference = average_moments(honest, [N_HONEST] * (k - 1))
        for a, b in zip(next_steps(combined, grads[1:]), next_steps(reference, grads[1:])):
            worst = max(worst, float(a.norm() / b.norm()))
    return worst


def lda_attack(kind: str, k: int, bounds: dict) -> float:
    """Share of the honest sites' images the LDA selector routes to the liar's class (site 0).

    ``foreign_classes`` (the issue's): the liar adds n_k 99x the others' of every other site's class with means
    pushed 10 units away, and puts its own class at the honest sites' mean: refused now (``check_statistics``).
    ``own_mimic``: the most a liar can do within the checks: its own class only, with images drawn like an honest
    site's (its mean guessed exactly), its n_k capped as the server caps it; with the defaults every site's
    statistics then clipped (``clip_statistics``).
    """
    before = bounds is BEFORE
    worst = 0.0
    for seed in SEEDS:
        means, feats = _site_data(k, 64, seed)
        stats = [class_statistics(f, torch.full((f.shape[0],), i), k) for i, f in enumerate(feats)]
        n = feats[1].shape[0]
        if kind == "foreign_classes":
            big = 99 * n
            fake = [means[1:].mean(0) + torch.randn(n, means.shape[1])]
            labels = [torch.zeros(n, dtype=torch.long)]
            for j in range(1, k):
                fake.append(means[j] + 10.0 + torch.randn(big, means.shape[1]))
                labels.append(torch.full((big,), j))
            liar = class_statistics(torch.cat(fake), torch.cat(labels), k)
        else:
            liar = class_statistics(means[1] + torch.randn(int(99 * n), means.shape[1]),
                                    torch.zeros(int(99 * n), dtype=torch.long), k)
        declared = int(liar["count"].sum())
        others = [float(s["count"].sum()) for s in stats[1:]]
        capped = bounded_weights([float(declared)] + others, bounds["n_k_ratio"])[0]
        if not before:
            if check_statistics(liar, declared, own_class=0):
                liar = None  # refused on arrival, naming the site
            else:  # weighed as its capped n_k (``FedSMController.fit_selector``)
                liar = {key: v * min(1.0, capped / declared) for key, v in liar.items()}
        sent = ([liar] if liar is not None else []) + stats[1:] + [stats[0]] * (liar is None)
        if not before:  # each site's statistics clipped (``FedSMController.fit_selector``)
            sent = clip_statistics(sent, bounds["clip"])[0]
        pooled = add_statistics(sent)
        weight, bias = lda_head(pooled, 0.1)
        routed = torch.cat([(f @ weight.T + bias).argmax(1) for f in feats[1:]])
        worst = max(worst, float((routed == 0).double().mean()))
    return worst


def selector_attack(k: int, bounds: dict, rounds_after: int = 8) -> float:
    """FedSM, ``selector_steps: epoch``: the server's pooled Adam step on the sites' summed gradients (a linear
    selector, each site's images its own class). After 3 honest rounds the liar (site 0) sends -99 x the honest
    sites' mean gradient (its n_k does not matter: it weighs neither the sum nor the clip); ``rounds_after`` honest
    rounds follow. Returned: the largest over seeds of
    ||w - w_h|| over the norm of one honest round's step, w the selector after those rounds and w_h the same rounds
    with site 0 honest (the liar's pull, and its exp_avg_sq slowing every later step)."""
    before = bounds is BEFORE
    worst = 0.0
    flat = lambda w: torch.cat([v.reshape(-1).double() for v in w.values()])  # noqa: E731
    for seed in SEEDS:
        _, feats = _site_data(k, 32, seed)
        torch.manual_seed(seed)
        model = torch.nn.Linear(feats[0].shape[1], k)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}

        def grads_at(w):
            out = []
            for site, f in enumerate(feats):
                model.load_state_dict(w)
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(f), torch.full((f.shape[0],), site), reduction="sum").backward()
                out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            return out

        def run(attack: bool) -> list[dict]:
            w, moments, path = dict(params), {}, [dict(params)]
            for r in range(3 + 1 + rounds_after):
                grads = grads_at(w)
                if attack and r == 3:
                    grads[0] = {n: -99 * sum(g[n] for g in grads[1:]) / (k - 1) for n in grads[0]}
                if not before:  # n_k does not weigh a sum of gradients, nor its clip
                    grads = clip_updates({n: torch.zeros_like(v) for n, v in w.items()}, grads, bounds["clip"])[0]
                w, moments = pooled_adam_step(w, grads, moments, 1e-2)
                path.append(dict(w))
            return path

        attacked, honest = run(True), run(False)
        step = float((flat(honest[4]) - flat(honest[3])).norm())
        worst = max(worst, float((flat(attacked[-1]) - flat(honest[-1])).norm()) / step)
    return worst


def extra_lda_attack(kind: str, k: int, bounds: dict, lying_n_k: bool = True) -> float:
    """FedSM-extra: the (K+1)-class LDA selector (0 = global, i + 1 = site i's personalized model). Honest site i
    labels a third of its images 0 and the rest i + 1. The liar (site 0) declares n_k 99x (``lying_n_k``; else the
    honest sites' n_k), all of its images class 0
    (any class passes the checks in the extra rounds); ``means``: its features 30 units (about 10 of the sites'
    spreads) from the honest sites' mean; ``covariance``: at the honest sites' mean, spread 100 units along the line
    from site 1's mean to site 2's. Returned: the largest over seeds of the share of the honest sites' images routed
    otherwise than by the selector fitted with site 0 honest."""
    before = bounds is BEFORE
    worst = 0.0
    for seed in SEEDS:
        means, feats = _site_data(k, 60, seed)
        gen = torch.Generator().manual_seed(seed + 100)
        labels = [torch.where(torch.rand(f.shape[0], generator=gen) < 1 / 3, 0, i + 1) for i, f in enumerate(feats)]
        stats = [class_statistics(f, y, k + 1) for f, y in zip(feats, labels)]
        n, d = feats[0].shape[0], means.shape[1]
        m = 99 * n if lying_n_k else n
        noise = torch.randn(m, d, generator=gen)
        if kind == "means":
            direction = torch.randn(d, generator=gen)
            fake = means[1:].mean(0) + 30.0 * direction / direction.norm() + noise
        else:
            line = (means[2] - means[1]) / (means[2] - means[1]).norm()
            fake = means[1:].mean(0) + 100.0 * noise[:, :1] * line + noise
        liar = class_statistics(fake, torch.zeros(m, dtype=torch.long), k + 1)
        declared = m
        capped = bounded_weights([float(declared)] + [float(n)] * (k - 1), bounds["n_k_ratio"])[0]
        liar = {key: v * min(1.0, capped / declared) for key, v in liar.items()}  # weighed as its capped n_k
        sent = [liar] + stats[1:]
        if not before:
            sent = clip_statistics(sent, bounds["clip"])[0]

        def routes(pooled):
            weight, bias = lda_head(pooled, 0.1)
            return torch.cat([(f @ weight.T + bias).argmax(1) for f in feats[1:]])

        changed = routes(add_statistics(sent)) != routes(add_statistics(stats))
        worst = max(worst, float(changed.double().mean()))
    return worst


def head_attack(k: int, bounds: dict) -> float:
    """LC-Fed's coarse heads (1x1 convolutions over C = 16 decoder channels) as HC reads them: site 1's disagreement
    map U = the std over every site's head of its sigmoid output on site 1's decoder features. Each site's head
    moves by a small honest step a round (norms 0.7 .. 1.3 x 0.05); the liar (site 0) sends its previous head + 99 x
    its honest step. Returned: the largest over seeds of ||U - U_h|| / ||U_h - U_0||, U_h with site 0 honest, U_0
    before the round (how far the liar moves another site's calibration map, in units of one honest round)."""
    worst = 0.0
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        c = 16
        feature = torch.randn(2, c, 16, 16, generator=gen)
        held = [{"weight": torch.randn(1, c, 1, 1, generator=gen) * 0.3, "bias": torch.zeros(1)} for _ in range(k)]
        steps = []
        for i in range(k):
            d = torch.randn(c + 1, generator=gen)
            d = d / d.norm() * (0.7 + 0.6 * i / max(k - 1, 1)) * 0.05
            steps.append({"weight": d[:c].reshape(1, c, 1, 1), "bias": d[c:]})
        honest = [{key: h[key] + st[key] for key in h} for h, st in zip(held, steps)]
        sent = [{key: held[0][key] + 99 * steps[0][key] for key in held[0]}] + honest[1:]
        if bounds is not BEFORE:
            sent = clip_updates(held, sent, bounds["clip"])[0]

        def umap(heads):
            return disagreement_map([torch.sigmoid(torch.nn.functional.conv2d(feature, h["weight"], h["bias"]))
                                     for h in heads])

        u0, uh, u = umap(held), umap(honest), umap(sent)
        worst = max(worst, float((u - uh).norm() / (uh - u0).norm()))
    return worst


def person_attack(k: int, bounds: dict) -> float:
    """IOP-FL's routing bundle {P_1..P_K, w_g}: routing starts from the experts' average. Honest P_k = w_g + u_k
    (``honest_round``); the liar (site 0) publishes w_g + 99 u_0. Returned: the largest over seeds of how far the
    experts' average moves from the honest bundle's, over the median honest ||P_k - w_g||."""
    worst = 0.0
    for seed in SEEDS:
        g0, updates = honest_round(k, seed)
        honest = [_unflat(_flat(g0) + u) for u in updates]
        sent = [_unflat(_flat(g0) + 99 * updates[0])] + honest[1:]
        if bounds is not BEFORE:
            sent = clip_updates(g0, sent, bounds["clip"])[0]
        average = lambda states: sum(_flat(s) for s in [g0, *states]) / (k + 1)  # noqa: E731
        worst = max(worst, float((average(sent) - average(honest)).norm())
                    / statistics.median(float(u.norm()) for u in updates[1:]))
    return worst


MODEL_ATTACKS = ("scaled", "sign_flipped", "fixed_direction")


def attack_table() -> list[dict]:
    """Every attack at K = 3 and K = 5, before and with the defaults: rows ``{"id", "attack", "K", "before",
    "now", "unit"}``."""
    now = defaults()
    rows = []

    def add(fid, attack, k, fn, unit="x"):
        rows.append({"id": fid, "attack": attack, "K": k, "before": fn(BEFORE), "now": fn(now), "unit": unit})

    for k in (3, 5):
        for kind in MODEL_ATTACKS:
            for lying in (True, False):
                add("F1", f"mean: {kind.replace('_', '-')} 99x, n_k {'99x' if lying else 'honest'}", k,
                    lambda b, kind=kind, lying=lying, k=k: model_attack(kind, k, lying, b))
        trimmed = lambda b: {**b, "aggregation": "trimmed_mean"}  # noqa: E731
        add("F5", "trimmed_mean: 1 liar, scaled 99x, n_k 99x", k,
            lambda b, k=k: model_attack("scaled", k, True, trimmed(b)))
        if k == 5:
            add("F5", "trimmed_mean: 2 colluders, fixed direction 99x, n_k 99x", k,
                lambda b: model_attack("fixed_direction", 5, True, trimmed(b), colluders=2))
        add("F6", "GRACE: aligned 99x, n_k 99x", k, lambda b, k=k: _grace_aligned(k, b))
        for kind in ("zero_sq", "max_ratio"):
            label = "exp_avg +V, exp_avg_sq 0" if kind == "zero_sq" else "exp_avg 7.27 sqrt(V), exp_avg_sq V = 99^2 v"
            add("F7", f"FedSM moments: {label}, n_k 99x", k, lambda b, kind=kind, k=k: moments_attack(kind, k, b))
        add("F2", "FedSM lda: other sites' classes, n_k 99x", k,
            lambda b, k=k: lda_attack("foreign_classes", k, b), unit="routed")
        add("F2", "FedSM lda: own class mimicking site 2, n_k 99x", k,
            lambda b, k=k: lda_attack("own_mimic", k, b), unit="routed")
        add("F7", "FedSM epoch-mode selector gradient: sign-flipped 99x (8 rounds on, in honest steps)", k,
            lambda b, k=k: selector_attack(k, b))
        add("F2", "FedSM-extra lda: class 0, means 30 units off, n_k 99x (rerouted)", k,
            lambda b, k=k: extra_lda_attack("means", k, b), unit="rerouted")
        add("F2", "FedSM-extra lda: class 0, spread 100 units along sites 1-2, n_k 99x (rerouted)", k,
            lambda b, k=k: extra_lda_attack("covariance", k, b), unit="rerouted")
        add("F8", "LC-Fed coarse head: 99x its update (another site's HC map)", k, lambda b, k=k: head_attack(k, b))
        add("F8", "IOP-FL published P_k: 99x its distance from w_g (experts' average)", k,
            lambda b, k=k: person_attack(k, b))
    return rows


def _grace_aligned(k: int, bounds: dict) -> float:
    """GRACE with the liar's update the honest sites' mean direction, 99x (high consistency, large weight)."""
    worst = 0.0
    for seed in SEEDS:
        g0, updates = honest_round(k, seed)
        bad = 99 * sum(updates[1:]) / (k - 1)
        states = [_unflat(_flat(g0) + u) for u in [bad] + updates[1:]]
        new = server_round(g0, states, [99.0 * N_HONEST] + [float(N_HONEST)] * (k - 1), bounds, "grace")
        worst = max(worst, movement(g0, new, updates[1:]))
    return worst


def markdown(rows: list[dict]) -> str:
    """The table of docs/privacy.md."""
    def fig(v, unit):
        return f"{100 * v:.0f} %" if unit in ("routed", "rerouted") else f"{v:.2f}x"
    lines = ["| ID | attack (one site unless said) | K | before | defaults now |", "|---|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['attack']} | {r['K']} | {fig(r['before'], r['unit'])} | {fig(r['now'], r['unit'])} |"
              for r in rows]
    return "\n".join(lines)


# ---- the tests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [3, 5])
def test_honest_round_with_the_defaults_is_fedavg_bit_for_bit(k):
    g0, updates = honest_round(k, 0)
    states = [_unflat(_flat(g0) + u) for u in updates]
    n_k = [100.0, 50.0, 25.0, 40.0, 60.0][:k]
    now = server_round(g0, states, n_k, defaults())
    plain = aggregate(states, n_k)
    assert all(torch.equal(now[key], plain[key]) for key in plain)


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("kind", MODEL_ATTACKS)
@pytest.mark.parametrize("lying", [True, False])
def test_f1_one_liar_moves_the_mean_at_most_3_honest_updates(kind, k, lying):
    assert model_attack(kind, k, lying, defaults()) <= 3.0
    if lying and kind == "scaled":  # the attack as the issue measured it, with the bounds of before
        assert model_attack(kind, k, lying, BEFORE) > 50


@pytest.mark.parametrize("k", [3, 5])
def test_f5_trimmed_mean_is_unweighted_and_bounded(k):
    trimmed = {**defaults(), "aggregation": "trimmed_mean"}
    assert model_attack("scaled", k, True, trimmed) <= 3.0
    if k == 5:
        assert model_attack("fixed_direction", 5, True, trimmed, colluders=2) <= 3.0
        assert model_attack("fixed_direction", 5, True, {**BEFORE, "aggregation": "trimmed_mean"}, colluders=2) > 20
    block = torch.tensor([[1.0], [2.0], [3.0], [4.0], [1e6]], dtype=torch.float64)
    assert float(combine_rows(block, [1, 1, 1, 1e6, 1], "trimmed_mean", 0.2)[0]) == pytest.approx(3.0)


@pytest.mark.parametrize("k", [3, 5])
def test_f6_grace_weighs_the_clipped_updates(k):
    assert _grace_aligned(k, defaults()) <= 3.0 < _grace_aligned(k, BEFORE)


@pytest.mark.parametrize("k", [3, 5])
def test_f7_moments_are_refused_or_bounded(k):
    g0, moments, grads = honest_moments(k, 0)
    assert all(check_moments(m, None, 10**6) is None for m in moments)  # honest Adam moments pass
    assert moments_attack("zero_sq", k, BEFORE) > 50
    assert moments_attack("zero_sq", k, defaults()) <= 3.0
    assert moments_attack("max_ratio", k, defaults()) <= 3.0


@pytest.mark.parametrize("k", [3, 5])
def test_f2_lda_statistics_for_other_classes_are_refused(k):
    assert lda_attack("foreign_classes", k, BEFORE) > 0.9
    assert lda_attack("foreign_classes", k, defaults()) < 0.05
    means, feats = _site_data(k, 16, 0)
    own = class_statistics(feats[1], torch.full((16,), 1), k)
    assert check_statistics(own, 16, own_class=1) is None
    assert "class(es) [1]" in check_statistics(own, 16, own_class=0)
    assert "summing to n_k = 17" in check_statistics(own, 17, own_class=1)
    forged = {**own, "gram": own["gram"] * 0.5}  # a Gram matrix smaller than its class mean's part
    assert "eigenvalue" in check_statistics(forged, 16, own_class=1)


@pytest.mark.parametrize("k", [3, 5])
def test_f7_epoch_gradients_are_clipped_before_they_are_summed(k):
    assert selector_attack(k, defaults(), rounds_after=4) < 0.5 * selector_attack(k, BEFORE, rounds_after=4)


@pytest.mark.parametrize("k", [3, 5])
def test_f2_extra_lda_statistics_are_clipped_and_honest_ones_kept(k):
    assert extra_lda_attack("covariance", k, defaults()) < 0.75 * extra_lda_attack("covariance", k, BEFORE)
    means, feats = _site_data(k, 60, 0)
    gen = torch.Generator().manual_seed(0)
    honest = [class_statistics(f, torch.randint(0, k + 1, (60,), generator=gen), k + 1) for f in feats]
    out, factors, _ = clip_statistics(honest, defaults()["clip"])
    assert all(a is b for a, b in zip(out, honest)) and factors == [1.0] * k  # unchanged, bit for bit


@pytest.mark.parametrize("k", [3, 5])
def test_f8_lcfed_heads_and_iopfl_p_k_are_clipped(k):
    assert head_attack(k, defaults()) <= 3.0 < 10 < head_attack(k, BEFORE)
    assert person_attack(k, defaults()) <= 1.0 < 5 < person_attack(k, BEFORE)


if __name__ == "__main__":
    print(markdown(attack_table()))
