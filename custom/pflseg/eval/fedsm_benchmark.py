"""``pflseg report fedsm-benchmark``: the FedSM benchmark (``pflseg.flare.controllers.fedsm_benchmark``, beside the
method's server side) run in FLARE's simulator, one progress line per job.

    pflseg report fedsm-benchmark --workspace runs/fedsm_bench --rounds 20 --seeds 0 1
"""

from __future__ import annotations

from pathlib import Path

from pflseg.deploy.simulator import run_simulator
from pflseg.deploy.workspace import server_state
from pflseg.eval.progress import RunProgress
from pflseg.flare.controllers import fedsm_benchmark as benchmark


def run(workspace: str | Path, rounds: int = 20, seeds=(0, 1), progress=print) -> dict:
    """``benchmark.run`` in ``workspace`` with each job run by ``run_simulator``; its report."""
    steps = RunProgress(benchmark.run_count(seeds), progress)

    def simulate(label: str, job: Path, run_dir: Path, n_sites: int, data: Path) -> dict:
        steps.start(label)
        results = run_simulator(job, run_dir, n_sites=n_sites, data=data, progress=progress)
        steps.done()
        return results

    return benchmark.run(workspace, simulate, server_state, rounds, seeds)


def report(workspace: str | Path | None = None, rounds: int | None = None, seeds=(0, 1), **_) -> str:
    """``pflseg report fedsm-benchmark``: ``run`` in ``workspace`` (default ``runs/fedsm_bench``) for ``rounds``
    (default 20) and ``seeds``; its Markdown. Other keywords (the flags of other reports) are ignored."""
    return benchmark.to_markdown(run(workspace or "runs/fedsm_bench", rounds or 20, seeds))
