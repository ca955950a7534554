"""The key format of pflseg's messages: several networks in one flat dict, each key prefixed by its part.

A message's ``FLModel.params`` (and a server checkpoint, which bundles hand to post-training jobs) is one flat
``{key: tensor}``; the prefix names whose network a key belongs to, ``<prefix>.<network key>``, or, for one network
per site, ``<prefix>.<site>.<network key>`` (``by_site`` / ``split_by_site``). ``prefixed`` / ``unprefixed`` (the
same helpers the state on disk uses) add and strip a prefix. Every module spells a prefix through these names, never
as a string of its own (a test scans the package for one). The prefixes:

=============  ========================================================================================
``global``     the global model (to every site; its update back)
``person``     a personalized model: FedSM's own one per site (``person.*``), every site's in a bundle or a
               super model (``person.<site>.*``)
``select``     FedSM's model selector; ``moment``: its Adam moments (batch steps); ``grad``: its gradients
               summed over a site's images (epoch steps); ``stats``: a site's LDA feature statistics
``familiar``   FedSM inference: the LDA Gaussians of the familiarity fallback
``head``       LC-Fed: a site's own coarse head (site -> server); ``heads.<site>.*``: the other sites' heads
``site``       a site's own model that it hands out (IOP-FL's P_k, cross-site evaluation)
=============  ========================================================================================

Server checkpoints add ``best`` (the best global model), ``bestperson.<site>`` (each site's best personalized
model), ``bestselect`` (the best selector) and ``ldastats.<site>`` (each site's latest LDA statistics).
"""

from __future__ import annotations

from pflseg.flare.state import prefixed, unprefixed

GLOBAL = "global"
PERSON = "person"
SELECT = "select"
MOMENT = "moment"
GRAD = "grad"
STATS = "stats"
FAMILIAR = "familiar"
HEAD = "head"
HEADS = "heads"
SITE = "site"
# server checkpoints only
BEST = "best"
BEST_PERSON = "bestperson"
BEST_SELECT = "bestselect"
LDA_STATS = "ldastats"

__all__ = ["prefixed", "unprefixed", "by_site", "split_by_site", "sites_in", "only", "model_prefix", "GLOBAL",
           "PERSON", "SELECT", "MOMENT", "GRAD", "STATS", "FAMILIAR", "HEAD", "HEADS", "SITE", "BEST", "BEST_PERSON",
           "BEST_SELECT", "LDA_STATS"]


def by_site(prefix: str, states: dict[str, dict]) -> dict:
    """``{site: {key: tensor}}`` -> one flat dict ``{"<prefix>.<site>.<key>": tensor}``, sites in the given order."""
    return {k: v for site, state in states.items() for k, v in prefixed(f"{prefix}.{site}", state).items()}


def split_by_site(prefix: str, flat: dict, sites) -> dict[str, dict]:
    """The inverse of ``by_site`` for ``sites`` (in that order): ``{site: {key: tensor}}``, an empty dict for a site
    with no keys in ``flat``."""
    return {site: unprefixed(f"{prefix}.{site}", flat) for site in sites}


def sites_in(prefix: str, flat: dict) -> list[str]:
    """The sites named by ``<prefix>.<site>.*`` keys of ``flat``, sorted."""
    head = prefix + "."
    return sorted({k[len(head):].split(".")[0] for k in flat if k.startswith(head)})


def only(flat: dict, *prefixes: str) -> dict:
    """The entries of ``flat`` under any of ``prefixes`` (kept prefixed, in their order)."""
    heads = tuple(p + "." for p in prefixes)
    return {k: v for k, v in flat.items() if k.startswith(heads)}


def model_prefix(model: str) -> str:
    """The prefix of a model as a post-training job names it (cross-site evaluation): ``global`` (the global model)
    or a site's name (that site's personalized model, ``person.<site>``)."""
    return GLOBAL if model == GLOBAL else f"{PERSON}.{model}"
