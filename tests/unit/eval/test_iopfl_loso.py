from pflseg.data import load_dataset_info, make_synthetic, site_dataset
from pflseg.eval.iopfl_loso import fold_view, to_markdown
from pflseg.eval.tables import route_table


def test_fold_view_puts_the_held_out_site_last(tmp_path):
    root = make_synthetic(tmp_path / "root", n_sites=3, cases=3, size=16, depth=2)
    mapping = fold_view(root, "site-1", tmp_path / "view")
    assert mapping == {"site-1": "site-2", "site-2": "site-3", "site-3": "site-1"}
    assert load_dataset_info(tmp_path / "view")["sites"] == ["site-1", "site-2", "site-3"]
    a = site_dataset(tmp_path / "view", "site-3", "testing", size=16)
    b = site_dataset(root, "site-1", "testing", size=16)
    assert len(a) == len(b) and (a[0]["image"] == b[0]["image"]).all()


def test_tables():
    stat = {"mean": 0.5, "std": 0.1, "n": 2}
    report = {"seeds": [0, 1], "inside": {"site-1": {"global": stat, "person": stat}},
              "outside": {"site-2": {"global": stat, "routing": stat}, "average": {"global": stat, "routing": stat}}}
    md = to_markdown(report, ["global", "routing"])
    assert "| site-2 | 0.5000 ± 0.1000 | 0.5000 ± 0.1000 |" in md and "| mean | 0.5000 | 0.5000 |" in md
    route = {"route": {"site-3": {"methods": {"global": {"dice": 0.25}, "routing": {"dice": None}}, "seconds_per_sample": 0.5}}}
    assert route_table(route).splitlines()[-1].startswith("| site-3 |")
