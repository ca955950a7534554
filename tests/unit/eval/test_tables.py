from pflseg.flare.controllers.fedsm import infer_table


def test_infer_table_lists_every_site_and_gamma():
    site = lambda inside, d: {"inside": inside, "global": {"dice": d},
                              "personalized": {"dice": d + 0.1} if inside else None,
                              "super": {"0.9": {"dice": d + 0.2}, "1.0": {"dice": d}}}
    text = infer_table({"infer": {"site-1": site(True, 0.5), "site-3": site(False, 0.25)}, "gamma_selected": 0.9,
                        "inside_sites": ["site-1"]})
    lines = text.splitlines()
    assert lines[0] == "| site | global | personalized | super, gamma=0.9 (chosen) | super, gamma=1.0 |"
    assert lines[2] == "| site-1 | 0.5000 | 0.6000 | 0.7000 | 0.5000 |"
    assert lines[3] == "| site-3 (outside) | 0.2500 | - | 0.4500 | 0.2500 |"
    assert "gamma chosen on the inside sites' validation: 0.9" in lines
    assert "inside sites (trained): site-1; outside sites (never trained): site-3" in lines
    assert any("the selector's confidence is above gamma" in line for line in lines)


def test_the_routing_variants_have_one_name_in_every_table():
    """Before: "IOP-FL (Global)" and "Routing per-layer (ours)" in the bench, `routing_global` / `routing_layer`
    in `pflseg run`'s table, "IOP-FL routing" in the demo."""
    from pflseg.eval.bench import CLAIMS
    from pflseg.eval.demo import OUTSIDE
    from pflseg.flare.controllers.iopfl import route_table
    from pflseg.flare.methods import METHODS
    from pflseg.infer.routing import LABELS

    bench = {col.key: col.label for rows in METHODS["iopfl"].outside.values() for col in rows
             if col.key.startswith("routing")}
    demo = {row.key: row.label for row in OUTSIDE if row.key.startswith("routing")}
    assert bench == LABELS and demo == {"routing": LABELS["routing"]}
    assert LABELS["routing"] in {claim.label for _, claim in CLAIMS}
    methods = {m: {"dice": 0.5} for m in LABELS}
    text = route_table({"route": {"site-4": {"methods": methods, "seconds_per_sample": 0.1}}})
    head = next(line for line in text.splitlines() if line.startswith("| outside site |"))
    assert all(f" {label} |" in head for label in LABELS.values()) and "routing_layer" not in head


def test_metric_columns_carry_hd95_beside_assd():
    from pflseg.eval.tables import METRIC_COLUMNS, metric_rows, metric_table

    assert METRIC_COLUMNS.index("hd95") == METRIC_COLUMNS.index("assd") + 1
    m = {"dice": 0.5, "dice_per_class": [0.5], "iou": 0.25, "assd": 1.25, "hd95": 3.0, "n_cases": 2}
    rows = metric_rows({"method": "fedavg", "test": {"site-1": {"global": m}}})
    assert rows[0]["hd95"] == 3.0 and rows[0]["assd"] == 1.25
    assert metric_table(rows).splitlines()[2] == "| site-1 | global | yes | 0.5 | 0.5000 | 0.25 | 1.25 | 3.0 | 2 |  |"


def test_the_routing_table_has_labels_a_legend_and_names_the_outside_site():
    """Before: raw keys (global_bn, average_bn, tent_epochs) beside labels, no legend, the outside site unnamed."""
    from pflseg.flare.controllers.iopfl import route_table

    methods = {m: {"dice": 0.5} for m in ("global", "global_bn", "average_bn", "tent_epochs", "routing")}
    text = route_table({"route": {"site-4": {"methods": methods, "seconds_per_sample": 0.1}},
                        "inside_sites": ["site-1", "site-2"]})
    head = next(line for line in text.splitlines() if line.startswith("| outside site |"))
    assert not {"global_bn", "average_bn", "tent_epochs"} & {c.strip() for c in head.split("|")}
    assert "Global, test-batch BN" in head and "Tent, routing's budget" in head
    assert text.startswith("Test Dice at the outside site(s) site-4 (never trained")
    assert "experts: P_k of the inside sites site-1, site-2 and the global model w_g" in text
    assert "- Global: the global model w_g as trained (FedAvg's) [training's running statistics]" in text


