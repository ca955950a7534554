"""Every job in the real FLARE simulator on tiny data: completes, thread-count invariant, resumable."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pflseg.config import job_names
from pflseg.data import make_synthetic
from pflseg.deploy import simulator
from pflseg.deploy.simulator import Interrupted, run_simulator
from pflseg.flare.jobs import export_job
from pflseg.flare.state import RoundStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TINY = {"rounds": 2, "min_clients": 2, "data": {"size": 32},
        "net": {"channels": [4, 8, 16], "strides": [2, 2]}, "train": {"batch_size": 8}}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("data") / "root", n_sites=4, cases=5, size=32, depth=6)


def run(name, ws, data, sites=2, threads=None, progress=lambda m: None, **over):
    if name.startswith("fedsm_extra"):
        over.setdefault("fedsm", {"extra_rounds": 1})
    if "fundus" in name:  # two-class jobs on their own synthetic data, made at the sites (embedded default)
        data = None
    job = export_job(name, ws / "jobs", overrides={**TINY, **over})
    return run_simulator(job, ws, n_sites=sites, threads=threads, data=data, progress=progress)


#: FedSM's uninterrupted run (2 sites, 2 threads, 2 rounds) is both the reference of its resume check and the
#: bundle of its inference check: trained once (``straight_run``), by the one worker that runs both (their group)
SHARED = "fedsm"
ONE_WORKER = pytest.mark.xdist_group("simulator_fedsm")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, data):
    """``straight_run(name, **over)``: the workspace and results of an uninterrupted run of job ``name`` (2 sites,
    2 threads, 2 rounds, ``over``), run once per module for each job and config (a post-training job reads its bundle
    from a workspace beside its own: PFLSEG_BUNDLE_ROOTS is the parent)."""
    done: dict = {}

    def get(name, **over):
        key = json.dumps([name, over], sort_keys=True)
        if key not in done:
            ws = tmp_path_factory.mktemp(name) / "straight"
            done[key] = ws, run(name, ws, data, sites=2, threads=2, rounds=2, **over)
        return done[key]

    return get


def stop_after_round_1(run_job, monkeypatch) -> None:
    """``run_job(progress)`` (a simulator run) stopped the moment its server logs round 1 done, as a Ctrl-C stops
    ``pflseg run``: the simulator is stopped whole (``run_side_by_side``'s stop, the path a signal takes), no later
    task runs, and the run says it completed 1 round; its state is what ``--resume`` continues from."""
    stop: list[int] = []
    monkeypatch.setattr(simulator, "_STOP", stop)

    def progress(msg):
        if " round 1 done in " in msg and not stop:
            stop.append(signal.SIGINT)

    try:
        with pytest.raises(Interrupted) as stopped:
            run_job(progress)
    finally:
        stop.clear()
    assert stopped.value.rounds_done == 1


def server_state(ws, name):
    store = RoundStore(ws / "state" / "server" / name)
    return store.load(store.latest())


def tensors_of(obj, prefix=""):
    """Every tensor inside nested dicts / lists, by path."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for k, v in items:
        out.update(tensors_of(v, f"{prefix}/{k}"))
    return out


def assert_same_states(a: dict, b: dict):
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta and set(ta) == set(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


# fedsm and fedsm_extra run in the inference test, fedsm_fundus inside fedsm_extra_fundus; grace and lcfed in the
# threads/resume test (lcfed_fundus covers LC-Fed's two-class case); fedbn in the provisioned federations
# (test_deploy.py: a restarted site and a straggler; test_deploy_faults.py: a dead site); iopfl*: test_iopfl.py;
# centralized_lcnet is centralized (run here) on ft's net (run here): a yaml-only variant needs no run of its own; so
# are grace_refcode (grace with grace.self_similarity: exclude, unit-tested in test_grace.py) and lcfed_hczero /
# lcfed_hcself (lcfed with lcfed.hc_map: zeros / self_uncertainty, unit-tested in test_lcfed.py and the site /
# controller tests); fedavg_tiny (fedavg, smaller) is the README quick start's first command, run in test_quickstart.py;
# fedavg itself runs in the simulator in test_malicious, test_stop, test_update_privacy, test_generic_data and
# test_error_text (fedprox, here, is its controller with the sites' proximal term)
COVERED_ELSEWHERE = ("fedsm", "fedsm_extra", "fedsm_fundus", "fedsm_infer", "fedbn", "grace", "lcfed", "iopfl",
                     "iopfl_route", "centralized_lcnet", "grace_refcode", "lcfed_hczero", "lcfed_hcself",
                     "cross_site",  # test_cross_site.py
                     "fedavg_tiny",  # test_quickstart.py
                     "fedavg",  # test_malicious.py, test_stop.py, test_update_privacy.py, ...
                     "ditto")  # test_ditto.py


#: what each job's results must hold: sites run, rounds in the history (extra selector round), a global
#: model scored at the sites, the LC-Fed table's IoU / ASSD, the coarse head scored (HC), classes, FT entries
EXPECT = {
    "local":              dict(sites=2, rounds=2, glob=False, iou=False, coarse=False, classes=1),
    "fedprox":            dict(sites=2, rounds=2, glob=True, iou=False, coarse=False, classes=1),
    "centralized":        dict(sites=2, rounds=2, glob=True, iou=False, coarse=False, classes=1),
    "fedsm_extra_fundus": dict(sites=2, rounds=3, glob=True, iou=False, coarse=False, classes=2),
    # K = 2: uniform weights
    "grace_server":       dict(sites=3, rounds=2, glob=True, iou=False, coarse=False, classes=1),
    "grace_client":       dict(sites=2, rounds=2, glob=True, iou=False, coarse=False, classes=1),
    "lcfed_fundus":       dict(sites=2, rounds=2, glob=False, iou=True, coarse=True, classes=2),
    "lcfed_nohc":         dict(sites=2, rounds=2, glob=False, iou=True, coarse=False, classes=1),
    "fedrep":             dict(sites=2, rounds=2, glob=False, iou=True, coarse=False, classes=1),
    "ft":                 dict(sites=2, rounds=2, glob=True, iou=True, coarse=False, classes=1),
}


def test_every_job_is_run_by_a_test():
    assert set(job_names()) - set(COVERED_ELSEWHERE) == set(EXPECT)


#: job variants whose code the suite runs elsewhere in FLARE (GRACE's server in grace_server, LC-Fed without head
#: calibration in lcfed_fundus's network and sites) and in process (their site classes: tests/unit/flare/sites/):
#: run with ``-m extended`` (docs/testing.md)
EXTENDED = ("grace_client", "lcfed_nohc")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n
                                  for n in sorted(EXPECT)])
