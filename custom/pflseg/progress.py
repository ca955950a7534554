"""How far a long piece of work is, said every few seconds with an ETA, in one line format everywhere.

    progress = Progress("site-4 routing: rate trials", total=3 * 40, unit="steps")
    for ...:
        ...
        progress.step()         # at most every 10 s: "progress: site-4 routing: rate trials 52/120 steps (43 %),
                                #  21 s, ETA 28 s"
    progress.done()             # "progress: site-4 routing: rate trials done, 120 steps in 49 s" (only when a
                                #  line was said before: short work stays silent)

Lines go to ``say`` (default: the ``pflseg.progress`` logger at INFO, i.e. FLARE's log at a site) and start with
``PREFIX``: ``pflseg run`` relays every such line of the simulator's log to the terminal
(``pflseg.deploy.simulator``), so site-side work (data synthesis, FedSM inference, test-time routing) is seen while
it runs. A command on this machine passes ``say=print``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

#: every progress line starts with this (what the simulator runner relays)
PREFIX = "progress: "
#: seconds between two lines of one piece of work (``Progress``'s default)
EVERY = 10.0

log = logging.getLogger("pflseg.progress")


def duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """Counts the steps of one piece of work and says how far it is, with an ETA from the rate so far.

    Args:
        what: The work in words, e.g. ``"synthetic data: site-2"``.
        total: Steps in all (None or 0: unknown, no ETA).
        unit: What a step is, e.g. ``"cases"``.
        say: Where lines go (default: ``log.info``).
        every: Seconds between lines (default ``EVERY``; the first one after ``every`` seconds too: short work says
            nothing).
        clock: Seconds (default ``time.monotonic``; replaceable in tests).
    """

    def __init__(self, what: str, total: int | None = None, unit: str = "steps",
                 say: Callable[[str], object] | None = None, every: float | None = None,
                 clock: Callable[[], float] | None = None):
        self.what, self.total, self.unit = what, total or None, unit
        self.every = EVERY if every is None else every
        self.clock = clock or time.monotonic
        self.say = say or log.info
        self.count, self.t0 = 0, self.clock()
        self._last = self.t0
        self.said = False

    def eta_seconds(self) -> float | None:
        """Seconds left at the rate so far; None before the first step or without a total."""
        if not self.total or not self.count:
            return None
        return (self.clock() - self.t0) / self.count * max(self.total - self.count, 0)

    def line(self) -> str:
        """The line for now: ``progress: <what> <count>/<total> <unit> (<pct> %), <elapsed>, ETA <left>``."""
        elapsed = duration(self.clock() - self.t0)
        if self.total:
            eta = self.eta_seconds()
            return (f"{PREFIX}{self.what} {self.count}/{self.total} {self.unit} ({100 * self.count / self.total:.0f} "
                    f"%), {elapsed}" + (f", ETA {duration(eta)}" if eta is not None else ""))
        return f"{PREFIX}{self.what} {self.count} {self.unit}, {elapsed}"

    def step(self, n: int = 1) -> None:
        """``n`` more steps done; a line when ``every`` seconds have passed since the last (or the start)."""
        self.count += n
        now = self.clock()
        if now - self._last >= self.every:
            self._last = now
            self.said = True
            self.say(self.line())

    def done(self) -> None:
        """The work is done: a closing line, only when a line was said before."""
        if self.said:
            self.say(f"{PREFIX}{self.what} done, {self.count} {self.unit} in {duration(self.clock() - self.t0)}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.done()
