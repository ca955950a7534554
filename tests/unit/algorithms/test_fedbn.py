from torch import nn

from pflseg.algorithms.fedbn import norm_keys, shared_keys
from pflseg.nets import build_unet


def test_norm_layers_found_by_type_in_monai_unet():
    net = build_unet({"channels": [4, 8], "strides": [2], "norm": "batch"})
    keys = norm_keys(net)
    bn_modules = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bn_modules and len(keys) == 5 * len(bn_modules)  # weight, bias, running mean/var, num_batches
    assert not any(".bn" in k or "bn." in k for k in keys)  # MONAI names them adn.N: no substring guess works
    assert set(shared_keys(net)) | keys == set(net.state_dict())
    assert not set(shared_keys(net)) & keys


def test_instance_norm_without_state_leaves_everything_shared():
    net = build_unet({"channels": [4, 8], "strides": [2], "norm": "instance"})
    assert norm_keys(net) == set()
    assert shared_keys(net) == list(net.state_dict())
