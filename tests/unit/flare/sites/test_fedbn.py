"""FedBN and Local sites: what stays at the site."""

import pytest
import torch

from pflseg.algorithms.fedbn import norm_keys
from pflseg.flare.state import prefixed
from pflseg.nets import build_net
from tests.unit.flare.sites.conftest import keys_of


def test_fedbn_keeps_its_norm_layers_and_uses_them_next_round(federation):
    fed = federation("fedbn", net={"norm": "batch"})
    norm = set(norm_keys(build_net(fed.cfg["net"])))
    assert norm
    site = fed.site()
    out = site.train(fed.message(0))
    assert keys_of(out.params, "global") == set(fed.initial) - norm  # norm layers never leave the site
    own = {k[len("model."):]: v for k, v in fed.store().load(0).items() if k.startswith("model.")}
    model = site.model_for_round(prefixed("global", fed.initial), site.previous(1))
    for k in norm:  # next round: the site's own norm layers, the received rest
        assert torch.equal(model.state_dict()[k], own[k])


def test_local_sends_nothing_and_needs_its_previous_round(federation):
    fed = federation("local")
    site = fed.site()
    assert site.train(fed.message(0)).params == {}
    assert site.train(fed.message(1, {})).params == {}
    resumed = federation("local", resume=True)  # a resumed job needs the site's state (a fresh one joins late)
    with pytest.raises(RuntimeError, match="no state before round 3"):
        resumed.site("site-2").train(resumed.message(3, {}))
