"""IOP-FL site: sends w_k, keeps P_k (and the received global model) on disk; routing is another job."""

import torch

from pflseg.algorithms.iopfl import update_person
from tests.unit.flare.sites.conftest import keys_of


def test_sends_the_trained_model_and_keeps_p_k(federation):
    fed = federation("iopfl")
    site = fed.site()
    assert set(site.tasks()) == {"train", "validate", "test", "submit_model"}
    out = site.train(fed.message(0))
    saved = fed.store().load(0)
    local = {k[len("global."):]: v for k, v in out.params.items()}
    assert keys_of(out.params, "global") == set(fed.initial)
    person = {k[len("person."):]: v for k, v in saved.items() if k.startswith("person.")}
    expected = update_person("ema", None, local, fed.initial, None, fed.cfg["iopfl"]["tau"])  # round 0: P = w_k
    assert all(torch.equal(person[k], expected[k]) for k in expected)
    assert keys_of(saved, "globalin") == set(fed.initial) and not any(k.startswith("person.") for k in out.params)


def test_submit_model_sends_the_best_p_k_and_the_training_labels_foreground_fraction(federation):
    """The size prior's input: per class, the fraction of foreground pixels over every training slice of the site."""
    from pflseg.data import site_dataset

    fed = federation("iopfl")
    site = fed.site()
    site.train(fed.message(0))
    out = site.submit_model(fed.message(1))
    labels = torch.stack([torch.as_tensor(x["label"]).float()
                          for x in site_dataset(site.root, site.data_site, "training", size=32)])
    want = labels.transpose(0, 1).flatten(1).mean(1).tolist()
    assert out.meta["fg_fraction"] == want and 0 < want[0] < 1
    assert keys_of(out.params, "site")
