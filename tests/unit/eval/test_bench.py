from pflseg.data import make_synthetic
from pflseg.eval.bench import Bench, _seed_means, paired_difference, routing_summary, to_markdown
from pflseg.flare.controllers.iopfl import route_table


def test_plan_runs_each_job_once_and_training_before_post_training(tmp_path):
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    one = Bench(tmp_path / "ws", data=root, methods=["fedavg", "fedsm", "iopfl"], seeds=[0], holdout=["site-4"])
    assert one.inside == ["site-1", "site-2", "site-3"]
    plan = [job for _, fold, job in one.plan()]
    # the inside runs serve the outside table; FedAvg's run is FedSM's global model (Method.global_as): not run
    assert plan == ["fedsm", "fedsm_infer", "iopfl", "iopfl_route"] and one.source("inside", "fedavg") == "fedsm"
    assert {fold for _, fold, _ in one.plan()} == {"inside"}
    assert one.clients("inside", "iopfl_route") == ["site-1", "site-2", "site-3", "site-4"]
    every = Bench(tmp_path / "ws2", data=root, methods=["iopfl"], seeds=[0, 1], holdout=["all"])
    folds = {(s, f) for s, f, j in every.plan() if j == "iopfl_route"}
    assert folds == {(s, f"without-site-{i}") for s in (0, 1) for i in range(1, 5)}
    assert every.trained_on("without-site-2") == ["site-1", "site-3", "site-4"]


def test_fedavg_is_read_from_a_run_whose_global_model_is_fedavgs_only_with_the_same_settings(tmp_path, monkeypatch):
    """Issue 42 item 1: FedAvg's columns (inside, its best global model outside, curves, steps) come from the IOP-FL
    run (the same global model bit for bit: tests/unit/flare/sites/test_fedavg.py) when every setting outside
    IOP-FL's own section is the same; a setting of IOP-FL's run that FedAvg's lacks makes FedAvg run."""
    from pflseg.eval import bench as bench_module

    calls, said = [], []
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator(calls))
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedavg", "iopfl"], seeds=[0], holdout=["all"], rounds=1,
                  outside=False, progress=said.append)
    assert [job for _, _, job in bench.plan()] == ["iopfl"] and bench.source("inside", "fedavg") == "iopfl"
    monkeypatch.setattr(bench, "tables", lambda: None)
    bench.execute()
    assert calls == ["iopfl"] and "fedavg: read from the iopfl runs" in said[0]
    assert bench.results(0, "inside", "fedavg") == bench.results(0, "inside", "iopfl") == {"run": 1}
    assert bench.names(0, "inside", "fedavg") == bench.names(0, "inside", "iopfl")
    own = {"iopfl": {"iopfl": {"tau": 0.5}}}  # its own section: still FedAvg's global model
    assert [j for _, _, j in Bench(tmp_path / "ws2", data=root, methods=["fedavg", "iopfl"], seeds=[0], rounds=1,
                                   holdout=["site-4"], per_job=own).plan()] == ["iopfl", "iopfl_route"]
    other = {"iopfl": {"train": {"lr": 0.01}}}
    assert [j for _, _, j in Bench(tmp_path / "ws3", data=root, methods=["fedavg", "iopfl"], seeds=[0], rounds=1,
                                   holdout=["site-4"], per_job=other).plan()] == ["fedavg", "iopfl", "iopfl_route"]


def test_the_mean_row_spreads_over_seeds_not_over_sites():
    # seed 0 scores 0.2 and 0.6 at the two sites, seed 1 0.4 and 0.8: site means 0.4 and 0.6 per seed
    mean = _seed_means({"site-1": [0.2, 0.4], "site-2": [0.6, 0.8]})
    assert abs(mean["mean"] - 0.5) < 1e-12 and abs(mean["std"] - 0.02**0.5) < 1e-12 and mean["n"] == 2
    # a site without seed 1: no mean, not a wrong one
    assert _seed_means({"site-1": [0.2, 0.4], "site-2": [0.6]}) is None


