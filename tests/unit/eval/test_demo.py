"""The demo's contract: the bench's sites scaled down, enough cases to read, one treatment per outside comparison,
differences paired by case and verdicts written from the numbers."""

import json

import pytest

from pflseg.data import load_dataset_info
from pflseg.eval import demo
from pflseg.eval.bench import CLAIMS
from pflseg.flare.columns import Column
from pflseg.infer.routing import NORM


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """The demo on its own data (made once: the preset renders in a few seconds)."""
    return demo.Demo(tmp_path_factory.mktemp("demo") / "ws", progress=lambda m: None)


def test_the_demo_data_is_the_bench_preset_scaled_down_with_enough_cases_at_every_site(d):
    info = load_dataset_info(d.bench.root(0))
    profiles = info["site_profiles"]
    assert d.inside == ["site-1", "site-2", "site-3"] and d.outside == ["site-4"]
    for site in d.inside:
        assert profiles[site]["split"]["testing"] >= 5 and profiles[site]["slices"]["testing"] >= 40
    assert profiles["site-4"]["kind"] == "outside" and profiles["site-4"]["outside_kind"] == "blend"
    styles = {(profiles[s]["dilate"], profiles[s]["contour"], profiles[s]["include_adjacent"]) for s in d.inside}
    assert len(styles) == 3  # the inside sites label differently
    assert len({profiles[s]["split"]["training"] for s in d.inside}) == 3  # and differ in size


def test_every_outside_comparison_is_made_within_one_normalisation_treatment():
    for row in demo.OUTSIDE:
        assert row.group == NORM.get(row.key, "running"), row.label
    for _, claim in CLAIMS:
        rows = {row.label for row in demo.OUTSIDE if row.group == claim.treatment}
        if claim.label in rows:
            assert set(claim.against) <= rows
    assert any(claim.label in {row.label for row in demo.OUTSIDE} for _, claim in CLAIMS)
    assert "FedAvg" in {row.label for row in demo.OUTSIDE if row.group == "running"}


def _results(ws, per_site_cases):
    """A fake IOP-FL run and a FedBN run whose per-case Dice are given: (FedAvg, FedBN) per case."""
    runs = {}
    for job, idx in (("iopfl", 0), ("fedbn", 1)):
        run = ws / "runs" / "seed0" / "inside" / job
        run.mkdir(parents=True, exist_ok=True)
        (run / "sites.json").write_text(json.dumps({s: s for s in per_site_cases}))
        test = {s: {"global" if idx == 0 else "site": {"per_case": {c: [v[idx]] for c, v in cases.items()}}}
                for s, cases in per_site_cases.items()}
        runs[job] = {"test": test}
    return runs


def test_differences_are_paired_by_case_and_the_sentences_follow_the_intervals(d):
    cases = {"site-1": {f"c{i}": (0.5, 0.6 + 0.01 * i) for i in range(5)},  # FedBN +0.10..+0.14: better
             "site-2": {f"c{i}": (0.7, 0.7 + (0.02 if i % 2 else -0.02)) for i in range(5)}}  # a tie at site-2
    results = _results(d.ws, cases)
    rows = {label: d.per_case(results, Column(label, job, key, "unet"), ["site-1", "site-2"])
            for label, job, key in (("FedAvg", "iopfl", "global"), ("FedBN", "fedbn", "site"))}
    assert rows["FedBN"]["site-1/c4"] == pytest.approx(0.64) and len(rows["FedAvg"]) == 10
    table = demo.summarise(rows, ["site-1", "site-2"])
    fedbn = table["FedBN"]
    assert fedbn["vs_fedavg"]["n"] == 10 and fedbn["vs_fedavg"]["mean"] == pytest.approx((0.6 - 0.02) / 10, abs=1e-9)
    assert fedbn["per_site"]["site-1"]["verdict"] == "better" and fedbn["per_site"]["site-2"]["verdict"] == "tie"
    assert fedbn["sites"]["site-1"] == pytest.approx(0.62)
    text = " ".join(demo.sentences(table, "Inside"))
    verdict = fedbn["vs_fedavg"]["verdict"]
    assert ("better than FedAvg" in text) == (verdict == "better") and "FedBN at site-1" in text
    assert "site-2" not in text.split("Site by site")[1]
    md = demo.markdown(table, ["site-1", "site-2"], {"site-1": 5, "site-2": 5}, {"site-1": 40, "site-2": 40})
    assert md.splitlines()[0].startswith("| method | site-1 (5 cases, 40 img) | site-2 (5 cases, 40 img) | mean |")
    assert "| FedBN | 0.620 | 0.696 | **0.658** | +0.058 [" in md


def test_a_run_without_per_case_dice_is_refused_naming_the_key(d):
    results = _results(d.ws, {"site-1": {"c0": (0.5, 0.6)}})
    del results["fedbn"]["test"]["site-1"]["site"]["per_case"]
    with pytest.raises(ValueError, match="privacy.per_case"):
        d.per_case(results, Column("FedBN", "fedbn", "site", "unet"), ["site-1"])


def test_every_routing_row_of_the_demo_is_scored_by_its_routing_job():
    """The demo's outside rows read methods of the routing job's results: each is routing itself or one of the
    comparators the demo's IOP-FL settings ask for (a row without its method failed the demo at its tables)."""
    from pflseg.flare.methods import METHODS

    asked = set(METHODS["iopfl"].demo_settings["iopfl"]["comparators"]) | {"routing", "routing_final"}
    rows = [row.key for entry in METHODS.values() for row in entry.demo_outside if row.job == "iopfl_route"]
    assert rows and set(rows) <= asked


def test_each_treatment_with_demo_rows_has_its_fedavg_reference_and_the_others_are_left_out():
    """The bench's third treatment (statistics chosen by leave-one-inside-site-out) has no demo rows: the demo's
    tables leave it out (its summary needs the FedAvg row of a treatment, which ended the demo in a KeyError)."""
    from pflseg.eval.demo import OUTSIDE
    from pflseg.flare.methods import TREATMENTS

    groups = {row.group for row in OUTSIDE}
    assert groups < set(TREATMENTS)
    assert all(any(row.label == "FedAvg" and row.group == g for row in OUTSIDE) for g in groups)