def test_job_completes_with_per_site_test_dice(name, tmp_path, data):
    expect = EXPECT[name]
    sites = [f"site-{i}" for i in range(1, expect["sites"] + 1)]
    res = run(name, tmp_path, data, sites=len(sites))
    assert res["sites"] == sites and not res["missing"]
    assert [h["round"] for h in res["history"]] == list(range(1, expect["rounds"] + 1))  # counted from 1
    for site in res["sites"]:
        test = res["test"][site]
        assert 0.0 <= test["site"]["dice"] <= 1.0 and test["site"]["n_cases"] >= 1
        assert ("global" in test) == expect["glob"]
        if expect["glob"]:
            assert 0.0 <= test["global"]["dice"] <= 1.0
        if expect["iou"]:
            assert 0.0 <= test["site"]["iou"] <= test["site"]["dice"] and test["site"]["assd_undefined"] >= 0
        assert ("site_coarse" in test) == expect["coarse"]  # HC on: the coarse head is scored too
        assert len(test["site"]["dice_per_class"]) == expect["classes"]
    if expect["coarse"]:
        hb = res["history"][1]["head_bytes"]  # each site sends its head, and gets the other K - 1
        assert hb["down"] == (len(res["sites"]) - 1) * hb["up"] > 0
    assert ("ft" in res) == (name == "ft") and sorted(res.get("ft", res["sites"])) == res["sites"]
    run_dir = tmp_path / "sim" / "server" / "simulate_job"
    assert (run_dir / "results.json").is_file()  # in the FLARE run dir too (downloaded with the job)
    tb = {p.name for p in (run_dir / "tb_events").iterdir()}  # TensorBoard via FLARE
    if "grace_weights" in res["history"][0]:  # GRACE's server weights: every round, results + TensorBoard
        for h in res["history"]:
            w, sim = list(h["grace_weights"].values()), h["similarity"]
            assert abs(sum(w) - 1) < 1e-6 and all(0 < x < 1 for x in w)
            assert max(w) - min(w) > 1e-6  # three different updates: not FedAvg's equal weights
            c = [sum(row) for row in sim["matrix"]]  # paper's consistency; all sites have the same n_k here
            assert all(abs(x - ck / sum(c)) < 1e-6 for x, ck in zip(w, c))
            assert sim["sites"] == sites and all(abs(sim["matrix"][i][i] - 1) < 1e-6 for i in range(len(sites)))
        (server,) = tb - set(sites)  # the server's identity ("simulator_server" here)
        assert list((run_dir / "tb_events" / server).rglob("events.*"))
    else:
        assert tb == set(sites)


