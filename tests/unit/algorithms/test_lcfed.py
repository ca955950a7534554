import copy
import math

import pytest
import torch
from monai.losses import DiceLoss

from pflseg.algorithms.lcfed import (
    STEP_DEFAULTS,
    SitePredictor,
    average_shared,
    calibrate,
    disagreement_map,
    exchanges_heads,
    gaussian_enlarge,
    gaussian_kernel,
    hc_windows,
    head_map,
    lcfed_loss,
    lcfed_step,
    nms,
    scaled_window,
    self_uncertainty_map,
    set_phase,
    site_contrast_loss,
    uncertainty_map,
)
from pflseg.nets import build_net
from pflseg.nets.lcfed import PCS, personal_keys, shared_keys

# --- site contrast ---------------------------------------------------------------------------------


def test_site_contrast_is_minus_the_mean_distance():
    emb_k = torch.tensor([0.0, 0.0])
    others = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert torch.allclose(site_contrast_loss(emb_k, others), torch.tensor(-3.0))
    assert site_contrast_loss(emb_k, torch.zeros(0, 2)) == 0


def test_site_contrast_with_per_sample_others():
    emb_k = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    others = torch.tensor([[[3.0, 4.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 3.0]]])  # (N=2, M=2, E=2)
    assert torch.allclose(site_contrast_loss(emb_k, others), torch.tensor(-(5.0 + 1.0 + 0.0 + 2.0) / 4))
    with pytest.raises(ValueError, match="rows"):
        site_contrast_loss(emb_k, others[:1])


def _pcs_sc_gradient(lam, k=1, n_sites=3):
    torch.manual_seed(0)
    pcs = PCS(channels=4, n_sites=n_sites, embed_dim=5)
    emb_k = pcs.embed(torch.tensor([k]))
    others = pcs.embed(torch.tensor([j for j in range(n_sites) if j != k]))
    l_sc = site_contrast_loss(emb_k, others)
    logits = torch.zeros(1, 1, 4, 4, requires_grad=True)
    loss = lcfed_loss(logits, None, torch.ones(1, 1, 4, 4), l_sc, lam=lam)
    loss.backward()
    return pcs.widen[0].weight.grad  # (E, K): column j is site j's one-hot input


def test_zero_weight_gives_no_embedding_gradient_and_positive_weight_does():
    assert _pcs_sc_gradient(0.0).abs().sum() == 0
    assert _pcs_sc_gradient(0.1)[:, 1].abs().sum() > 0


def test_no_gradient_flows_into_the_other_sites_embeddings():
    grad = _pcs_sc_gradient(0.1, k=1)
    assert grad[:, 0].abs().sum() == 0 and grad[:, 2].abs().sum() == 0
    others = torch.randn(2, 5, requires_grad=True)
    emb_k = torch.randn(1, 5, requires_grad=True)
    site_contrast_loss(emb_k, others).backward()
    assert others.grad is None and emb_k.grad is not None


# --- disagreement, NMS, enlargement, calibration ---------------------------------------------------


def test_disagreement_map_is_zero_when_all_heads_agree():
    p = torch.rand(2, 2, 6, 6)
    assert torch.equal(disagreement_map([p, p.clone(), p.clone()]), torch.zeros_like(p))
    assert torch.equal(disagreement_map([p]), torch.zeros_like(p))


def test_disagreement_map_is_the_population_std():
    a, b = torch.zeros(1, 1, 1, 2), torch.tensor([[[[1.0, 0.5]]]])
    assert torch.allclose(disagreement_map([a, b]), torch.tensor([[[[0.5, 0.25]]]]))


def test_nms_keeps_only_local_maxima_above_the_threshold():
    # prepare: peaks 4 at (1, 1), 2 at (1, 6), 0.4 at (6, 6) (normalised 1, 0.5, 0.1); a shoulder 3 at (1, 2)
    m = torch.zeros(1, 1, 8, 8)
    m[0, 0, 1, 1], m[0, 0, 1, 2], m[0, 0, 1, 6], m[0, 0, 6, 6] = 4.0, 3.0, 2.0, 0.4
    # execute
    out = nms(m, window=3, threshold=0.2)
    # assert: the shoulder is suppressed (not a local max), the 0.1 peak is under the threshold
    expected = torch.zeros_like(m)
    expected[0, 0, 1, 1], expected[0, 0, 1, 6] = 1.0, 0.5
    assert torch.equal(out, expected)
    # with a window covering both peaks only the global one survives
    wide = nms(m, window=11, threshold=0.2)
    assert wide.nonzero().tolist() == [[0, 0, 1, 1]]