def test_paired_difference_is_the_mean_of_per_seed_per_site_differences_with_a_t_interval():
    # differences 0.1, 0.2 (site-1, seeds 0 and 1) and 0.3, 0.2 (site-2): mean 0.2, sd 0.0816, t(3) = 3.182
    d = paired_difference({"site-1": [0.6, 0.7], "site-2": [0.8, 0.6]}, {"site-1": [0.5, 0.5], "site-2": [0.5, 0.4]})
    half = 3.1824 * (0.02 / 3) ** 0.5 / 2  # t(0.975, 3 df)
    assert d["n"] == 4 and abs(d["mean"] - 0.2) < 1e-12
    assert abs(d["lo"] - (0.2 - half)) < 1e-4 and abs(d["hi"] - (0.2 + half)) < 1e-4 and d["verdict"] == "better"
    tie = paired_difference({"s": [0.5, 0.7]}, {"s": [0.6, 0.6]})  # -0.1 and +0.1: the interval holds 0
    assert tie["verdict"] == "tie" and abs(tie["mean"]) < 1e-12
    assert paired_difference({"s": [0.5]}, {"s": [0.4]}) is None  # one pair: no interval
    # t lacks a seed
    assert paired_difference({"s": [0.5, 0.6], "t": [0.1]}, {"s": [0.4, 0.5], "t": [0.2, 0.3]})["n"] == 2


def test_tables():
    stat = {"mean": 0.5, "std": 0.1, "n": 2}
    diff = {"mean": 0.02, "lo": 0.01, "hi": 0.03, "n": 4, "verdict": "better"}
    report = {"seeds": [0, 1], "rounds": 3, "inside_sites": ["site-1"], "holdout": ["site-2"], "timings": [],
              "inside": {"FedAvg": {"site-1": stat}, "Local": {"site-1": stat}},
              "inside_mean": {"FedAvg": {"mean": 0.5, "std": 0.02, "n": 2}},
              "inside_backbone": {"FedAvg": "unet", "Local": "unet"}, "inside_vs_fedavg": {"Local": diff},
              "inside_cases": {"site-1": {"cases": 5, "images": 40}},
              "outside": {"FedAvg [batch]": {"site-2": stat}, "IOP-FL routing [batch]": {"site-2": stat}},
              "outside_vs_fedavg": {
                  "IOP-FL routing [batch]": {**diff, "verdict": "tie", "reference": "FedAvg [batch]"}},
              "claims": [{"method": "IOP-FL", "label": "IOP-FL routing", "against": ["FedAvg"], "treatment": "batch",
                          "differences": {"FedAvg": {**diff, "verdict": "tie"}}}]}
    md = to_markdown(report)
    assert "| method | site-1 (5 cases, 40 img) | mean |" in md
    assert "| Local | 0.500 ± 0.100 | **-** | +0.020 [+0.010, +0.030] **+** | FedAvg |" in md
    assert "**Normalisation: test-batch statistics**" in md and "running statistics" not in md.split("Outside")[1]
    assert "| IOP-FL routing | 0.500 ± 0.100 | **-** | +0.020 [+0.010, +0.030] | FedAvg |" in md
    assert "the claim does not hold on this run" in md
    report["claims"][0]["differences"]["FedAvg"] = None  # one seed at one outside site: no interval
    report["inside"]["Local"]["site-1"] = {"mean": 0.5, "std": 0.0, "n": 1}
    md = to_markdown(report)
    assert "the claim cannot be judged: fewer than 2 (seed, site) pairs" in md
    assert "| Local | 0.500 | **-** |" in md  # one seed: no "± 0.000"
    route = {"route": {"site-3": {"methods": {"global": {"dice": 0.25}, "routing": {"dice": None}},
                                  "seconds_per_sample": 0.5}}}
    assert any(line.startswith("| site-3 |") for line in route_table(route).splitlines())