@pytest.mark.parametrize("name", [pytest.param(SHARED, marks=ONE_WORKER),
                                  *(pytest.param(n, marks=pytest.mark.extended) for n in ("grace", "lcfed"))])
def test_threads_and_resume_do_not_change_the_models(name, tmp_path, data, monkeypatch, straight_run):
    """An uninterrupted run with -t 2 against one with -t 1 stopped after round 1 and resumed with -t 2: equal
    final models (server checkpoint and every site's state) prove thread-count invariance and exact resume at
    once. (-t 1 only before the stop: with one thread FLARE starts a process per site per task, ~9 s each; the stop
    as soon as round 1 is done spares the -t 1 run the final tasks a finished run would have.
    Resume after a server SIGKILL in a provisioned federation: test_deploy.py; a FedBN site's kept norm layers
    across missed rounds: sites/test_faults.py.)
    GRACE runs with adversarial alignment, whose discriminator is site state carried across the resume
    (with K = 2 its consistency weights are uniform; the grace_server run above has K = 3);
    LC-Fed's heads (site state) and the server's copies of the coarse heads are carried the same way.
    GRACE and LC-Fed run with ``-m extended``: their server state resumes bit for bit in process
    (tests/unit/flare/controllers/test_resume.py), thread invariance and site state across a real resume are shown
    here by FedSM and by IOP-FL and Ditto (test_iopfl.py, test_ditto.py)."""
    over = {"grace": {"align": "adv"}} if name == "grace" else {}
    straight_ws, straight = straight_run(name, **over)
    assert sorted(straight["test"]) == straight["sites"] and not straight["missing"]
    assert all(0.0 <= straight["test"][s]["site"]["dice"] <= 1.0 for s in straight["sites"])
    if name == "grace":  # the server's consistency weights: every round, in results and TensorBoard
        assert all(abs(sum(h["grace_weights"].values()) - 1) < 1e-6 for h in straight["history"])
        tb = straight_ws / "sim" / "server" / "simulate_job" / "tb_events"
        (server,) = {p.name for p in tb.iterdir()} - set(straight["sites"])
        assert list((tb / server).rglob("events.*"))
    stop_after_round_1(lambda progress: run(name, tmp_path / "resumed", data, sites=2, threads=1, rounds=2,
                                            progress=progress, **over), monkeypatch)
    resumed = run(name, tmp_path / "resumed", data, sites=2, threads=2, rounds=2, resume=True, **over)
    assert [h["round"] for h in resumed["history"]] == [1, 2]
    assert resumed["test"] == straight["test"]
    assert_same_states(server_state(straight_ws, name), server_state(tmp_path / "resumed", name))
    for site in straight["sites"]:
        a = RoundStore(straight_ws / "state" / site / name)
        b = RoundStore(tmp_path / "resumed" / "state" / site / name)
        assert a.latest() == b.latest() == 1
        assert_same_states(a.load(1), b.load(1))
        if name == "grace":
            assert any(k.startswith("disc.") for k in a.load(1))
    if name == "lcfed":
        assert sorted({k.split(".")[1] for k in server_state(tmp_path / "resumed", name)
                       if k.startswith("heads.")}) == straight["sites"]