def test_the_routing_table_shows_what_the_adaptation_did_and_each_experts_dice():
    """Issue 38: the routers' movement, the foreground against the size prior and each expert's Dice at the outside
    site, read from results.json; before: only the final Dice."""
    from pflseg.flare.controllers.iopfl import route_table

    adapt = {"lr": 0.01, "steps": 200, "start_loss": 1.5, "final_loss": 1.25, "start_foreground": 0.05,
             "foreground": 0.0625}
    route = {"methods": {"routing": {"dice": 0.5}}, "seconds_per_sample": 0.1,
             "coefficients": {"routing": {"movement_mean": 0.125}},
             "diagnostics": {"adaptation": {"routing": adapt}, "settings": {"prior": [0.04]},
                             "experts": {"names": ["P_1", "w_g"], "dice": [0.25, 0.5], "dice_bn": [0.375, 0.625]}}}
    lines = route_table({"route": {"site-4": route}}).splitlines()
    row = next(line for line in lines if line.startswith("| site-4 | ") and "0.01" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:] == ["0.01", "200", "1.5 -> 1.25", "0.0500 -> 0.0625", "0.0400", "0.1250"]
    assert "- site-4: P_1 0.2500 / 0.3750, w_g 0.5000 / 0.6250" in lines
    assert not any("Routing diagnostics" in line for line in route_table(
        {"route": {"site-4": {"methods": {"routing": {"dice": 0.5}}, "seconds_per_sample": 0.1}}}).splitlines())


def test_timing_summary_without_a_footprint_and_with_one_round():
    """Before: "peak memory nan GiB" (job.py) and round 1's start-up reported as FLARE overhead."""
    from pflseg.eval.tables import timing_summary

    h = lambda r, wall: {"round": r, "wall_seconds": wall, "site_compute_seconds": {"a": 1.0}}  # noqa: E731
    one = timing_summary({"job": "fedavg", "sites": ["a"], "history": [h(1, 12.0)]})
    assert "peak memory not measured" in one and "nan" not in one and "FLARE overhead" not in one
    assert "measured from round 2 on" in one
    three = timing_summary({"job": "fedavg", "sites": ["a"], "history": [h(1, 12.0), h(2, 1.5), h(3, 2.5)],
                            "footprint": {"wall_seconds": 20.0, "peak_rss_gib": 1.25}})
    assert "wall 20.0 s, peak memory 1.25 GiB" in three
    assert "rounds 2-3: 2.00 s each = 1.00 s site work" in three and "+ 1.00 s FLARE overhead" in three


def test_a_tiny_runs_low_dice_is_said_to_be_expected():
    from pflseg.eval.tables import run_tables

    h = {"round": 1, "wall_seconds": 2.0, "site_compute_seconds": {"a": 1.0}}
    res = {"job": "fedavg", "method": "fedavg", "sites": ["a"], "history": [h], "missing": {},
           "test": {"a": {"global": {"dice": 0.04}}}, "config": {"rounds": 1, "data": {"size": 32}}}
    lines = run_tables(res, "fedavg")
    assert lines[-1].startswith("note: mean test Dice 0.04 is what these tiny settings give (1 round(s), 32 px)")
    res["config"] = {"rounds": 20, "data": {"size": 128}}
    assert not run_tables(res, "fedavg")[-1].startswith("note:")


def test_every_test_row_names_the_round_of_its_model_from_1():
    """Before: selected_round blank on global rows (and 0 for IOP-FL's P_k trained in round 1)."""
    from pflseg.eval.tables import METRIC_LEGEND, metric_rows, metric_table

    m = {"dice": 0.5}
    rows = metric_rows({"method": "fedavg", "best_global_round": 2,
                        "test": {"a": {"global": m, "global_adabn": m, "site": {**m, "selected_round": 1}}}})
    assert [r["selected_round"] for r in rows] == [2, 2, 1]
    assert metric_table(rows).endswith(METRIC_LEGEND) and "0 = the initial model" in METRIC_LEGEND


def test_a_run_s_table_shows_every_model_its_method_names_and_leaves_out_what_no_site_scored():
    from pflseg.eval.tables import dice_table

    def score(d):
        return {"dice": d, "n_cases": 2}
    res = {"method": "fedavg", "test": {"a": {"global": score(0.5), "global_adabn": score(0.7)},
                                        "b": {"global": score(0.3)}}}
    assert dice_table({"fedavg": res}).splitlines() == [
        "| site | FedAvg | FedAvg + AdaBN |", "|---|---|---|", "| a | 0.5000 | 0.7000 |", "| b | 0.3000 | - |",
        "| mean | 0.4000 | 0.7000 |"]
    del res["test"]["a"]["global_adabn"]
    assert dice_table({"fedavg": res}).splitlines()[0] == "| site | FedAvg |"


def test_a_number_cell_has_its_decimals_its_sign_when_asked_and_a_dash_when_missing():
    from pflseg.markdown import number_cell

    assert number_cell(0.12345) == "0.12" and number_cell(2.5, 0) == "2"
    assert number_cell(0.0123, 3, signed=True) == "+0.012" and number_cell(-0.5, 1, signed=True) == "-0.5"
    assert number_cell(None) == number_cell(None, 4, signed=True) == "-"
