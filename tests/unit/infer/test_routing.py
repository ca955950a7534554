import torch

from pflseg.infer.routing import METHODS, route_site
from pflseg.nets import build_net

NET = {"channels": [4, 8], "strides": [2], "num_res_units": 0}
CFG = {"router": "paper", "loss_weights": "paper", "beta": 0.01, "noise_std": 0.5, "rot_flip": False, "shape_radius": 1,
       "epochs": 1, "lr": 1e-3, "batch_size": 2, "norm_affine": False}


def sample(case, labelled):
    torch.manual_seed(len(case))
    return {"image": torch.randn(1, 16, 16), "label": (torch.rand(1, 16, 16) > 0.5).float(), "case": case, "slice": 0,
            "site": "site-9", "has_label": labelled}


def test_route_site_scores_every_method_and_writes_png_for_2d_images(tmp_path):
    nets = []
    for i in range(3):
        torch.manual_seed(i)
        nets.append(build_net(NET))
    data = [sample("a", True), sample("bb", True), sample("ccc", False)]  # one 2D image per case, one unlabeled
    res = route_site(nets[:2], nets[2], data, "cpu", CFG, out_dir=tmp_path / "pred")
    assert sorted(res["methods"]) == sorted(METHODS) and res["n_images"] == 3
    for m in res["methods"].values():
        assert 0 <= m["dice"] <= 1 and sorted(m["per_case"]) == ["a", "bb"]  # labels only score
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == ["a.png", "bb.png", "ccc.png"]


def test_route_site_reports_the_learned_mix_per_layer_in_expert_order(tmp_path):
    nets = []
    for i in range(3):
        torch.manual_seed(i)
        nets.append(build_net(NET))
    res = route_site(nets[:2], nets[2], [sample("a", True), sample("bb", True)], "cpu", CFG)
    assert sorted(res["coefficients"]) == ["routing", "routing_global", "routing_layer"]
    for name, c in res["coefficients"].items():
        assert len(c["mean"]) == 3 and all(len(layer) == 3 for layer in c["layers"])  # P_1, P_2, w_g
        assert abs(sum(c["mean"]) - 1) < 1e-5, name  # normalised mixes
    one = res["coefficients"]["routing_global"]["layers"]
    assert all(layer == one[0] for layer in one)  # the paper's Global: one vector shared by every layer