def test_missing_data_location_fails_with_a_clear_message(tmp_path, monkeypatch):
    cfg = tmp_path / "site.json"
    cfg.write_text(json.dumps({"data": str(tmp_path / "nowhere")}))
    monkeypatch.setenv("PFLSEG_SITE_CONFIG", str(cfg))
    job = export_job("fedavg", tmp_path / "jobs", overrides={**TINY, "rounds": 1})
    with pytest.raises(RuntimeError, match="did not finish"):
        run_simulator(job, tmp_path, n_sites=2, progress=lambda m: None)
    log = (tmp_path / "sim" / "server" / "log.txt").read_text()  # what the site sent: no absolute path
    assert "site-1: data location file-" in log and "does not exist" in log  # the path: a pseudonym
    assert not [line for line in log.splitlines() if "left out of this round" in line and str(tmp_path) in line]
    site_log = (tmp_path / "state" / "site-1" / "site_errors.log").read_text()  # the site-local log: the whole path
    assert f"data location {tmp_path / 'nowhere'}" in site_log
    assert "detail in the site's <state>/site_errors.log" in log


def test_python_job_py_route_with_simenv(tmp_path):
    env = {**os.environ, "PFLSEG_STATE_DIR": str(tmp_path / "state")}
    cmd = [sys.executable, str(REPO / "job.py"), "local", "--sites", "2", "--rounds", "1", "--workspace", str(tmp_path),
           "--set", "data.size=32", "--set", "net.channels=[4,8,16]", "--set", "net.strides=[2,2]"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "state" / "server" / "local" / "results.json").read_text())
    assert sorted(res["test"]) == ["site-1", "site-2"]
    # no data configured: each site made the embedded synthetic default in its own workspace
    assert sorted(p.parent.name for p in tmp_path.rglob("pflseg_synth")) == ["site-1", "site-2"]


@pytest.mark.parametrize("trained", [pytest.param(SHARED, marks=ONE_WORKER), "fedsm_extra"])
def test_fedsm_inference_at_inside_and_outside_sites(trained, tmp_path, data, straight_run):
    if trained == SHARED:  # the run of the resume check (the same job, config and data)
        train_ws, _ = straight_run(trained)
    else:
        train_ws = tmp_path / "train"
        run(trained, train_ws, data)
    bundle = train_ws / "state" / "server" / trained
    infer_ws = train_ws.parent / "infer"  # beside the bundle's workspace (PFLSEG_BUNDLE_ROOTS: the parent)
    res = run("fedsm_infer", infer_ws, data, sites=3, fedsm={"bundle": str(bundle)})
    assert res["inside_sites"] == ["site-1", "site-2"] and sorted(res["infer"]) == ["site-1", "site-2", "site-3"]
    outside, inside = res["infer"]["site-3"], res["infer"]["site-1"]
    assert outside["personalized"] is None and inside["personalized"] is not None
    routes = ["extra"] if trained == "fedsm_extra" else [str(g) for g in (0.0, 0.5, 0.9, 0.99, 1.0)]
    for site in res["infer"].values():
        assert sorted(site["super"]) == sorted(routes)
        for route in site["super"].values():
            assert abs(sum(route["selection"]) - 1) < 1e-6 and 0 <= route["dice"] <= 1
    if trained == "fedsm":  # gamma = 1 is the global model
        assert outside["super"]["1.0"]["dice"] == outside["global"]["dice"]
    assert list((infer_ws / "state" / "site-3" / "fedsm_infer" / "predictions").glob("*.nii.gz"))


@pytest.mark.extended  # the message: tests/unit/flare/controllers/test_fedsm.py; a failing job's path: above
def test_fedsm_inference_without_bundle_fails_clearly(tmp_path, data):
    with pytest.raises(RuntimeError, match="did not finish"):
        run("fedsm_infer", tmp_path, data, fedsm={"bundle": str(tmp_path / "none")})
    assert "holds no FedSM checkpoint" in (tmp_path / "sim" / "server" / "log.txt").read_text()


@pytest.mark.extended  # the message: tests/unit/flare/sites/test_base.py; a site's refusal in FLARE: above
def test_job_for_other_classes_than_the_data_is_refused(tmp_path, data):
    with pytest.raises(RuntimeError, match="did not finish"):
        run("fedavg", tmp_path, data, net={"out_channels": 2})
    assert "net.out_channels=2" in (tmp_path / "sim" / "server" / "log.txt").read_text()
