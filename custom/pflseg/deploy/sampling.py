"""Timing and memory sampling: the one place the speed report (``pflseg.eval.speed``) and the simulator runner
(``pflseg.deploy.simulator``) measure a process's time and memory.

``best_seconds`` times functions against each other (interleaved, the minimum of repeats). ``MemorySampler`` samples,
on a thread, the memory of a group of processes: ``tree(pid)`` (a process and all its descendants: the simulator
runner's footprint) or ``named(marker)`` (every process whose command line names a folder, by site: the speed
report's per-site memory).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

GIB = 2**30
#: a way to find the processes to sample: a list of (psutil.Process, label); the label groups them into parts
Finder = Callable[[], list]


def best_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Minimum wall time of each function over ``repeats`` interleaved rounds, after one warm-up call each."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def site_of(cmdline: Sequence[str]) -> str:
    """Whose process a simulator process is: the site after ``--client`` (FLARE's simulator worker), else
    ``server`` (the simulator itself, which runs the server)."""
    args = list(cmdline)
    if "--client" in args and args.index("--client") + 1 < len(args):
        return args[args.index("--client") + 1]
    return "server"


def names(cmdline: Sequence[str], folder: str) -> bool:
    """Whether a command line names ``folder`` or a path under it."""
    return any(a == folder or a.startswith(folder + os.sep) for a in cmdline)


def tree(pid: int, label: str = "all") -> Finder:
    """The process ``pid`` and all its descendants, one part ``label`` (none once it has gone)."""
    def find() -> list:
        import psutil

        try:
            root = psutil.Process(pid)
            return [(p, label) for p in (root, *root.children(recursive=True))]
        except psutil.Error:
            return []
    return find


def named(marker: str | Path) -> Finder:
    """Every process whose command line names ``marker`` (or a path under it), labelled by ``site_of`` of its
    command line, and their descendants, each labelled as its nearest such ancestor."""
    marker = str(marker)

    def find() -> list:
        import psutil

        matched: dict[int, tuple] = {}
        for proc in psutil.process_iter(["cmdline"]):
            args = proc.info.get("cmdline") or []
            if names(args, marker):
                matched[proc.pid] = (proc, site_of(args))
        found = dict(matched)

        def inherit(proc, label: str) -> None:  # a descendant that names no site counts for its nearest named ancestor
            try:
                children = proc.children()
            except psutil.Error:
                return
            for child in children:
                if child.pid not in matched:
                    found[child.pid] = (child, label)
                    inherit(child, label)

        for proc, label in matched.values():
            inherit(proc, label)
        return list(found.values())
    return find


class MemorySampler(threading.Thread):
    """Samples, every ``period`` s, the memory of the processes ``find`` returns, in all and by part (the label
    ``find`` gives each). ``peak()``: the peak of the sum, and of each part (for ``named``: the simulator and each
    site process). Use it as a context manager, or ``start()`` and ``stop()``.

    With ``pss`` the memory is the proportional set size (PSS, Linux; RSS where the system has none): a page shared
    by n processes (torch's and MONAI's libraries, mapped by every site) counts 1/n in each, so the sum is what the
    machine holds. The sum of RSS, which counts a shared page once per process, is kept too (``total_rss``,
    ``peak_total_rss_gib``). Without ``pss`` only RSS is read (cheaper: no page map walk); ``total`` is then the RSS
    sum as well."""

    def __init__(self, find: Finder, period: float = 0.5, pss: bool = True):
        super().__init__(daemon=True)
        self.find, self.period, self.pss = find, period, pss
        self.total, self.total_rss, self.samples = 0, 0, 0
        self.parts: dict[str, int] = {}
        self._stop_event = threading.Event()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def run(self):
        while not self._stop_event.wait(self.period):
            self.sample()

    def read(self) -> tuple[dict[str, int], int]:
        """Now: (bytes per part, the RSS sum), ``{}`` when no process is found."""
        import psutil

        parts: dict[str, int] = {}
        rss = 0
        for proc, label in self.find():
            try:
                mem = proc.memory_full_info() if self.pss else proc.memory_info()
            except psutil.Error:
                continue
            parts[label] = parts.get(label, 0) + getattr(mem, "pss", mem.rss)
            rss += mem.rss
        return parts, rss

    def sample(self) -> None:
        parts, rss = self.read()
        if parts:
            self.samples += 1
            self.total, self.total_rss = max(self.total, sum(parts.values())), max(self.total_rss, rss)
            for label, part in parts.items():
                self.parts[label] = max(self.parts.get(label, 0), part)

    def peak(self) -> dict:
        sites = {k: v / GIB for k, v in sorted(self.parts.items()) if k != "server"}
        return {"peak_total_gib": self.total / GIB, "peak_total_rss_gib": self.total_rss / GIB,
                "peak_server_gib": self.parts.get("server", 0) / GIB,
                "peak_site_gib": sites, "peak_site_max_gib": max(sites.values(), default=0.0),
                "samples": self.samples}
