import pytest
import torch
from monai.networks.nets import UNet

from pflseg.algorithms.lcfed import average_shared, lcfed_loss
from pflseg.nets import build_net
from pflseg.nets.lcfed import PCS, LCFedNet, personal_keys, shared_keys

TINY = {"name": "lcfed", "n_sites": 3, "channels": [4, 8, 8, 8, 8], "embed_dim": 6}


def tiny_net(**over):
    torch.manual_seed(0)
    return build_net({**TINY, **over})


@pytest.mark.parametrize("out_channels", [1, 2])
def test_forward_shapes_for_one_and_two_class_outputs(out_channels):
    net = tiny_net(out_channels=out_channels)
    out = net.parts(torch.randn(2, 1, 32, 48), 1)
    assert set(out) == {"feature", "coarse", "embedding", "gate", "descriptor"}
    assert out["feature"].shape == (2, 4, 32, 48)
    assert out["coarse"].shape == (2, out_channels, 32, 48)
    assert out["embedding"].shape == (2, 6)
    assert out["gate"].shape == out["descriptor"].shape == (2, 8)  # channels of the last encoder stage
    assert ((out["gate"] > 0) & (out["gate"] < 1)).all()
    assert (net.calibrated_logits(out["feature"], torch.zeros(2, out_channels, 32, 48)).shape
            == (2, out_channels, 32, 48))


def test_per_sample_site_indices_give_each_sample_its_site_embedding():
    net = tiny_net()
    out = net.parts(torch.randn(3, 1, 32, 32), torch.tensor([0, 2, 0]))
    emb = out["embedding"]
    assert torch.equal(emb[0], emb[2]) and not torch.allclose(emb[0], emb[1])
    assert torch.allclose(emb[1], net.pcs.embed(torch.tensor([2]))[0])


def test_pcs_with_zero_fc_scales_the_feature_by_one_and_a_half():
    # prepare: fc = 0 -> h = sigmoid(0) = 0.5 -> x * 0.5 + x
    pcs = PCS(channels=3, n_sites=2, embed_dim=4)
    torch.nn.init.zeros_(pcs.fc.weight)
    torch.nn.init.zeros_(pcs.fc.bias)
    x = torch.randn(1, 3, 5, 5)
    # execute
    y, emb = pcs(x, 0)
    # assert (batch 1 works: the embedding norm acts on one vector)
    assert torch.allclose(y, 1.5 * x) and emb.shape == (1, 4)


def test_pcs_is_a_registered_shared_module_trained_by_the_task_loss():
    net = tiny_net()
    keys = net.state_dict().keys()
    pcs = [k for k in keys if k.startswith("pcs.")]
    assert {"pcs.widen.0.weight", "pcs.widen.3.weight", "pcs.fc.weight", "pcs.fc.bias"} <= set(pcs)
    assert set(pcs) <= set(shared_keys(net))
    assert personal_keys(net) == ["head.weight", "head.bias", "calib_head.weight", "calib_head.bias"]
    assert sorted(shared_keys(net) + personal_keys(net)) == sorted(keys)

    label = (torch.rand(2, 1, 32, 32) > 0.5).float()
    out = net.parts(torch.randn(2, 1, 32, 32), 1)
    lcfed_loss(out["coarse"], None, label, torch.tensor(0.0), lam=0.0).backward()
    for name, p in net.pcs.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_pcs_parameters_are_averaged_by_average_shared_and_heads_are_not():
    a, b = tiny_net(), tiny_net()
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    sa, sb = a.state_dict(), b.state_dict()
    new = average_shared([sa, sb], shared_keys(a))
    assert torch.allclose(new[0]["pcs.fc.weight"], sa["pcs.fc.weight"] + 0.5)
    assert torch.equal(new[0]["pcs.fc.weight"], new[1]["pcs.fc.weight"])
    assert (torch.equal(new[0]["head.weight"], sa["head.weight"])
            and torch.equal(new[1]["head.weight"], sb["head.weight"]))
    a.load_state_dict(new[0])  # the result is a loadable state


def test_calibrated_head_input_equals_the_feature_when_the_map_is_zero():
    net = tiny_net(out_channels=2)
    feature = net.parts(torch.randn(1, 1, 32, 32), 0)["feature"]
    calib = net.calibrated_logits(feature, torch.zeros(1, 2, 32, 32))
    assert torch.allclose(calib, net.calib_head(feature))
    assert not torch.allclose(net.calibrated_logits(feature, torch.ones(1, 1, 32, 32)), calib)


@pytest.mark.parametrize("cfg, match", [
    ({"name": "lcfed", "n_sites": 2, "width": 3}, "unknown key"),
    ({"name": "lcfed"}, "n_sites"),
    ({"name": "lcfed", "n_sites": 2, "strides": [2, 2]}, "strides"),
    ({"name": "lcfed", "n_sites": 0}, "n_sites"),
    ({"name": "nope"}, "unknown network"),
])
def test_bad_configs_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_net(cfg)


def test_site_index_out_of_range_is_an_error():
    net = tiny_net()
    with pytest.raises(ValueError, match="site_index"):
        net.parts(torch.randn(1, 1, 32, 32), 3)


def test_unet_name_is_unchanged_and_defaults_are_five_stages():
    assert isinstance(build_net({}), UNet) and isinstance(build_net({"name": "unet"}), UNet)
    net = build_net({"name": "lcfed", "n_sites": 2})
    assert isinstance(net, LCFedNet) and len(net.encoder) == 5 and net.feature_channels == 16


def test_plain_forward_is_the_coarse_head_of_the_nets_site_and_pcs_can_be_left_out():
    net = tiny_net().eval()
    net.site = 2
    image = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(net(image), net.parts(image, 2)["coarse"])
        assert not torch.equal(net(image), net.parts(image, 0)["coarse"])  # PCS makes the site matter
    plain = tiny_net(pcs=False)
    assert plain.pcs is None and not any(k.startswith("pcs.") for k in plain.state_dict())
    assert plain.parts(image)["embedding"] is None