def fake_simulator(calls):
    """run_simulator's stand-in: records the run as the real one does (run.json from the exported job), writes a
    results.json, starts nothing."""
    import json
    from pathlib import Path

    from pflseg.deploy.workspace import record_run

    def run_simulator(job_dir, workspace, n_sites=3, threads=None, data=None, progress=print, clients=None,
                      inputs=None):
        job = Path(job_dir).name
        calls.append(job)
        record_run(Path(workspace), Path(job_dir), data, clients, inputs)
        server = Path(workspace) / "state" / "server" / job
        server.mkdir(parents=True, exist_ok=True)
        (server / "results.json").write_text(json.dumps({"run": len(calls)}))
        return {"run": len(calls)}

    return run_simulator


def test_a_finished_run_is_read_back_only_with_the_same_settings(tmp_path, monkeypatch):
    from pflseg.eval import bench as bench_module

    calls, said = [], []
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator(calls))
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)

    def bench(**kw):
        return Bench(tmp_path / "ws", data=root, methods=["local"], seeds=[0], holdout=["site-4"], rounds=1,
                     progress=said.append, **kw)

    first = bench()
    assert not first.finished(0, "inside", "local")
    assert first.run(0, "inside", "local") == {"run": 1}
    assert bench().finished(0, "inside", "local") and bench().run(0, "inside", "local") == {"run": 1}  # read back
    assert calls == ["local"] and not said
    changed = bench(overrides={"train": {"lr": 0.01}})  # pflseg bench --set train.lr=0.01
    assert not changed.finished(0, "inside", "local")
    assert changed.run(0, "inside", "local") == {"run": 2} and calls == ["local", "local"]
    assert "not the earlier run (train.lr: 0.001 -> 0.01)" in said[-1]
    (aside,) = [p for p in (tmp_path / "ws" / "runs" / "seed0" / "inside").iterdir() if p.name.startswith("local.")]
    assert f"kept in {aside}" in said[-1] and (aside / "state" / "server" / "local" / "results.json").is_file()
    assert changed.finished(0, "inside", "local") and not bench().finished(0, "inside", "local")
    longer = Bench(tmp_path / "ws", data=root, methods=["local"], seeds=[0], holdout=["site-4"], rounds=2,
                   overrides={"train": {"lr": 0.01}}, progress=said.append)  # --rounds 2
    longer.run(0, "inside", "local")
    assert "(rounds: 1 -> 2)" in said[-1] and len(calls) == 3


def test_a_post_training_run_is_read_back_only_with_the_same_training_run(tmp_path, monkeypatch):
    import json

    from pflseg.eval import bench as bench_module

    calls, said = [], []
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator(calls))
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedsm"], seeds=[0], holdout=["site-4"], rounds=1,
                  outside=False, progress=said.append)
    for seed, fold, job in bench.plan():
        bench.run(seed, fold, job)
    assert calls == ["fedsm", "fedsm_infer"] and bench.finished(0, "inside", "fedsm_infer")
    record = bench.run_dir(0, "inside", "fedsm") / "run.json"  # the training run was made again, otherwise
    record.write_text(json.dumps({**json.loads(record.read_text()), "sha256": "another"}))
    assert not bench.finished(0, "inside", "fedsm_infer")
    bench.run(0, "inside", "fedsm_infer")
    assert calls[-1] == "fedsm_infer" and "inputs.bundle_run:" in said[-1]


def test_one_seed_writes_no_spread_in_the_csv():
    """Before: bench_*.csv wrote dice_std 0.0000 with one seed, a spread nobody measured."""
    from pflseg.eval.bench import _csv_std

    assert _csv_std({"mean": 0.5, "std": 0.0, "n": 1}) == ""
    assert _csv_std({"mean": 0.5, "std": 0.1, "n": 3}) == "0.1000"


