"""A run's results folder: validation curves from results.json history, the per-site test table, the overlays' list."""

import csv
import importlib.util

import pytest

from pflseg.eval.plots import PLOTS_HINT, have_matplotlib, mean_curve, plot_lines, val_curves, write_results
from pflseg.eval.tables import metric_rows, metric_table

MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _metrics(dice, **extra):
    return {"dice": dice, "dice_per_class": [dice], "iou": dice / 2, "assd": 1.5, "n_cases": 2, **extra}


RESULTS = {
    "job": "fedavg", "method": "fedavg", "missing": {},
    "history": [{"round": 1, "val_dice": {"site-2": 0.5, "Hospital_A": 0.25}},
                {"round": 2, "val_dice": {"site-2": 0.75, "Hospital_A": 0.5}},
                {"round": 3, "val_dice": {"site-2": 1.0}}],  # Hospital_A left out of round 3
    "test": {"site-2": {"global": _metrics(0.5), "site": _metrics(0.25, selected_round=1)},
             "Hospital_A": {"global": _metrics(0.75), "site": _metrics(0.5, selected_round=0)}},
}


def test_curves_per_site_and_mean_from_the_history():
    assert val_curves(RESULTS) == {"Hospital_A": [(1, 0.25), (2, 0.5)], "site-2": [(1, 0.5), (2, 0.75), (3, 1.0)]}
    assert mean_curve(RESULTS) == [(1, 0.375), (2, 0.625), (3, 1.0)]
    assert val_curves({"history": []}) == {}


def test_metric_rows_mark_the_model_the_tables_report():
    rows = metric_rows(RESULTS)
    assert [(r["site"], r["model"], r["reported"], r["dice"]) for r in rows] == [
        ("Hospital_A", "global", "yes", 0.75), ("Hospital_A", "site", "", 0.5),
        ("site-2", "global", "yes", 0.5), ("site-2", "site", "", 0.25)]
    personal = metric_rows({**RESULTS, "method": "fedbn"})
    assert [r["reported"] for r in personal] == ["", "yes", "", "yes"]
    assert metric_table(rows).splitlines()[2] == "| Hospital_A | global | yes | 0.75 | 0.7500 | 0.375 | 1.5 |  | 2 |  |"


@pytest.mark.parametrize("plots", [pytest.param(True, marks=pytest.mark.skipif(not MATPLOTLIB, reason="no matplotlib")),
                                   False])
def test_write_results_tables_overlays_and_plot(tmp_path, monkeypatch, plots):
    monkeypatch.setattr("pflseg.eval.plots.have_matplotlib", lambda: plots)
    overlays = tmp_path / "state" / "Hospital_A" / "fedavg" / "overlays"
    overlays.mkdir(parents=True)
    for name in ("worst-1_a.png", "best-1_b.png"):
        (overlays / name).write_bytes(b"")
    (tmp_path / "state" / "server" / "fedavg" / "overlays").mkdir(parents=True)  # not a site

    lines = write_results(RESULTS, tmp_path)

    out = tmp_path / "results"
    with open(out / "test.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and rows[0]["site"] == "Hospital_A" and rows[0]["assd"] == "1.5"
    assert (out / "test.md").read_text().startswith("| site | model | reported | dice |")
    assert str(overlays / "best-1_b.png") in (out / "overlays.md").read_text()
    assert f"overlays at Hospital_A: {overlays}/ (best-1_b.png, worst-1_a.png)" in lines
    assert (out / "val_dice.png").is_file() == plots and (PLOTS_HINT in lines) != plots  # tables either way
    assert lines[0].startswith("results: ") and str(out / "test.csv") in lines[0]


def test_write_results_of_a_routing_job(tmp_path):
    route = {"job": "iopfl_route", "method": "iopfl_route", "history": [], "missing": {},
             "route": {"site-4": {"methods": {"global": {"dice": 0.5}, "routing": {"dice": 0.625}},
                                  "seconds_per_sample": 0.1}}}
    (tmp_path / "state" / "site-4" / "iopfl_route" / "predictions").mkdir(parents=True)
    lines = write_results(route, tmp_path)
    assert "| site-4 | 0.5000 | 0.6250 | 0.1000 |" in (tmp_path / "results" / "iopfl_route.md").read_text()
    assert f"predictions at site-4: {tmp_path / 'state' / 'site-4' / 'iopfl_route' / 'predictions'}" in lines


@pytest.mark.skipif(not MATPLOTLIB, reason="matplotlib not installed (extra [plots])")
def test_plot_lines_writes_a_png(tmp_path):
    from PIL import Image

    assert have_matplotlib()
    path = plot_lines({"site-1": [(1, 0.2), (2, 0.4)], "mean": [(1, 0.2), (2, 0.4)]}, tmp_path / "a" / "p.png", "t")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (640, 400)


#: an LC-Fed run as the demo saw it: the received body with the site's heads (val_dice) scores near 0 each round, the
#: site's model after local training (val_dice_local: what LC-Fed reports, test Dice 0.76) near 0.76
LCFED = {"job": "lcfed", "method": "lcfed",
         "history": [{"round": r, "val_dice": {"site-1": 0.06}, "site_metrics": {
             "site-1": {"val_dice": 0.06, "val_dice_local": 0.69 + r / 100, "steps": 5}}} for r in (1, 2, 3)]}


def test_a_personalized_methods_curve_is_its_reported_model_not_the_received_one():
    """Before: LC-Fed's curve dipped to 0.06 (the received shared body) while its test Dice was 0.76."""
    from types import SimpleNamespace

    from pflseg.eval.bench import Bench
    from pflseg.eval.plots import reported_val_dice

    assert val_curves(LCFED) == {"site-1": [(1, 0.70), (2, 0.71), (3, 0.72)]}
    assert mean_curve(LCFED) == [(1, 0.70), (2, 0.71), (3, 0.72)]
    bench = SimpleNamespace(results=lambda seed, fold, job: LCFED)  # the demo's and the bench's curves
    assert Bench.curve(bench, 0, "lcfed", "site") == pytest.approx([0.70, 0.71, 0.72])
    assert Bench.curve(bench, 0, "lcfed", "global") == pytest.approx([0.06] * 3)
    fedsm = {"val_dice": {"a": 0.1}, "site_metrics": {"a": {"val_dice_person": 0.9, "val_dice_local": 0.5}}}
    assert reported_val_dice(fedsm, "site") == {"a": 0.9}  # the tracked personalized model first


@pytest.mark.skipif(not MATPLOTLIB, reason="needs matplotlib")
def test_curve_plots_have_integer_round_ticks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt, "close", lambda fig: seen.append(fig))
    plot_lines({"a": [(1, 0.5), (2, 0.6), (3, 0.7)]}, tmp_path / "c.png", "t")
    ticks = [t for t in seen[0].axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)


@pytest.mark.skipif(not MATPLOTLIB, reason="needs matplotlib")
def test_a_one_round_plot_has_one_tick_on_round_1(tmp_path, monkeypatch):
    """Before: val_dice.png of a 1-round run had ticks 0.945 ... 1.050."""
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt, "close", lambda fig: seen.append(fig))
    plot_lines({"a": [(1, 0.5)], "mean": [(1, 0.5)]}, tmp_path / "c.png", "t")
    assert [float(t) for t in seen[0].axes[0].get_xticks()] == [1.0]
