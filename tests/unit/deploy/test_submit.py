"""The admin's per-site table (pflseg.deploy.submit.metrics_table): what one site sent cannot break it."""

from pflseg.deploy.submit import metrics_table


def test_a_sites_malformed_metrics_are_named_and_the_rest_is_shown():
    """Before: one site's non-numeric Dice (or a test entry that is no dict) raised in the admin's table."""
    res = {"job": "fedbn", "method": "fedbn", "rounds": 3, "sites": ["site-1", "site-2", "site-3"], "job_id": "abc",
           "history": [{"val_dice": {"site-1": 0.5, "site-2": "0.7; rm -rf /", "site-3": 0.25}}], "missing": {},
           "test": {"site-1": {"global": {"dice": 0.4}, "site": {"dice": 0.61}, "data_source": "site data"},
                    "site-2": {"global": {"dice": 7.0}, "site": "oops", "data_source": "synthetic"},
                    "site-3": ["not", "a", "dict"]}}
    table = metrics_table(res)
    assert "| site-1 | site data | 0.4000 | 0.6100 | 0.5000 |" in table
    assert "| site-2 | synthetic | ? | ? | ? |" in table and "| site-3 | - | - | - | 0.2500 |" in table
    assert "malformed: site site-2: test.global.dice is 7.0, not a Dice in [0, 1]" in table
    assert "malformed: site site-2: test.site is 'oops', not a dict" in table
    assert "malformed: site site-2: history[-1].val_dice is '0.7; rm -rf /', not a Dice in [0, 1]" in table
    assert "malformed: site site-3: test is ['not', 'a', 'dict'], not a dict of its models' metrics" in table


def test_a_table_without_sites_or_history_still_renders():
    table = metrics_table({"job": "x", "method": "fedavg", "rounds": 1, "test": {"site-1": {"site": {"dice": 0.5}}}})
    assert "| site-1 | - | - | 0.5000 | - |" in table and "malformed: results: 'sites' is None" in table