def test_nms_normalises_per_sample_and_class_and_keeps_zero_maps():
    m = torch.zeros(2, 2, 5, 5)
    m[0, 0, 2, 2] = 0.3
    m[1, 1, 0, 0] = 7.0
    out = nms(m, window=3)
    assert out[0, 0, 2, 2] == 1 and out[1, 1, 0, 0] == 1 and out.sum() == 2
    with pytest.raises(ValueError, match="window"):
        nms(m, window=4)


def test_gaussian_enlarge_turns_a_point_into_a_centred_gaussian_blob():
    m = torch.zeros(1, 1, 11, 11)
    m[0, 0, 5, 5] = 1.0
    out = gaussian_enlarge(m, size=5, sigma=1.0)
    assert out[0, 0, 5, 5] == 1.0
    assert torch.isclose(out[0, 0, 5, 6], torch.tensor(math.exp(-0.5)))
    assert out[0, 0, 5, 8] == 0  # outside the 5 x 5 window
    k = gaussian_kernel(11)  # default sigma = 2 (OpenCV's rule for size 11)
    assert k.shape == (11, 11) and k[5, 5] == 1 and torch.isclose(k[5, 6], torch.tensor(math.exp(-1 / 8)).double())


def test_calibrated_head_input_equals_the_feature_when_the_map_is_zero():
    f = torch.randn(2, 3, 4, 4)
    assert torch.equal(calibrate(f, torch.zeros(2, 1, 4, 4)), f)
    assert torch.equal(calibrate(f, torch.zeros(2, 2, 4, 4)), f)
    m = torch.zeros(2, 2, 4, 4)
    m[:, 1, 0, 0] = 0.5
    out = calibrate(f, m)
    assert torch.allclose(out[:, :, 0, 0], 1.5 * f[:, :, 0, 0]) and torch.equal(out[:, :, 1:], f[:, :, 1:])


def test_uncertainty_map_of_agreeing_heads_is_zero_and_carries_no_gradient():
    p = torch.rand(1, 1, 8, 8, requires_grad=True)
    u = uncertainty_map([p, p])
    assert torch.equal(u, torch.zeros(1, 1, 8, 8)) and not u.requires_grad


# --- loss and aggregation --------------------------------------------------------------------------


def test_lcfed_loss_adds_the_terms():
    def dice(logits, label):
        return logits.mean()

    coarse, calib, label = torch.full((1, 1, 2, 2), 2.0), torch.full((1, 1, 2, 2), 3.0), torch.ones(1, 1, 2, 2)
    assert torch.isclose(lcfed_loss(coarse, calib, label, torch.tensor(-4.0), lam=0.5, dice=dice), torch.tensor(3.0))
    assert torch.isclose(lcfed_loss(coarse, None, label, torch.tensor(-4.0), lam=0.5, dice=dice), torch.tensor(0.0))
    with pytest.raises(ValueError, match="lam"):
        lcfed_loss(coarse, None, label, torch.tensor(0.0), lam=-1.0, dice=dice)


def test_average_shared_of_two_states_is_the_hand_average_and_leaves_personal_keys():
    s1 = {"body.w": torch.tensor([1.0, 2.0]), "pcs.w": torch.tensor([0.0]), "head.w": torch.tensor([5.0])}
    s2 = {"body.w": torch.tensor([3.0, 6.0]), "pcs.w": torch.tensor([1.0]), "head.w": torch.tensor([9.0])}
    new = average_shared([s1, s2], ["body.w", "pcs.w"])
    for n in new:
        assert torch.equal(n["body.w"], torch.tensor([2.0, 4.0])) and torch.equal(n["pcs.w"], torch.tensor([0.5]))
    assert torch.equal(new[0]["head.w"], torch.tensor([5.0])) and torch.equal(new[1]["head.w"], torch.tensor([9.0]))
    assert torch.equal(s1["body.w"], torch.tensor([1.0, 2.0]))  # inputs untouched
    with pytest.raises(KeyError):
        average_shared([s1, {"pcs.w": torch.tensor([1.0])}], ["body.w"])


