"""The routing validation report: loss and Dice curves of each variant at validation sites, never judged ones."""

import json

import pytest
import torch

from pflseg.data import make_synthetic
from pflseg.eval import routing_validation as rv
from pflseg.flare.state import prefixed, save_file
from pflseg.nets import build_net

NET = {"name": "unet", "channels": [4, 8], "strides": [2], "num_res_units": 1, "norm": "batch", "in_channels": 1,
       "out_channels": 1, "dropout": 0.0}
IOPFL = {"router": "normalised", "loss_weights": None, "norm_affine": None, "rot_flip": None, "rest": None,
         "lr_grid": None, "beta": 0.01, "noise_std": 0.5, "shape_radius": 1, "epochs": 1, "steps": 0,
         "lr": 1e-3, "lr_trial_steps": 0, "batch_size": 4, "shape_reduction": "mean", "size_prior": 1.0}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = make_synthetic(tmp_path_factory.mktemp("rv") / "data", n_sites=3, cases=3, size=16, depth=4)
    ws = tmp_path_factory.mktemp("run")
    nets = []
    for i in range(3):
        torch.manual_seed(i)
        nets.append(build_net(NET).state_dict())
    save_file(ws / "state" / "server" / "iopfl" / "bundle.pt",
              {"sites": ["site-1", "site-2"], **prefixed("global", nets[2]), **prefixed("person.site-1", nets[0]),
               **prefixed("person.site-2", nets[1])})
    (ws / "run.json").write_text(json.dumps({"config": {"method": "iopfl", "net": NET, "data": {"size": 16},
                                                         "iopfl": IOPFL}}))
    return root, ws


def test_curves_hold_step_0_every_k_steps_and_the_end_and_rho_is_a_rank_correlation(run):
    root, ws = run
    cfg = json.loads((ws / "run.json").read_text())["config"]
    report = rv.validate_routing(ws / "state/server/iopfl/bundle.pt", cfg, root, ["site-3"],
                                 {"mean+prior1": rv.VARIANTS["mean+prior1"]}, [1e-2], every=2, steps=5)
    site = report["variants"]["mean+prior1"]["sites"]["site-3"]
    curve = site["curves"][0]
    assert [p["step"] for p in curve["points"]] == [0, 2, 4, 5]
    assert -1 <= site["rho"] <= 1 and 0 <= site["start_dice"] <= 1
    assert len(report["prior"]) == 1 and 0 < report["prior"][0] < 1  # the inside sites' training-label fraction
    assert curve["router_movement"] > 0  # the routers left their start
    assert "| mean+prior1 | site-3 |" in rv.to_markdown(report)


def test_refuses_inside_and_judged_sites(run, tmp_path):
    root, ws = run
    with pytest.raises(ValueError, match="site-1 trained in the bundle"):
        rv.report(run=str(ws), data=str(root), site_names="site-1")
    info = json.loads((root / "dataset.json").read_text())
    info["site_profiles"] = {"site-3": {"kind": "outside", "outside_kind": "blend"}}
    judged = tmp_path / "judged"
    judged.mkdir()
    (judged / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="judged outside site"):
        rv.check_sites(judged, ["site-3"], ["site-1", "site-2"])
