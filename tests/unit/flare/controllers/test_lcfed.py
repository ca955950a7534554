"""LC-Fed / FedRep workflows with a stubbed transport: what is averaged, what stays, who gets which heads."""

import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.flare.controllers.lcfed import nbytes
from pflseg.flare.wire import GLOBAL, HEAD, prefixed, unprefixed
from pflseg.nets import build_net
from pflseg.nets.lcfed import personal_keys, shared_keys
from tests.unit.flare.controllers.conftest import Stub, make

LC = {"net": {"name": "lcfed", "channels": [4, 8, 8], "strides": [2, 2]}}
FACTOR = {"site-1": 1.0, "site-2": 2.0, "site-3": 4.0}


def reply_scaled(site, data, hc=True):
    """A site that 'trains' by scaling what it got, and sends its own head (site-specific constant)."""
    body = {k: v * FACTOR[site] if v.is_floating_point() else v for k, v in unprefixed(GLOBAL, data.params).items()
            if not k.startswith(("head.", "calib_head."))}  # a site sends back the shared part only
    params = prefixed(GLOBAL, body)
    if hc:
        params.update(prefixed(HEAD, {"weight": torch.full((1, 4, 1, 1), FACTOR[site]),
                                      "bias": torch.full((1,), FACTOR[site])}))
    return FLModel(params=params, metrics={"val_dice": 0.5}, meta={"NUM_STEPS_CURRENT_ROUND": int(10 * FACTOR[site])})


def test_lcfed_averages_the_shared_part_with_pcs_and_routes_the_others_heads(tmp_path, monkeypatch):
    ctrl = make("lcfed", tmp_path, monkeypatch, **LC)
    ctrl.cfg["robust"]["clip"] = 0  # the plain average: its sites' updates differ beyond the default clip
    ctrl.cfg["robust"]["median_rounds"] = 0  # and in round 1 too (the default 1 is the median)
    assert ctrl.cfg["net"]["n_sites"] == 3  # one PCS embedding per connected site
    net = build_net(ctrl.cfg["net"])
    shared, personal = shared_keys(net), personal_keys(net)
    assert any(k.startswith("pcs.") for k in shared) and personal == ["head.weight", "head.bias", "calib_head.weight",
                                                                      "calib_head.bias"]
    g0 = dict(ctrl.state.global_state)
    stub = Stub(ctrl, reply_scaled)
    out = ctrl.round(0)  # round 0: the full initial model, no heads yet
    assert all(set(unprefixed(GLOBAL, d.params)) == set(g0) and not unprefixed("heads", d.params) for _, _,
               d in stub.sent)
    mean = (1.0 + 2.0 + 4.0) / 3  # plain average, not weighted by n_k
    for key in shared:
        if g0[key].is_floating_point():
            assert torch.allclose(ctrl.state.global_state[key], g0[key] * mean, atol=1e-6), key
    for key in personal:  # heads are not aggregated
        assert torch.equal(ctrl.state.global_state[key], g0[key])
    assert out.metrics["head_bytes"] == {"up": 3 * 5 * 4, "down": 0}

    stub.sent.clear()
    out = ctrl.round(1)  # round 1: the shared part only, and every other site's head
    for _, site, data in stub.sent:
        assert set(unprefixed(GLOBAL, data.params)) == set(shared)
        others = sorted({k.split(".")[1] for k in data.params if k.startswith("heads.")})
        assert others == sorted(set(FACTOR) - {site})
        assert all(float(unprefixed(f"heads.{o}", data.params)["bias"]) == FACTOR[o] for o in others)
    assert out.metrics["head_bytes"] == {"up": 3 * 20, "down": 3 * 2 * 20}
    assert nbytes({"weight": torch.zeros(1, 4, 1, 1), "bias": torch.zeros(1)}) == 20