# --- one site step ---------------------------------------------------------------------------------


def _step_setup(seed=0):
    torch.manual_seed(seed)
    net = build_net({"name": "lcfed", "n_sites": 3, "channels": [4, 8, 8, 8, 8], "embed_dim": 6})
    image = torch.randn(2, 1, 32, 32)
    label = torch.zeros(2, 1, 32, 32)
    label[:, :, 8:20, 10:24] = 1.0
    image = image + 2.0 * label
    heads = [{"weight": torch.randn(1, 4, 1, 1), "bias": torch.randn(1)} for _ in range(2)]
    return net, (image, label), DiceLoss(sigmoid=True, batch=True), heads


def test_lcfed_step_lowers_the_loss_on_a_tiny_batch():
    net, batch, dice, heads = _step_setup()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = [lcfed_step(net, batch, opt, dice, heads, 1, 3, {"nms_window": 5})["loss"] for _ in range(6)]
    assert losses[-1] < losses[0]
    assert net.calib_head.weight.grad.abs().sum() > 0


def _hand_gate_contrast(net, image, k, n_sites):
    """L_sc by hand: encoder -> GAP -> sigmoid(fc([desc; widened one-hot(j)])) for every site j, then
    minus the mean distance of site k's gates to the others' (per sample)."""
    x = image
    for stage in net.encoder:
        x = stage(x)
    desc = x.mean(dim=(2, 3))
    gates = [torch.sigmoid(net.pcs.fc(torch.cat([desc, net.pcs.embed(torch.full((len(desc),), j))], 1)))
             for j in range(n_sites)]
    dists = [(gates[k] - gates[j]).norm(dim=1) for j in range(n_sites) if j != k]
    return -torch.stack(dists).mean()


@pytest.mark.parametrize("contrast_on", [None, "gate", "gate_all", "embedding"])
def test_lcfed_step_without_hc_is_coarse_dice_plus_weighted_site_contrast(contrast_on):
    net, (image, label), dice, heads = _step_setup()
    ref = copy.deepcopy(net).train()
    with torch.no_grad():
        out = ref.parts(image, 0)
        if contrast_on == "embedding":
            sc = site_contrast_loss(out["embedding"], ref.pcs.embed(torch.tensor([1, 2])))
        else:  # default: the gates
            sc = _hand_gate_contrast(ref, image, 0, 3)
        expected = dice(out["coarse"], label) + 0.5 * sc

    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    cfg = {"hc": False, "lam": 0.5, **({"contrast_on": contrast_on} if contrast_on else {})}
    got = lcfed_step(net, (image, label), opt, dice, heads, 0, 3, cfg)
    assert math.isclose(got["loss"], float(expected), rel_tol=1e-5) and math.isclose(got["sc"], float(sc), rel_tol=1e-5)
    assert net.calib_head.weight.grad is None


def test_lcfed_step_with_only_its_own_head_calibrates_nothing():
    net, (image, label), dice, _ = _step_setup()
    ref = copy.deepcopy(net).train()
    with torch.no_grad():
        out = ref.parts(image, 2)
        sc = _hand_gate_contrast(ref, image, 2, 3)
        expected = dice(out["coarse"], label) + dice(ref.calib_head(out["feature"]), label) + 0.1 * sc

    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    got = lcfed_step(net, {"image": image, "label": label}, opt, dice, [], 2, 3)
    assert math.isclose(got["loss"], float(expected), rel_tol=1e-5)
    with pytest.raises(ValueError, match="cfg"):
        lcfed_step(net, (image, label), opt, dice, [], 2, 3, {"lambda": 0.1})
    with pytest.raises(ValueError, match="contrast_on"):
        lcfed_step(net, (image, label), opt, dice, [], 2, 3, {"contrast_on": "logits"})


