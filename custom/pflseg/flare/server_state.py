"""``ServerState``: everything a server workflow keeps between rounds, one object per run (DESIGN.md, "The round's
objects"): the global model, per-site models, optimizer moments, the best models and their records, the history.

A controller declares each part once (``RoundController.declare``: ``state.add(name, fresh value, kind, prefix,
guarded)``), and from then on reads and assigns it as an attribute (``state.global_state = new``). How a part is
saved follows from its kind:

- ``NET``: one network, ``{key: tensor}``, saved as ``<prefix>.<key>`` (``pflseg.flare.wire``: ``global``, ``select``);
- ``BY_SITE``: one network per site, ``{site: {key: tensor}}``, saved as ``<prefix>.<site>.<key>`` (``wire.by_site``);
- ``PLAIN``: data (lists, dicts, numbers), saved under its own name, as it is.

``checkpoint()`` is the flat dict of a round file, ``restore(ckpt)`` puts one back (a part the file does not hold
keeps its fresh value, so checkpoints written before a part existed still load). ``snapshot()``, ``first_nonfinite()``
and ``rollback()`` serve the guard (``pflseg.flare.guard.keep_finite``) over the ``guarded`` parts: the ones a
non-finite aggregate must not replace. A name that was not declared cannot be assigned: state kept between rounds
cannot live outside the checkpoint, where a stopped run would lose it on resume.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from pflseg.algorithms.robust import first_nonfinite
from pflseg.flare.wire import by_site, prefixed, split_by_site, unprefixed

NET, BY_SITE, PLAIN = "net", "by_site", "plain"


@dataclass(frozen=True)
class Part:
    """How one part of the state is saved: its ``kind`` (``NET``, ``BY_SITE``, ``PLAIN``), its checkpoint ``key``
    (a prefix, or a PLAIN part's own key) and whether the guard protects it."""

    kind: str
    key: str
    guarded: bool


class ServerState:
    """The parts a controller declared (``add``), read and assigned as attributes; ``sites`` orders the per-site
    parts in a checkpoint."""

    def __init__(self, sites: list[str]):
        object.__setattr__(self, "sites", list(sites))
        object.__setattr__(self, "parts", {})
        object.__setattr__(self, "values", {})

    def add(self, name: str, value, kind: str = PLAIN, key: str | None = None, guarded: bool = False) -> None:
        """Declare part ``name`` with its fresh ``value``, saved by ``kind`` under ``key`` (default ``name``)."""
        if kind not in (NET, BY_SITE, PLAIN):
            raise ValueError(f"server state part {name!r}: kind {kind!r} is not one of {NET}, {BY_SITE}, {PLAIN}")
        if name in self.parts or hasattr(type(self), name) or name in self.__dict__:
            raise ValueError(f"server state part {name!r} is declared twice or shadows a ServerState attribute")
        self.parts[name] = Part(kind, key or name, guarded)
        self.values[name] = value

    def __getattr__(self, name: str):
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"the server state has no part {name!r} (declared: {', '.join(values) or 'none'})")

    def __setattr__(self, name: str, value) -> None:
        if name not in self.parts:
            raise AttributeError(f"the server state has no part {name!r}: declare it in the controller's declare() "
                                 f"with state.add({name!r}, fresh value, kind, prefix), so that it is checkpointed and "
                                 "restored on resume")
        self.values[name] = value

    def checkpoint(self) -> dict:
        """Every part, flat, in the order declared: what a round file holds besides its round number."""
        out: dict = {}
        for name, part in self.parts.items():
            value = self.values[name]
            if part.kind == NET:
                out.update(prefixed(part.key, value))
            elif part.kind == BY_SITE:
                out.update(by_site(part.key, value))
            else:
                out[part.key] = value
        return out

    def restore(self, ckpt: dict) -> None:
        """Every part from a round file ``ckpt``: a network's saved keys over its fresh ones, a site's saved network
        over its fresh one (sites without one keep theirs), a PLAIN part as saved (copied); a part the file does not
        hold keeps its fresh value."""
        for name, part in self.parts.items():
            value = self.values[name]
            if part.kind == NET:
                self.values[name] = {**value, **unprefixed(part.key, ckpt)}
            elif part.kind == BY_SITE:
                saved = split_by_site(part.key, ckpt, self.sites)
                self.values[name] = {**value, **{s: state for s, state in saved.items() if state}}
            elif part.key in ckpt:
                self.values[name] = copy.deepcopy(ckpt[part.key])

    def guarded(self) -> list[str]:
        """The names of the guarded parts."""
        return [name for name, part in self.parts.items() if part.guarded]

    def snapshot(self) -> dict:
        """The guarded parts before a round (dicts copied, tensors shared: aggregation makes new tensors)."""
        return {name: _copy(self.values[name]) for name in self.guarded()}

    def first_nonfinite(self) -> str | None:
        """What is wrong with the first NaN / Inf (or absurd magnitude) in a guarded part, named by part and key."""
        for name in self.guarded():
            reason = first_nonfinite(self.values[name], name)
            if reason:
                return reason
        return None

    def rollback(self, snapshot: dict) -> None:
        """Put the guarded parts back as ``snapshot`` holds them."""
        self.values.update(snapshot)


def _copy(obj):
    return {k: _copy(v) for k, v in obj.items()} if isinstance(obj, dict) else obj
