"""The message key format (``pflseg.flare.wire``): one flat dict, a prefix per network, one per site."""

import torch

from pflseg.flare.wire import PERSON, by_site, only, prefixed, sites_in, split_by_site, unprefixed


def test_by_site_and_split_by_site_are_inverse_and_keep_the_order():
    states = {"site-2": {"w": torch.ones(2), "b": torch.zeros(1)}, "site-1": {"w": torch.zeros(2)}}
    flat = by_site(PERSON, states)
    assert list(flat) == ["person.site-2.w", "person.site-2.b", "person.site-1.w"]
    back = split_by_site(PERSON, flat, ["site-1", "site-2", "site-3"])
    assert list(back) == ["site-1", "site-2", "site-3"] and back["site-3"] == {}  # a site without keys: empty
    assert all(torch.equal(back[s][k], v) for s, state in states.items() for k, v in state.items())
    assert sites_in(PERSON, {**flat, "personx.site-9.w": 1, "global.w": 2}) == ["site-1", "site-2"]


def test_only_keeps_the_named_parts_and_prefixed_round_trips():
    flat = {**prefixed("global", {"w": 1}), **prefixed("select", {"w": 2}), "person.site-1.w": 3, "persons.w": 4}
    assert only(flat, "global", PERSON) == {"global.w": 1, "person.site-1.w": 3}
    assert unprefixed("select", flat) == {"w": 2}
