"""Issue 39 F12, the server's half: a deployed post-training job reads a trained job's bundle only when the same
person submitted both (or both belong to one study); the training job's server state records its submitter."""

import json
import types

import pytest

from pflseg.config import load_job_config
from pflseg.flare.methods import METHODS
from pflseg.flare.policy import ORIGIN, PolicyError
from pflseg.flare.state import RoundStore


def meta(submitter: str) -> dict:
    return {"submitter_name": submitter, "submitter_org": "org", "study": "default"}


def controller(tmp_path, monkeypatch, job_id: str, submitter: str, bundle):
    """The FedSM inference controller of job ``job_id``, its job meta in ``./<job id>/meta.json`` as FLARE writes it."""
    (tmp_path / job_id).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / job_id / "meta.json").write_text(json.dumps(meta(submitter)))
    cfg = load_job_config("fedsm_infer", overrides={"fedsm": {"bundle": str(bundle)}})
    ctrl = METHODS["fedsm_infer"].controller(config=cfg)
    ctrl.cfg, ctrl.store = cfg, RoundStore(tmp_path / "state" / "server" / "fedsm_infer")
    ctrl.fl_ctx = types.SimpleNamespace(get_job_id=lambda: job_id)
    return ctrl


@pytest.mark.parametrize("submitter, allowed", [("lead@a.org", True), ("lead@b.org", False)])
def test_a_deployed_post_training_job_reads_only_its_submitters_bundle(tmp_path, monkeypatch, submitter, allowed):
    from pflseg.flare.policy import record_origin

    bundle = tmp_path / "state" / "server" / "fedsm"
    bundle.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train-job").mkdir()
    (tmp_path / "train-job" / "meta.json").write_text(json.dumps(meta("lead@a.org")))
    assert record_origin(bundle, "train-job")  # what open_store writes when the training job claims its folder
    assert json.loads((bundle / ORIGIN).read_text())["submitter"] == "lead@a.org"
    ctrl = controller(tmp_path, monkeypatch, "infer-job", submitter, bundle)
    if allowed:
        assert ctrl.bundle_folder("fedsm.bundle") == bundle
    else:
        with pytest.raises(PolicyError, match=r"the server: refusing fedsm\.bundle: .*lead@a\.org.*lead@b\.org"):
            ctrl.bundle_folder("fedsm.bundle")
    sim = controller(tmp_path / "sim", monkeypatch, "simulate_job", "lead@b.org", tmp_path / "sim" / "state" /
                     "server" / "fedsm")
    assert sim.bundle_folder("fedsm.bundle").name == "fedsm"  # the simulator: as before
