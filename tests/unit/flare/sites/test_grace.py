"""GRACE site: the meta step trains the model; an adversarial discriminator stays at the site."""

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
