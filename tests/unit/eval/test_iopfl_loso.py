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
