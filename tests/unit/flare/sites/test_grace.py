"""GRACE site: the meta step trains the model; an adversarial discriminator stays at the site."""

import pytest

from tests.unit.flare.sites.conftest import keys_of


def test_adversarial_discriminator_is_kept_and_never_sent(federation):
    fed = federation("grace", grace={"align": "adv"})
    out = fed.site().train(fed.message(0))
    assert keys_of(out.params, "global") == set(fed.initial) and not any(k.startswith("disc.") for k in out.params)
    saved = fed.store().load(0)
    assert keys_of(saved, "disc") and "optim.model" in saved
    assert len(saved["optim.model"]["param_groups"]) == 2  # model and discriminator in one optimizer


def test_personalized_model_is_the_local_model_after_training(federation):
    fed = federation("grace")
    site = fed.site()
    site.train(fed.message(0))
    best = site.best_path
    import torch

    kept = torch.load(best, weights_only=True)
    trained = fed.store().load(0)
    assert all(torch.equal(kept[k], trained[k]) for k in trained if k.startswith("model."))


def test_final_global_model_is_not_the_personalized_one_unless_configured(federation):
    import torch

    from pflseg.flare.state import prefixed

    for candidate in (False, True):
        fed = federation("grace", grace={"final_global_candidate": candidate})
        site = fed.site()
        site.train(fed.message(0))
        kept = torch.load(site.best_path, weights_only=True)
        site.evaluate = lambda model, split="validation", surface=False: {"dice": 1.0}  # the final global scores best
        site.validate(fed.message(2, prefixed("global", fed.initial)))
        now = torch.load(site.best_path, weights_only=True)
        assert (now["round"] == 2) == candidate and (now["round"] == kept["round"]) != candidate


def test_inner_step_size_is_reported(federation):
    fed = federation("grace")
    out = fed.site().train(fed.message(0))
    assert out.metrics["inner_step_norm"] > 0 and out.metrics["outer_step_norm"] > 0


@pytest.mark.parametrize("job, over, reported", [
    ("grace", {"grace": {"beta": 2.0}}, {"task_loss", "align_loss"}),
    ("grace", {"grace": {"beta": 0.0}}, {"task_loss"}),  # L_align is not computed
    ("grace_server", {}, set()),  # no meta step
])
def test_task_and_alignment_losses_are_reported_per_round(federation, job, over, reported):
    fed = federation(job, **over)
    m = fed.site().train(fed.message(0)).metrics
    assert {"task_loss", "align_loss"} & set(m) == reported
    if reported:  # train_loss is the round's mean L_meta = L_task + beta * L_align over the same batches
        beta = fed.cfg["grace"]["beta"]
        assert (m["task_loss"] > 0 and m["task_loss"]
                + beta * m.get("align_loss", 0.0) == pytest.approx(m["train_loss"], rel=1e-6))
