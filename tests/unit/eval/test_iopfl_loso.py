from pflseg.eval.iopfl_loso import to_markdown
from pflseg.eval.tables import route_table


def test_tables():
    stat = {"mean": 0.5, "std": 0.1, "n": 2}
    report = {"seeds": [0, 1], "inside": {"site-1": {"global": stat, "person": stat}},
              "outside": {"site-2": {"global": stat, "routing": stat}, "average": {"global": stat, "routing": stat}}}
    md = to_markdown(report, ["global", "routing"])
    assert "| site-2 | 0.5000 ± 0.1000 | 0.5000 ± 0.1000 |" in md and "| mean | 0.5000 | 0.5000 |" in md
    route = {"route": {"site-3": {"methods": {"global": {"dice": 0.25}, "routing": {"dice": None}}, "seconds_per_sample": 0.5}}}
    assert route_table(route).splitlines()[-1].startswith("| site-3 |")


def test_loso_runs_each_fold_on_the_sites_own_names(tmp_path, monkeypatch):
    """Each fold trains on the other sites (FLARE names) and routes at the held-out one alone; tables use the
    data's names. The simulator is stubbed: it records what it was asked and answers with fixed Dice."""
    import json

    from pflseg.data import make_synthetic
    from pflseg.eval import iopfl_loso

    root = make_synthetic(tmp_path / "root", n_sites=3, cases=3, size=16, depth=2)
    meta = json.loads((root / "dataset.json").read_text())
    names = ["Hospital A", "Clinic_B", "Lab-C"]
    for old, new in zip(meta["sites"], names):
        (root / old).rename(root / new)
    (root / "dataset.json").write_text(json.dumps({**meta, "sites": names}))
    calls = []

    def fake_run(job, ws, threads=None, data=None, progress=None, clients=None):
        calls.append((job.name, list(clients), json.loads((data / "dataset.json").read_text())["sites"]))
        if job.name == "iopfl":
            return {"test": {c: {"global": {"dice": 0.5}, "site": {"dice": 0.75, "selected_round": 1}} for c in clients},
                    "footprint": {"wall_seconds": 1.0}}
        return {"route": {clients[0]: {"methods": {"global": {"dice": 0.25}, "routing": {"dice": 0.5}},
                                       "seconds_per_sample": 0.1, "n_images": 4}}, "footprint": {"wall_seconds": 1.0}}

    monkeypatch.setattr(iopfl_loso, "run_simulator", fake_run)
    report = iopfl_loso.run_loso(tmp_path / "ws", data=root, seeds=[0], progress=lambda m: None)
    view_sites = ["Hospital_A", "Clinic_B", "Lab-C"]
    assert calls == [("iopfl", ["Clinic_B", "Lab-C"], view_sites), ("iopfl_route", ["Hospital_A"], view_sites),
                     ("iopfl", ["Hospital_A", "Lab-C"], view_sites), ("iopfl_route", ["Clinic_B"], view_sites),
                     ("iopfl", ["Hospital_A", "Clinic_B"], view_sites), ("iopfl_route", ["Lab-C"], view_sites)]
    assert list(report["inside"]) == names and report["inside"]["Hospital A"]["person"]["mean"] == 0.75
    assert report["outside"]["Hospital A"]["routing"]["mean"] == 0.5 and "average" in report["outside"]
