"""What a run's results.json gives the tables: typed rows read by the method that wrote them.

The bench, the demo and ``pflseg run`` never parse a method's result format; each column of theirs is a ``Column``
of the registry (``pflseg.flare.methods``) whose ``read`` turns one run's results into a ``Score`` at one site (or
into named ``options``, one ``Score`` each, that the bench chooses among by leave-one-inside-site-out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple


class Score(NamedTuple):
    """One model's test scores at one site."""

    dice: float | None
    #: pseudonym -> Dice (or Dice per class) per case, when the run reported it (``privacy.per_case``)
    per_case: Mapping | None = None
    cases: int | None = None
    images: int | None = None


def score(entry: Mapping, n: Mapping | None = None) -> Score:
    """A ``Score`` from a metrics entry (``{"dice", "per_case"?, "n_cases"?, "n_images"?}``); ``n``: where the
    counts are when the entry lacks them."""
    n = n or entry
    return Score(entry.get("dice"), entry.get("per_case"), n.get("n_cases"), n.get("n_images"))


#: results.json, FLARE site name -> the column's Score there, or {option: Score} for the bench to choose among
Reader = Callable[[Mapping, str], "Score | dict[str, Score]"]


class Column(NamedTuple):
    """One column of the bench's / demo's tables."""

    label: str
    job: str
    #: the site's test-metrics key (``results["test"][site][key]``: "global", "site", "global_adabn"); for a column
    #: with a ``read`` only a name
    key: str
    #: inside: the backbone ("unet", "lcnet"); outside: the normalisation treatment ("running", "batch")
    group: str
    #: None: the site's test metrics under ``key`` (inside); the run's best global model scored at the site by the
    #: bench (outside)
    read: Reader | None = None


def site_test(column: Column, results: Mapping, site: str) -> Score:
    """An inside column's Score at ``site``: its reader's, else the site's test metrics under ``column.key``."""
    if column.read is not None:
        out = column.read(results, site)
        if isinstance(out, Score):
            return out
        raise ValueError(f"{column.label}: an inside column gives one score per site, not options {sorted(out)}")
    return score(results["test"][site][column.key])
