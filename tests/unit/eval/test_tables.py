from pflseg.eval.tables import infer_table


def test_infer_table_lists_every_site_and_gamma():
    site = lambda inside, d: {"inside": inside, "global": {"dice": d}, "personalized": {"dice": d + 0.1} if inside else None,
                              "super": {"0.9": {"dice": d + 0.2}, "1.0": {"dice": d}}}
    text = infer_table({"infer": {"site-1": site(True, 0.5), "site-3": site(False, 0.25)}})
    lines = text.splitlines()
    assert lines[0] == "| site | global | personalized | super 0.9 | super 1.0 |"
    assert lines[2] == "| site-1 | 0.5000 | 0.6000 | 0.7000 | 0.5000 |"
    assert lines[3] == "| site-3 (outside) | 0.2500 | - | 0.4500 | 0.2500 |"
