from pflseg.eval.tables import infer_table


def test_infer_table_lists_every_site_and_gamma():
    site = lambda inside, d: {"inside": inside, "global": {"dice": d},
                              "personalized": {"dice": d + 0.1} if inside else None,
                              "super": {"0.9": {"dice": d + 0.2}, "1.0": {"dice": d}}}
    text = infer_table({"infer": {"site-1": site(True, 0.5), "site-3": site(False, 0.25)}})
    lines = text.splitlines()
    assert lines[0] == "| site | global | personalized | super 0.9 | super 1.0 |"
    assert lines[2] == "| site-1 | 0.5000 | 0.6000 | 0.7000 | 0.5000 |"
    assert lines[3] == "| site-3 (outside) | 0.2500 | - | 0.4500 | 0.2500 |"


def test_the_routing_variants_have_one_name_in_every_table():
    """Before: "IOP-FL (Global)" and "Routing per-layer (ours)" in the bench, `routing_global` / `routing_layer`
    in `pflseg run`'s table, "IOP-FL routing" in the demo."""
    from pflseg.eval.bench import PRIMARY
    from pflseg.eval.demo import OUTSIDE
    from pflseg.eval.tables import route_table
    from pflseg.flare.methods import METHODS
    from pflseg.infer.routing import LABELS

    bench = {source.split(":", 1)[1]: label for rows in METHODS["iopfl"].outside.values()
             for label, _, source, _ in rows if source.startswith("route:routing")}
    demo = {method: label for label, _, method, _ in OUTSIDE if method.startswith("routing")}
    assert bench == LABELS and demo == {"routing": LABELS["routing"]} and PRIMARY[0] == LABELS["routing"]
    methods = {m: {"dice": 0.5} for m in LABELS}
    head = route_table({"route": {"site-4": {"methods": methods, "seconds_per_sample": 0.1}}}).splitlines()[0]
    assert all(f" {label} |" in head for label in LABELS.values()) and "routing_layer" not in head


def test_metric_columns_carry_hd95_beside_assd():
    from pflseg.eval.tables import METRIC_COLUMNS, metric_rows, metric_table

    assert METRIC_COLUMNS.index("hd95") == METRIC_COLUMNS.index("assd") + 1
    m = {"dice": 0.5, "dice_per_class": [0.5], "iou": 0.25, "assd": 1.25, "hd95": 3.0, "n_cases": 2}
    rows = metric_rows({"method": "fedavg", "test": {"site-1": {"global": m}}})
    assert rows[0]["hd95"] == 3.0 and rows[0]["assd"] == 1.25
    assert metric_table(rows).splitlines()[2] == "| site-1 | global | yes | 0.5 | 0.5000 | 0.25 | 1.25 | 3.0 | 2 |  |"
