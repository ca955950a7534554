"""Shared stubs for the site tests: a tiny synthetic data root, a site built from a job config, and the
server's messages, with no FLARE process (the site classes are called directly)."""

import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import check_effective, load_job_config
from pflseg.data import make_synthetic
from pflseg.flare.methods import METHODS
from pflseg.flare.state import RoundStore, prefixed
from pflseg.nets import build_net

TINY = {"rounds": 2, "min_clients": 2, "data": {"size": 32}, "net": {"channels": [4, 8, 16], "strides": [2, 2]},
        "train": {"batch_size": 8, "epochs": 1}}
SITES = ["site-1", "site-2"]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("sites") / "root", n_sites=3, cases=5, size=32, depth=6)


class Federation:
    """A job's config and the messages its server would send, for sites called in this process."""

    def __init__(self, job: str, root, state, monkeypatch, **over):
        monkeypatch.setenv("PFLSEG_DATA", str(root))
        monkeypatch.setenv("PFLSEG_STATE_DIR", str(state))
        monkeypatch.setenv("PFLSEG_DEVICE", "cpu")
        cfg = load_job_config(job, overrides={**TINY, **over})
        if cfg["net"]["name"] == "lcfed":
            cfg["net"]["n_sites"] = len(SITES)
        self.cfg, self.state = check_effective(cfg), state
        torch.manual_seed(0)
        self.initial = {k: v.detach().clone() for k, v in build_net(self.cfg["net"]).state_dict().items()}

    def site(self, name: str = "site-1", sites=SITES):
        return METHODS[self.cfg["method"]].site(name, self.cfg, list(sites))

    def message(self, r: int, params: dict | None = None, **meta) -> FLModel:
        return FLModel(params=params if params is not None else prefixed("global", self.initial), current_round=r,
                       meta={"pflseg": self.cfg, "sites": SITES, **meta})

    def store(self, name: str = "site-1") -> RoundStore:
        return RoundStore(self.state / name / self.cfg["name"])


@pytest.fixture
def federation(tiny_root, tmp_path, monkeypatch):
    return lambda job, **over: Federation(job, tiny_root, tmp_path / "state", monkeypatch, **over)


def keys_of(params: dict, prefix: str) -> set:
    return {k[len(prefix) + 1:] for k in params if k.startswith(prefix + ".")}


def optimizer_tensors_on(state: dict) -> set:
    """Devices of every tensor in an optimizer state dict's per-parameter state."""
    return {v.device.type for s in state["state"].values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0}
