"""Run-level progress of a protocol that runs several jobs: ``[3/7] fedsm ... ETA 4 min``."""

from __future__ import annotations

import time


class RunProgress:
    """Counts jobs and prints a line as each one starts, with an ETA from the mean time of the jobs run so far
    (a job read back from an earlier invocation counts as done but not in the mean).

    Args:
        total: Jobs the protocol runs.
        progress: Where lines go (``print``).
        clock: Seconds (``time.monotonic``; replaceable in tests).

    Example::

        steps = RunProgress(7)
        steps.start("fedavg")   # [1/7] fedavg ...
        ...                     # run it
        steps.done()
        steps.start("fedbn")    # [2/7] fedbn ... ETA 6 min
    """

    def __init__(self, total: int, progress=print, clock=time.monotonic):
        self.total, self.progress, self.clock = total, progress, clock
        self.durations: list[float] = []
        self.finished = 0
        self._t0: float | None = None

    def eta_seconds(self) -> float | None:
        """Time left for the jobs not yet done (the one running included), None before the first is run."""
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        return mean * (self.total - self.finished)

    def start(self, name: str) -> float:
        """Prints the job's line; returns its start time (for ``done`` when jobs run side by side)."""
        self._t0 = t0 = self.clock()
        eta = self.eta_seconds()
        line = f"[{self.finished + 1}/{self.total}] {name} ..."
        if eta is not None:
            line += f" ETA {_minutes(eta)}"
        self.progress(line)
        return t0

    def done(self, timed: bool = True, t0: float | None = None) -> float:
        """Marks the running job done (the one started at ``t0``; default: the last started); returns its seconds.
        ``timed=False``: it was read back, not run, and stays out of the ETA's mean."""
        seconds = self.clock() - (self._t0 if t0 is None else t0)
        self.finished += 1
        if timed:
            self.durations.append(seconds)
        return seconds


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"