def test_the_verdict_follows_the_interval_over_seeds_not_the_seed_x_site_pairs():
    """5 sites share their seed's model: the differences move together within a seed (+0.10, -0.02, +0.04). As 15
    independent pairs the interval excludes 0; over 3 seed means (t quantile 4.30) it does not."""
    offsets = [0.10, -0.02, 0.04]
    values = {f"s{i}": [0.5 + o + 0.001 * i for o in offsets] for i in range(5)}
    reference = {f"s{i}": [0.5, 0.5, 0.5] for i in range(5)}
    d = paired_difference(values, reference)
    assert d["lo"] > 0 and d["n"] == 15  # the pairs' interval alone would say "better"
    assert d["seeds"]["n"] == 3 and d["seeds"]["lo"] < 0 < d["seeds"]["hi"] and d["verdict"] == "tie"
    one_seed = paired_difference({k: v[:1] for k, v in values.items()}, {k: v[:1] for k, v in reference.items()})
    assert "seeds" not in one_seed and one_seed["verdict"] == "better"


def test_an_option_is_chosen_at_the_other_held_out_inside_sites_never_at_the_judged_one():
    from pflseg.eval.bench import choose_by_loso

    per_site = {"site-1": {"gamma=0.0": 0.5, "gamma=0.9": 0.7},  # held out from the federation of site-2, site-3
                "site-2": {"gamma=0.0": 0.6, "gamma=0.9": 0.7},
                "site-6": {"gamma=0.0": 0.9, "gamma=0.9": 0.1}}  # the judged outside site: its values never count
    inside = ["site-1", "site-2", "site-3"]
    assert choose_by_loso(per_site, "site-6", inside) == "gamma=0.9"
    assert choose_by_loso(per_site, "site-1", inside) == "gamma=0.9"  # from site-2 alone
    per_site["site-6"] = {"gamma=0.0": 0.0, "gamma=0.9": 1.0}
    assert choose_by_loso(per_site, "site-6", inside) == "gamma=0.9"
    per_site["site-1"] = {"gamma=0.0": 0.25, "gamma=0.9": 0.5}
    per_site["site-2"] = {"gamma=0.0": 0.75, "gamma=0.9": 0.5}  # a tie at the mean keeps the earlier option
    assert choose_by_loso(per_site, "site-6", inside) == "gamma=0.0"
    assert choose_by_loso({"site-6": {"a": 1.0}}, "site-6", inside) is None  # no held-out inside site: no choice


def test_fedsm_s_outside_claim_reads_the_super_model_at_every_gamma_at_zero_and_its_global_model():
    from pflseg.flare.methods import METHODS

    infer = {"n_cases": 3, "n_images": 24, "global": {"dice": 0.4},
             "super": {"0.0": {"dice": 0.3}, "0.9": {"dice": 0.5}, "1.0": {"dice": 0.4}}}
    results = {"infer": {"site-6": infer}, "gamma_selected": 0.0}
    cols = {c.label: c for c in METHODS["fedsm"].outside["fedsm"]}
    claim = METHODS["fedsm"].claims[0]
    assert {claim.label, *claim.against} <= set(cols)
    options = cols[claim.label].read(results, "site-6")
    assert {k: v.dice for k, v in options.items()} == {"gamma=0.0": 0.3, "gamma=0.9": 0.5, "gamma=1.0": 0.4}
    assert [cols[a].read(results, "site-6").dice for a in claim.against] == [0.3, 0.4]
    assert cols["FedSM super"].read(results, "site-6") == (0.3, None, 3, 24)


def test_runs_side_by_side_run_each_job_once_a_post_training_run_after_its_training_run(tmp_path, monkeypatch):
    import threading
    import time

    from pflseg.eval import bench as bench_module

    calls, running, overlap = [], set(), []
    lock = threading.Lock()
    record = fake_simulator(calls)

    def slow(job_dir, workspace, **kw):  # each run takes a moment: two of them overlap with jobs=2
        with lock:
            running.add(str(workspace))
            overlap.append(len(running))
        time.sleep(0.3)
        with lock:
            out = record(job_dir, workspace, **kw)
            running.discard(str(workspace))
        return out

    monkeypatch.setattr(bench_module, "run_simulator", slow)
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedsm", "local"], seeds=[0, 1], holdout=["site-4"], rounds=1,
                  outside=False, progress=lambda m: None, jobs=2)
    monkeypatch.setattr(bench, "tables", lambda: None)
    bench.execute()
    plan = bench.plan()
    assert sorted(calls) == sorted(job for _, _, job in plan) and max(overlap) == 2
    # the timings keep the plan's order, whatever finished first
    assert [(t["seed"], t["fold"], t["job"]) for t in bench.timings] == plan
    for seed in (0, 1):  # each post-training run started after the run it reads had finished
        assert bench.results(seed, "inside", "fedsm")["run"] < bench.results(seed, "inside", "fedsm_infer")["run"]
    assert all((bench.run_dir(*key) / "results").is_dir() for key in plan)  # what pflseg run writes, per run