def test_head_then_body_phases_train_only_their_part():
    net, batch, dice, heads = _step_setup()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    personal = set(personal_keys(net))

    def changed_after_step(phase):
        before = {k: v.detach().clone() for k, v in net.named_parameters()}
        set_phase(net, phase)
        lcfed_step(net, batch, opt, dice, heads, 1, 3, {"nms_window": 5})
        return {k for k, v in net.named_parameters() if not torch.equal(v, before[k])}

    assert changed_after_step("head") == {k for k in personal}
    assert changed_after_step("body") == {k for k, _ in net.named_parameters()} - personal
    set_phase(net, "all")
    assert all(p.requires_grad for p in net.parameters())
    with pytest.raises(ValueError, match="phase"):
        set_phase(net, "heads")


def test_site_predictor_gives_calibrated_logits_and_coarse_without_hc():
    net, (image, _), _, heads = _step_setup()
    net.eval()
    with torch.no_grad():
        out = net.parts(image, 1)
        umap = head_map(net, out["feature"], heads, {**STEP_DEFAULTS, "nms_window": 5})
        assert torch.allclose(SitePredictor(net, 1, heads, {"nms_window": 5})(image),
                              net.calibrated_logits(out["feature"], umap))
        assert torch.equal(SitePredictor(net, 1, heads, {"hc": False})(image), out["coarse"])


# --- window scaling and the HC controls ------------------------------------------------------------


@pytest.mark.parametrize("window, side, reference, expected", [
    (11, 384, 384, 11),  # the paper's window at the paper's image size
    (11, 64, 384, 3),  # 1.83 -> nearest odd 1 -> at least 3
    (11, 128, 384, 3),  # 3.67 -> 3
    (11, 256, 384, 7),  # 7.33 -> 7
    (11, 512, 384, 15),  # 14.67 -> 15
    (31, 64, 384, 5),  # the reference code's window: 5.17 -> 5
    (31, 256, 384, 21),  # 20.67 -> 21
    (11, 64, 0, 11),  # reference 0: explicit pixels, as given
    (1, 64, 0, 1),
    (255, 4, 1, 7),  # never wider than 2 side - 1 (changes nothing beyond)
])
def test_windows_scale_with_the_image_to_the_nearest_odd_integer_at_least_3(window, side, reference, expected):
    out = scaled_window(window, side, reference)
    assert out == expected and out % 2 == 1


def test_hc_windows_scale_both_windows_and_an_explicit_sigma():
    cfg = {**STEP_DEFAULTS, "nms_window": 31, "gauss_size": 11, "gauss_sigma": 3.0, "window_ref_size": 384}
    assert hc_windows(cfg, 64) == (5, 3, 0.5) and hc_windows(cfg, 384) == (31, 11, 3.0)
    assert hc_windows({**cfg, "gauss_sigma": None}, 64)[2] is None  # from the scaled size
    assert hc_windows({**cfg, "window_ref_size": 0}, 64) == (31, 11, 3.0)
    with pytest.raises(ValueError, match="window"):
        scaled_window(10, 64, 384)


def test_head_map_uses_the_scaled_windows():
    net, (image, _), _, heads = _step_setup()  # 32 px
    with torch.no_grad():
        feature = net.parts(image, 1)["feature"]
        probs = [torch.sigmoid(net.head(feature))] + [
            torch.sigmoid(torch.nn.functional.conv2d(feature, h["weight"], h["bias"])) for h in heads]
        cfg = {**STEP_DEFAULTS, "nms_window": 11, "gauss_size": 11, "window_ref_size": 384}  # 11 at 384 -> 3 at 32 px
        assert torch.equal(head_map(net, feature, heads, cfg), uncertainty_map(probs, 3, 0.2, 3))
        assert torch.equal(head_map(net, feature, heads, {**cfg, "window_ref_size": 0}),
                           uncertainty_map(probs, 11, 0.2, 11))


