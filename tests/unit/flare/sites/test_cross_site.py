"""Cross-site evaluation, the site's side: its own model of the trained run scored at home and handed out only
when its policy allows; every model it is sent scored with the one evaluation path, metrics only."""

import torch

from pflseg.flare.client import answer
from pflseg.flare.state import load_file, prefixed, unprefixed
from pflseg.train.evaluate import evaluate


def trained_site(federation):
    """A FedBN site after one round: its own best model in its state folder of job fedbn."""
    fed = federation("fedbn")
    site = fed.site()
    site.train(fed.message(0))
    return fed, site


def test_own_model_is_published_by_default_and_scored_like_the_final_test(federation):
    trained, site = trained_site(federation)
    fed = federation("cross_site")
    out, xs = answer("site-1", "own_model", fed.message(0, {}, trained_job="fedbn", bundle=""), None)
    assert out.meta["published"] == 1 and not out.meta.get("pflseg_error")
    best = load_file(site.best_path)
    assert all(torch.equal(v, best[f"model.{k}"]) for k, v in unprefixed("site", out.params).items())
    site.net.load_state_dict(unprefixed("model", best))
    assert abs(out.metrics["own"]["dice"] - evaluate(site.net, site.data("testing"), site.device)["dice"]) < 1e-6
    assert "per_case" not in out.metrics["own"]


def test_a_site_that_keeps_its_model_sends_its_scores_only(federation, tmp_path, monkeypatch):
    trained_site(federation)
    config = tmp_path / "pflseg_site.json"
    config.write_text('{"policy": {"publish": false}}')
    monkeypatch.setenv("PFLSEG_SITE_CONFIG", str(config))
    fed = federation("cross_site")
    out, _ = answer("site-1", "own_model", fed.message(0, {}, trained_job="fedbn", bundle=""), None)
    assert not out.params and out.meta["published"] == 0 and "policy.publish: false" in out.meta["why"]
    assert 0 <= out.metrics["own"]["dice"] <= 1


def test_every_model_sent_is_scored(federation):
    fed = federation("cross_site")
    params = {**prefixed("global", fed.initial), **prefixed("person.site-2", fed.initial)}
    out, _ = answer("site-1", "cross_site", fed.message(0, params, models=["global", "site-2"]), None)
    scores = out.metrics["scores"]
    assert sorted(scores) == ["global", "site-2"] and scores["global"] == scores["site-2"]  # the same weights
    assert scores["global"]["n_cases"] >= 1 and "per_case" not in scores["global"]


def test_no_own_model_is_an_error_reply(federation):
    fed = federation("cross_site")
    out, _ = answer("site-1", "own_model", fed.message(0, {}, trained_job="fedbn", bundle=""), None)
    assert "no own model of job fedbn" in out.meta["pflseg_error"]