def test_a_site_left_out_of_a_round_leaves_the_others_maps_until_it_answers_again(tmp_path, monkeypatch):
    """A head accepted once from a site that is then refused (or silent) is not sent on: only the heads of the
    latest round's answering sites reach the others."""
    ctrl = make("lcfed", tmp_path, monkeypatch, **LC)
    absent = set()
    stub = Stub(ctrl, lambda site, data: None if site in absent else reply_scaled(site, data))
    ctrl.round(0)
    absent.add("site-3")
    ctrl.round(1)  # site-3 silent: its round-0 head is still held, and not sent in round 2
    assert "site-3" in ctrl.state.heads and ctrl.state.head_sites == ["site-1", "site-2"]
    stub.sent.clear()
    absent.clear()
    ctrl.round(2)
    heads_sent = {site: sorted({k.split(".")[1] for k in d.params if k.startswith("heads.")})
                  for _, site, d in stub.sent}
    assert heads_sent == {"site-1": ["site-2"], "site-2": ["site-1"], "site-3": ["site-1", "site-2"]}
    assert ctrl.state.head_sites == ["site-1", "site-2", "site-3"]  # it answered round 2: in the maps again
    assert sorted({k.split(".")[1] for k in ctrl.final_params("site-1") if k.startswith("heads.")}) == ["site-2",
                                                                                                   "site-3"]


def test_heads_survive_a_resume(tmp_path, monkeypatch):
    ctrl = make("lcfed", tmp_path, monkeypatch, **LC)
    Stub(ctrl, reply_scaled)
    ctrl.round(0)
    ctrl.store.save(0, ctrl.checkpoint(0))
    again = make("lcfed", tmp_path, monkeypatch, **LC, resume=True)
    assert sorted(again.state.heads) == sorted(FACTOR)
    assert all(torch.equal(again.state.heads[s]["bias"], ctrl.state.heads[s]["bias"]) for s in FACTOR)
    assert again.state.head_sites == sorted(FACTOR)


def test_without_hc_and_for_fedrep_no_head_leaves_a_site(tmp_path, monkeypatch):
    for i, (method, over) in enumerate((
            ("lcfed", {"lcfed": {"hc": False}}), ("fedrep", {"net": {**LC["net"], "pcs": False}}),
            # HC controls
            ("lcfed", {"lcfed": {"hc_map": "zeros"}}), ("lcfed", {"lcfed": {"hc_map": "self_uncertainty"}}))):
        ctrl = make(method, tmp_path / f"{method}{i}", monkeypatch, **{**LC, **over})
        stub = Stub(ctrl, lambda site, data: reply_scaled(site, data, hc=False))
        ctrl.round(0)
        out = ctrl.round(1)
        assert not any(k.startswith("heads.") for _, _, d in stub.sent for k in d.params)
        assert "head_bytes" not in out.metrics


def test_a_site_sending_a_head_without_hc_is_left_out(tmp_path, monkeypatch):
    ctrl = make("lcfed", tmp_path, monkeypatch, **LC, lcfed={"hc": False}, min_clients=1)
    Stub(ctrl, lambda site, data: reply_scaled(site, data, hc=site != "site-2"))
    ctrl.round(0)
    assert set(ctrl.missing) == {"site-1", "site-3"} and "unexpected key 'head." in ctrl.missing["site-1"]


def test_the_head_exchange_returns_the_new_heads_and_their_bytes(tmp_path, monkeypatch):
    ctrl = make("lcfed", tmp_path, monkeypatch, **LC)
    held = {"site-3": {"weight": torch.zeros(1, 4, 1, 1), "bias": torch.zeros(1)}}
    sent = prefixed(GLOBAL, ctrl.state.global_state)
    results = {s: reply_scaled(s, ctrl.message(1, sent)) for s in ("site-1", "site-2")}
    payloads = {s: ctrl.message(1, prefixed("heads.site-3", held["site-3"])) for s in ("site-1", "site-2", "site-3")}
    heads, metrics = ctrl.exchange_heads(results, payloads, held)
    assert list(heads) == ["site-3", "site-1", "site-2"] and heads["site-3"] is held["site-3"]
    assert float(heads["site-2"]["bias"]) == 2.0 and list(held) == ["site-3"]  # the state given is left as it was
    assert metrics == {"head_bytes": {"up": 2 * 20, "down": 2 * 20}}  # what site-3 (no answer) was sent: not counted