def test_zeros_map_gives_the_calibrated_head_with_a_zero_map():
    net, (image, label), dice, heads = _step_setup()
    net.eval()
    with torch.no_grad():
        feature = net.parts(image, 1)["feature"]
        umap = head_map(net, feature, heads, {**STEP_DEFAULTS, "hc_map": "zeros"})
        assert umap.shape == (2, 1, 32, 32) and not umap.any()
        zero_map = net.calibrated_logits(feature, torch.zeros(2, 1, 32, 32))
        assert torch.equal(SitePredictor(net, 1, heads, {"hc_map": "zeros"})(image), zero_map)
        assert torch.equal(SitePredictor(net, 1, [], {"hc_map": "zeros"})(image), zero_map)  # no other head needed
        assert torch.equal(zero_map, net.calib_head(feature))  # a second plain head on the same feature
    net.train()
    loss = lcfed_step(net, (image, label), torch.optim.SGD(net.parameters(), lr=0.0), dice, [], 1, 3,
                      {"hc_map": "zeros", "lam": 0.0})["loss"]
    with torch.no_grad():
        out = net.parts(image, 1)
        assert loss == pytest.approx(float(dice(out["coarse"], label) + dice(net.calib_head(out["feature"]), label)),
                                     rel=1e-6)


def test_self_uncertainty_is_p_times_1_minus_p_of_the_sites_own_coarse_head():
    p = torch.tensor([0.0, 0.5, 0.9, 1.0]).reshape(1, 1, 2, 2)
    assert torch.allclose(self_uncertainty_map(p), torch.tensor([0.0, 0.25, 0.09, 0.0]).reshape(1, 1, 2, 2))
    net, (image, _), _, heads = _step_setup()
    with torch.no_grad():
        feature = net.parts(image, 1)["feature"]
        own = torch.sigmoid(net.head(feature))
        u = own * (1 - own)
        # window 1 and Gaussian size 1 keep the map as it is (max-normalised): the map IS p (1 - p)
        ident = {**STEP_DEFAULTS, "hc_map": "self_uncertainty", "nms_window": 1, "gauss_size": 1, "nms_threshold": 0.0}
        assert torch.allclose(head_map(net, feature, heads, ident), u / u.amax(dim=(2, 3), keepdim=True))
        cfg = {**STEP_DEFAULTS, "hc_map": "self_uncertainty", "nms_window": 5}
        expected = gaussian_enlarge(nms(u, 5, 0.2), 11)
        assert torch.equal(head_map(net, feature, heads, cfg), expected)
        assert torch.equal(head_map(net, feature, [], cfg), expected)  # the other sites' heads play no part


@pytest.mark.parametrize("cfg, exchanged", [
    ({}, True), ({"hc_map": "zeros"}, False), ({"hc_map": "self_uncertainty"}, False), ({"hc": False}, False),
    ({"hc_map": "disagreement", "head_first_iters": 3}, True),  # a job's whole lcfed section is accepted
])
def test_only_the_disagreement_map_exchanges_heads(cfg, exchanged):
    assert exchanges_heads(cfg) is exchanged


def test_unknown_hc_map_is_named():
    net, batch, dice, heads = _step_setup()
    with pytest.raises(ValueError, match="hc_map"):
        lcfed_step(net, batch, torch.optim.SGD(net.parameters(), lr=0.0), dice, heads, 1, 3, {"hc_map": "ones"})


# --- site contrast on the gates: bounded, and personalization survives aggregation -----------------


def _tiny_pcs_net(seed=0):
    torch.manual_seed(seed)  # PCS acts on C = 4 channels: gates in (0, 1)^4, distances < 2
    return build_net({"name": "lcfed", "n_sites": 3, "channels": [2, 4], "strides": [2], "embed_dim": 6})


def _tiny_data(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 8, 8, generator=gen), (torch.rand(2, 1, 8, 8, generator=gen) > 0.5).float()


