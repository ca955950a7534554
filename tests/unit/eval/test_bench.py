from pflseg.data import make_synthetic
from pflseg.eval.bench import Bench, _seed_means, to_markdown
from pflseg.eval.tables import route_table


def test_plan_runs_each_job_once_and_training_before_post_training(tmp_path):
    root = make_synthetic(tmp_path / "root", n_sites=4, cases=3, size=16, depth=2)
    one = Bench(tmp_path / "ws", data=root, methods=["fedavg", "fedsm", "iopfl"], seeds=[0], holdout=["site-4"])
    assert one.inside == ["site-1", "site-2", "site-3"]
    plan = [job for _, fold, job in one.plan()]
    assert plan == ["fedavg", "fedsm", "fedsm_infer", "iopfl", "iopfl_route"]  # the inside runs serve the outside table
    assert {fold for _, fold, _ in one.plan()} == {"inside"}
    assert one.clients("inside", "iopfl_route") == ["site-1", "site-2", "site-3", "site-4"]
    every = Bench(tmp_path / "ws2", data=root, methods=["iopfl"], seeds=[0, 1], holdout=["all"])
    folds = {(s, f) for s, f, j in every.plan() if j == "iopfl_route"}
    assert folds == {(s, f"without-site-{i}") for s in (0, 1) for i in range(1, 5)}
    assert every.trained_on("without-site-2") == ["site-1", "site-3", "site-4"]


def test_the_mean_row_spreads_over_seeds_not_over_sites():
    # seed 0 scores 0.2 and 0.6 at the two sites, seed 1 0.4 and 0.8: site means 0.4 and 0.6 per seed
    mean = _seed_means({"site-1": [0.2, 0.4], "site-2": [0.6, 0.8]})
    assert abs(mean["mean"] - 0.5) < 1e-12 and abs(mean["std"] - 0.02**0.5) < 1e-12 and mean["n"] == 2
    assert _seed_means({"site-1": [0.2, 0.4], "site-2": [0.6]}) is None  # a site without seed 1: no mean, not a wrong one


def test_tables():
    stat = {"mean": 0.5, "std": 0.1, "n": 2}
    report = {"seeds": [0, 1], "rounds": 3, "inside_sites": ["site-1"], "holdout": ["site-2"], "timings": [],
              "inside": {"FedAvg": {"site-1": stat}}, "inside_mean": {"FedAvg": {"mean": 0.5, "std": 0.02, "n": 2}},
              "outside": {"FedAvg": {"site-2": stat}, "IOP-FL routing": {"site-2": stat}}}
    md = to_markdown(report)
    assert "| site-2 | 0.5000 ± 0.1000 | 0.5000 ± 0.1000 |" in md and "| **mean** | **0.5000 ± 0.0200** |" in md
    route = {"route": {"site-3": {"methods": {"global": {"dice": 0.25}, "routing": {"dice": None}}, "seconds_per_sample": 0.5}}}
    assert route_table(route).splitlines()[-1].startswith("| site-3 |")