def test_a_run_whose_one_site_trains_on_every_sites_data_starts_first(tmp_path, monkeypatch):
    """Centralized's training is one process (its pooling site); started last, it ran alone on one of the two
    cores at the end of a bench seed. It now starts first, the other runs filling the second core beside it."""
    from pflseg.eval import bench as bench_module

    calls = []
    monkeypatch.setattr(bench_module, "run_simulator", fake_simulator(calls))
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["local", "fedsm", "centralized"], seeds=[0], holdout=["site-4"],
                  rounds=1, outside=False, progress=lambda m: None, jobs=1)
    monkeypatch.setattr(bench, "tables", lambda: None)
    bench.execute()
    plan = ["local", "fedsm", "fedsm_infer", "centralized", "centralized_lcnet"]  # the registry's order
    assert [j for _, _, j in bench.plan()] == plan
    assert calls == ["centralized", "centralized_lcnet", "local", "fedsm", "fedsm_infer"]
    assert bench_module.pools("centralized_lcnet") and not bench_module.pools("fedavg")


def test_the_inside_table_reads_a_post_training_run_through_its_column(tmp_path, monkeypatch):
    """FedSM's super model comes from the inference job's results, which have no per-site "test" metrics; the
    inference job also reached the outside site, which the inside table leaves out."""
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["fedsm"], seeds=[0], holdout=["site-4"], rounds=1,
                  outside=False, progress=lambda m: None)
    infer = {s: {"n_cases": 2, "n_images": 4, "global": {"dice": 0.1}, "super": {"0.0": {"dice": d}}}
             for s, d in (("site-1", 0.5), ("site-2", 0.6), ("site-3", 0.7), ("site-4", 0.2))}
    runs = {"fedsm": {"test": {s: {"site": {"dice": 0.4}} for s in ("site-1", "site-2", "site-3")}},
            "fedsm_infer": {"infer": infer, "gamma_selected": 0.0}}
    monkeypatch.setattr(bench, "results", lambda seed, fold, job: runs[job])
    monkeypatch.setattr(bench, "names", lambda seed, fold, job: {s: s for s in (runs[job].get("test") or infer)})
    table = bench.inside_values()
    assert table["FedSM super"] == {"site-1": [0.5], "site-2": [0.6], "site-3": [0.7]}
    assert table["FedSM personalized"] == {"site-1": [0.4], "site-2": [0.4], "site-3": [0.4]}


def test_iopfl_s_static_comparators_offer_both_statistics_for_a_choice_without_the_judged_site_s_labels():
    from pflseg.eval.bench import choose_by_loso
    from pflseg.flare.methods import METHODS, TREATMENTS

    cols = {c.label: c for c in METHODS["iopfl"].outside["iopfl"] if c.group == "loso"}
    assert set(cols) == {"FedAvg", "Average", "Ensemble"} and "loso" in TREATMENTS
    methods = {"global": {"dice": 0.5}, "global_bn": {"dice": 0.6}, "average": {"dice": 0.4},
               "average_bn": {"dice": 0.3}, "ensemble": {"dice": 0.2}, "ensemble_bn": {"dice": 0.1}}
    results = {"route": {"site-2": {"methods": methods, "n_cases": 2, "n_images": 16}}}
    assert {k: v.dice for k, v in cols["FedAvg"].read(results, "site-2").items()} == {"running": 0.5, "batch": 0.6}
    assert {k: v.dice for k, v in cols["Average"].read(results, "site-2").items()} == {"running": 0.4, "batch": 0.3}
    per_site = {"site-1": {"running": 0.8, "batch": 0.6}, "site-2": {"running": 0.5, "batch": 0.6},
                "site-6": {"running": 0.1, "batch": 0.9}}
    # site-6 judged: 0.65 vs 0.60 at sites 1-2 (site-6's own values never count)
    assert choose_by_loso(per_site, "site-6", ["site-1", "site-2"]) == "running"
    assert choose_by_loso(per_site, "site-1", ["site-1", "site-2"]) == "batch"  # from site-2 alone