def _contrast_run(contrast_on, steps, lam=10.0):
    net, batch = _tiny_pcs_net(), _tiny_data(1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    cfg = {"hc": False, "lam": lam, "contrast_on": contrast_on}
    return [lcfed_step(net, batch, opt, DiceLoss(sigmoid=True, batch=True), [], 1, 3, cfg)["sc"] for _ in range(steps)]


def test_gate_contrast_stays_within_its_bound_over_200_steps_with_a_large_weight():
    bound = 4**0.5  # the largest distance between two gates in (0, 1)^4
    sc = _contrast_run("gate", 200)
    assert all(-bound <= v <= 0 for v in sc), (min(sc), max(sc))


def test_embedding_contrast_leaves_that_bound():  # why it is not the default: the widening grows without limit
    assert min(_contrast_run("embedding", 60)) < -4**0.5


def test_gate_contrast_moves_only_the_sites_own_one_hot_weights_and_keeps_the_others_gates():
    # prepare: no task loss, so one SGD step is the contrast's alone
    def no_task(logits, label):
        return logits.sum() * 0.0

    image, label = _tiny_data(2)
    k = 1
    results = {}
    for contrast_on in ("gate", "gate_all"):
        net = _tiny_pcs_net()
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        with torch.no_grad():
            gates_before = [net.parts(image, j)["gate"] for j in range(3)]
        # execute
        lcfed_step(net, (image, label), torch.optim.SGD(net.parameters(), lr=1.0), no_task, [], k, 3,
                   {"hc": False, "lam": 1.0, "contrast_on": contrast_on})
        with torch.no_grad():
            gates_after = [net.parts(image, j)["gate"] for j in range(3)]
        changed = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
        results[contrast_on] = (changed, gates_before, gates_after, net, before)

    # assert: `gate` changes column k of the first widening layer only; the others' gates stay exactly put
    changed, g0, g1, net, before = results["gate"]
    assert changed == {"pcs.widen.0.weight"}
    w_diff = (net.pcs.widen[0].weight - before["pcs.widen.0.weight"]).abs().sum(dim=0)
    assert w_diff[k] > 0 and w_diff[0] == 0 and w_diff[2] == 0
    assert torch.equal(g1[0], g0[0]) and torch.equal(g1[2], g0[2])

    def spread(gates):
        return sum(float((gates[k] - gates[j]).norm(dim=1).mean()) for j in (0, 2))

    assert spread(g1) > spread(g0)  # site k's gate moved away from the (fixed) others
    # `gate_all` also moves the shared computation, so the others' "stopped" gates move with it
    changed_all, h0, h1, _, _ = results["gate_all"]
    assert {"pcs.fc.weight", "pcs.fc.bias"} <= changed_all and not torch.equal(h1[0], h0[0])


def test_personalization_survives_averaging_the_shared_parameters():
    # prepare: two sites start from the same model and train locally, each on its own data, with its index
    base = _tiny_pcs_net()
    image = _tiny_data(9)[0]

    def gate_gap(net):
        net.eval()
        with torch.no_grad():
            return float((net.parts(image, 0)["gate"] - net.parts(image, 1)["gate"]).norm(dim=1).mean())

    def round_then_average(lam):
        copies = []
        for k in (0, 1):
            net = copy.deepcopy(base)
            opt = torch.optim.Adam(net.parameters(), lr=1e-2)
            batch = _tiny_data(k + 3)
            for _ in range(30):
                lcfed_step(net, batch, opt, DiceLoss(sigmoid=True, batch=True), [], k, 3,
                           {"hc": False, "lam": lam})
            copies.append(net)
        # execute: the server's plain average of the shared parameters (PCS included)
        states = average_shared([c.state_dict() for c in copies], shared_keys(base))
        merged = copy.deepcopy(base)
        merged.load_state_dict(states[0])
        return merged, states

    merged, states = round_then_average(lam=1.0)
    # assert: after aggregation, one shared model whose gates still depend on the site index, and the
    # separation the contrast built at the sites is still there
    assert all(torch.equal(states[0][key], states[1][key]) for key in shared_keys(base))
    gap, gap_start = gate_gap(merged), gate_gap(copy.deepcopy(base))
    gap_no_contrast = gate_gap(round_then_average(0.0)[0])
    assert gap > 1e-2  # measured: 0.111, from 0.086 at the start; 0.062 merged after training without contrast
    assert gap > gap_start and gap > 1.5 * gap_no_contrast, (gap, gap_start, gap_no_contrast)
