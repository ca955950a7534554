"""FLARE's own privacy filters on pflseg's updates, in the real simulator (issue 23 item 6): with
``privacy.update.send: diff`` a FedAvg job whose sites run nvflare's ExcludeVars and PercentilePrivacy as task
result filters finishes with every site in every round; the excluded layer never moves and every other float moves
at most PercentilePrivacy's bound per round. (Before: ExcludeVars left every site out, "missing key", and
PercentilePrivacy turned int buffers into floats and clipped the full weights.)"""

import pytest
import torch

from pflseg.data import make_synthetic
from pflseg.deploy.simulator import run_simulator
from pflseg.flare.jobs import export_job
from pflseg.flare.state import RoundStore, unprefixed
from pflseg.nets import build_net
from pflseg.train.loop import seed_everything

pytestmark = pytest.mark.slow
GAMMA = 1e-5
FILTERS = [{"filter": "nvflare.app_common.filters.ExcludeVars", "args": {"exclude_vars": r"global\.model\.0\."}},
           {"filter": "nvflare.app_common.filters.PercentilePrivacy", "args": {"percentile": 10, "gamma": GAMMA}}]
TINY = {"rounds": 2, "min_clients": 2, "data": {"size": 32}, "net": {"channels": [4, 8], "strides": [2]},
        "train": {"batch_size": 8}, "privacy": {"update": {"send": "diff", "filters": FILTERS}}}


def test_fedavg_with_flare_filters_on_differences_runs_end_to_end(tmp_path):
    data = make_synthetic(tmp_path / "data", n_sites=3, cases=4, size=32, depth=4)
    job = export_job("fedavg", tmp_path / "jobs", overrides=TINY)
    res = run_simulator(job, tmp_path / "ws", n_sites=3, data=data, progress=lambda m: None)
    assert res["missing"] == {} and [h["round"] for h in res["history"]] == [1, 2]
    assert all(set(h["val_dice"]) == {"site-1", "site-2", "site-3"} for h in res["history"])
    assert all(0.0 <= res["test"][s]["global"]["dice"] <= 1.0 for s in ("site-1", "site-2", "site-3"))

    seed_everything(res["config"]["seed"])
    initial = build_net(res["config"]["net"]).state_dict()
    store = RoundStore(tmp_path / "ws" / "state" / "server" / "fedavg")
    models = [initial] + [unprefixed("global", store.load(r)) for r in (0, 1)]
    n_k = max(m["n_samples"] for h in res["history"] for m in h["site_metrics"].values())
    excluded = [k for k in initial if k.startswith("model.0.")]
    assert excluded
    for before, after in zip(models, models[1:]):
        assert all(torch.equal(after[k], before[k]) for k in excluded)  # ExcludeVars: no site's update of it
        for k, v in before.items():
            assert after[k].dtype == v.dtype  # int buffers stay int
            if v.is_floating_point():  # PercentilePrivacy: |diff| <= gamma x n_k at every site
                assert float((after[k] - v).abs().max()) <= GAMMA * n_k * 1.01
        assert any(not torch.equal(after[k], before[k]) for k in before if k not in excluded)