def fake_route(start: float, dices: dict, adaptation: dict, movement: dict, experts: list | None = None,
               prior=None) -> dict:
    """One outside site's routing results (``results["route"][site]``, ``pflseg.infer.routing.route_site``):
    ``adaptation``: variant -> (start_loss, final_loss, start_foreground, foreground)."""
    diag = {"adaptation": {v: {"lr": 0.01, "steps": 10, "start_loss": a[0], "final_loss": a[1],
                               "start_foreground": a[2], "foreground": a[3]} for v, a in adaptation.items()},
            "settings": {"prior": prior} if prior else {}}
    if experts:
        diag["experts"] = {"names": ["P_1", "P_2", "P_3", "w_g"], "dice": [0.1] * 4, "dice_bn": experts}
    return {"methods": {"average_bn": {"dice": start}, **{m: {"dice": d} for m, d in dices.items()}},
            "coefficients": {v: {"movement_mean": m} for v, m in movement.items()}, "diagnostics": diag}


def test_routing_diagnostics_at_the_judged_outside_sites_rows_summary_and_section(tmp_path, monkeypatch):
    """Two routed folds (site-3, site-4; site-2's routing run has not finished): one row per routing variant with
    its loss change, Dice change against Average (test-batch BN; routing: its final model, or in older results its
    per-sample one), router movement and foreground change; the best and worst expert per site; Spearman over the
    rows, the counts; bench.json and bench.md carry them."""
    import json

    from pflseg.eval import bench as bench_module

    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    bench = Bench(tmp_path / "ws", data=root, methods=["iopfl"], seeds=[0], holdout=["site-2", "site-3", "site-4"],
                  rounds=1, progress=lambda m: None)
    site3 = fake_route(0.50, {"routing": 0.55, "routing_final": 0.60, "routing_global": 0.45, "routing_layer": 0.48},
                       {"routing": (1.0, 0.8, 0.10, 0.12), "routing_global": (1.0, 1.1, 0.10, 0.08),
                        "routing_layer": (1.0, 0.95, 0.10, 0.10)},
                       {"routing": 0.05, "routing_global": 0.01, "routing_layer": 0.02}, [0.4, 0.7, 0.3, 0.5], [0.1])
    site4 = fake_route(0.40, {"routing": 0.58, "routing_global": 0.30, "routing_layer": 0.41},  # no routing_final
                       {"routing": (2.0, 1.7, 0.2, 0.1), "routing_global": (2.0, 2.2, 0.2, 0.3),
                        "routing_layer": (2.0, 1.99, 0.2, 0.2)},
                       {"routing": 0.03, "routing_global": None})  # routing_layer: no movement_mean
    runs = {"without-site-3": {"route": {"flare-3": site3}}, "without-site-4": {"route": {"flare-4": site4}}}
    monkeypatch.setattr(bench, "finished", lambda seed, fold, job: job == "iopfl_route" and fold in runs)
    monkeypatch.setattr(bench, "results", lambda seed, fold, job: runs[fold])
    monkeypatch.setattr(bench, "names", lambda seed, fold, job: {"site-1": "site-1", f"flare-{fold[-1]}": fold[-6:]})
    rows = bench.routing_rows()
    assert [(r["site"], r["variant"]) for r in rows] == [(s, v) for s in ("site-3", "site-4")
                                                         for v in ("routing", "routing_global", "routing_layer")]
    changes = [(r["loss_change"], r["dice_change"]) for r in rows]
    expected = [(-0.2, 0.1), (0.1, -0.05), (-0.05, -0.02), (-0.3, 0.18), (0.2, -0.1), (-0.01, 0.01)]
    assert all(abs(a - x) < 1e-9 and abs(b - y) < 1e-9 for (a, b), (x, y) in zip(changes, expected))
    assert [r["movement"] for r in rows] == [0.05, 0.01, 0.02, 0.03, None, None]
    assert [round(r["foreground_change"], 6) for r in rows] == [0.2, -0.2, 0.0, -0.5, 0.5, 0.0]
    assert rows[0]["best_expert"] == {"name": "P_2", "dice": 0.7} and rows[2]["worst_expert"] == {"name": "P_3",
                                                                                                   "dice": 0.3}
    assert rows[3]["best_expert"] is None and rows[0]["prior"] == [0.1] and rows[3]["prior"] is None
    for name in ("inside_values", "inside_cases", "curves", "steps"):  # the other tables: empty here
        monkeypatch.setattr(bench, name, lambda: {})
    monkeypatch.setattr(bench, "outside_values", lambda: ({}, {}))
    monkeypatch.setattr(bench_module, "plot", lambda report, out: None)
    bench.ws.mkdir(parents=True)  # made by the runs otherwise
    report = bench.tables()
    summary = report["routing_diagnostics"]["summary"]
    # ranks of the loss change 2 5 3 1 6 4 against the Dice change's 5 2 3 6 1 4: sum d^2 = 68
    assert abs(summary["spearman"] - (1 - 6 * 68 / (6 * 35))) < 1e-9 and summary["spearman"] < 0
    assert {k: summary[k] for k in ("rows", "pairs", "loss_fell", "dice_rose", "both")} == {
        "rows": 6, "pairs": 6, "loss_fell": 4, "dice_rose": 3, "both": 3}
    assert json.loads((bench.ws / "bench.json").read_text())["routing_diagnostics"]["summary"] == summary
    md = (bench.ws / "bench.md").read_text()
    assert "diagnostics (scoring only: the judged sites' labels score these numbers, never choose anything)" in md
    assert "Loss fell in 4 of 6 rows, Dice rose in 3, both in 3; Spearman rank correlation of Δ loss and Δ Dice: " \
           "-0.943 over 6 rows with both" in md
    assert "| 0 | site-3 | IOP-FL routing | -0.20000 | +0.1000 | 0.0500 | +20.0 % | 0.1000 | P_2 0.7000 | " \
           "P_3 0.3000 |" in md
    assert "| 0 | site-4 | IOP-FL routing (per layer, ours) | -0.01000 | +0.0100 | - | +0.0 % | - | - | - |" in md
    three = [r for r in rows if r["variant"] == "routing"] + rows[1:2]
    assert routing_summary(three[:2])["spearman"] is None  # fewer than 3 rows
    assert routing_summary([{**r, "loss_change": -0.1} for r in three])["spearman"] is None  # a constant column


def test_no_routing_diagnostics_without_a_routing_run(tmp_path):
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    assert Bench(tmp_path / "ws", data=root, methods=["fedavg"], seeds=[0], holdout=["site-4"]).routing_rows() == []
    # IOP-FL selected, but its routing run has not run yet
    assert Bench(tmp_path / "ws", data=root, methods=["iopfl"], seeds=[0], holdout=["site-4"]).routing_rows() == []
    report = {"seeds": [0], "rounds": 1, "inside_sites": ["site-1"], "holdout": ["site-2"], "timings": [],
              "inside": {"FedAvg": {"site-1": {"mean": 0.5, "std": 0.0, "n": 1}}},
              "outside": {"FedAvg [batch]": {"site-2": {"mean": 0.5, "std": 0.0, "n": 1}}}}
    assert "scoring only" not in to_markdown(report) and "Spearman" not in to_markdown(report)
