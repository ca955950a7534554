"""FLARE's per-round floor, measured: a job whose sites do no work (``pflseg report speed`` runs it beside each job).

The server (``FloorController``) sends every site a model of ``parameters`` float32 values for ``rounds`` rounds and
waits for the answers the way FLARE's own controllers wait (``send_model_and_wait``: a task is done at FLARE's next
task check); each round's wall time goes into ``results.json`` with a ``history`` in the shape of pflseg's jobs
(``{"round", "wall_seconds", "site_compute_seconds": {site: 0.0}}``, rounds from 1), written where pflseg's
controllers write theirs: the server's state folder ``$PFLSEG_STATE_DIR/server/<job>`` when that is set (the
simulator runs of ``pflseg.deploy.simulator.run_simulator``) and FLARE's run folder (what a POC / deployed job's
download holds: ``pflseg.deploy.submit``). A site sends the model back unchanged, with one of pflseg's two site
executor kinds (``site.executor``):

- ``executor``: ``FloorExecutor``, a plain FLARE ``Executor`` answering inside ``execute()``;
- ``client_api``: ``FloorClientAPIExecutor``, FLARE's in-process Client API executor running this very file as its
  script (``echo``: receive, send back).

``export_floor_job`` writes it as a package-mode job folder (no ``app/custom``): its three classes are on pflseg's
class allow lists (``pflseg.flare.allowlist.FLOOR_CLASSES``). Its round wall is then FLARE's cost of one round with
that executor kind, message size, sites and machine: the floor under a pflseg job's fixed cost per round.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.app_opt.pt.decomposers import TensorDecomposer
from nvflare.client.config import ExchangeFormat
from nvflare.fuel.utils import fobs

#: the site executor kinds the floor job has (``pflseg.flare.jobs.site_executor``'s)
KINDS = ("executor", "client_api")
#: about the UNet of pflseg's default jobs (205,878 parameters: fedavg, grace)
DEFAULT_PARAMETERS = 200_000
#: the Client API script of ``FloorClientAPIExecutor``: this file
SCRIPT = Path(__file__).resolve()


class FloorController(ModelController):
    """``rounds`` rounds of sending every site ``parameters`` float32 values and waiting for them back; each round's
    wall into ``results.json`` (``history``) in the server's state folder ``job`` and FLARE's run folder.

    Args:
        job: the job's name (its state folder under ``$PFLSEG_STATE_DIR/server``).
        rounds: rounds to run.
        parameters: float32 values of the model sent (and sent back) each round.
        task_check_period: FLARE's task check (seconds), as pflseg's controllers set it.
    """

    def __init__(self, job: str = "flare_floor", rounds: int = 5, parameters: int = DEFAULT_PARAMETERS,
                 task_check_period: float = 0.2):
        super().__init__(persistor_id="", task_check_period=task_check_period)
        self.job, self.rounds, self.parameters, self.task_check_period = job, rounds, parameters, task_check_period

    def run(self) -> None:
        fobs.register(TensorDecomposer)  # torch tensors on the wire, as in pflseg's jobs
        sites = sorted(self.sample_clients())
        params = {"w": torch.randn(int(self.parameters), generator=torch.Generator().manual_seed(0))}
        history = []
        for r in range(self.rounds):
            t0 = time.perf_counter()
            replies = self.send_model_and_wait(task_name="train", targets=sites,
                                               data=FLModel(params=params, current_round=r, total_rounds=self.rounds))
            wall = time.perf_counter() - t0
            answered = sorted(str(m.meta.get("client_name")) for m in replies)
            history.append({"round": r + 1, "wall_seconds": wall, "site_compute_seconds": dict.fromkeys(answered, 0.0)})
            self.info(f"floor round {r + 1}/{self.rounds}: {wall:.3f} s, {len(answered)}/{len(sites)} sites")
            if self.abort_signal is not None and self.abort_signal.triggered:
                return
        self.write_results({"job": self.job, "sites": sites, "rounds": self.rounds, "parameters": self.parameters,
                            "history": history})

    def write_results(self, results: dict) -> None:
        """``results.json`` into the server's state folder (with ``$PFLSEG_STATE_DIR`` only) and FLARE's run folder."""
        from pflseg.flare.state import state_dir, write_text

        folders = [Path(self.get_run_dir())]
        if os.environ.get("PFLSEG_STATE_DIR"):
            folders.insert(0, state_dir("server", self.job))
        for folder in folders:
            write_text(folder / "results.json", json.dumps(results, indent=1))


def echo_reply(received: FLModel) -> FLModel:
    """A site's answer: the model it received, unchanged, weighted 1."""
    return FLModel(params=received.params, meta={FLMetaKey.NUM_STEPS_CURRENT_ROUND: 1})


class FloorExecutor(Executor):
    """The ``executor`` kind's site: the received model sent back inside ``execute()``, no work."""

    def __init__(self):
        super().__init__()
        fobs.register(TensorDecomposer)

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        return FLModelUtils.to_shareable(echo_reply(FLModelUtils.from_shareable(shareable)))


class FloorClientAPIExecutor(ClientAPIExecutor):
    """The ``client_api`` kind's site: FLARE's in-process Client API executor running ``echo`` (this file as its
    script), torch tensors end to end (``pflseg.flare.executor.ClientAPISiteExecutor``'s settings)."""

    def __init__(self):
        super().__init__(execution_mode="in_process", task_script_path=str(SCRIPT),
                         params_exchange_format=ExchangeFormat.PYTORCH, server_expected_format=ExchangeFormat.PYTORCH)


def echo() -> None:
    """The Client API script: every model received is sent back unchanged."""
    import nvflare.client as flare

    flare.init()
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        flare.send(echo_reply(received))


def export_floor_job(out_dir: str | Path, name: str, kind: str = "executor", sites: int = 2, rounds: int = 5,
                     parameters: int = DEFAULT_PARAMETERS) -> Path:
    """Write the floor job ``<out_dir>/<name>/`` (package mode: no custom code) for ``sites`` sites with site executor
    ``kind`` (``KINDS``); return its folder."""
    import shutil

    from nvflare.job_config.api import FedJob

    from pflseg.flare.jobs import TASK_REQUEST_INTERVAL

    if kind not in KINDS:
        raise ValueError(f"floor job: site executor kind {kind!r}: expected one of {', '.join(KINDS)}")
    out_dir = Path(out_dir).resolve()
    job = FedJob(name=name, min_clients=sites)
    job.to_server(FloorController(job=name, rounds=rounds, parameters=parameters), id="controller")
    job.to_server({"server": {"task_request_interval": TASK_REQUEST_INTERVAL}})
    job.to_clients(FloorExecutor() if kind == "executor" else FloorClientAPIExecutor(), tasks=["*"])
    job.set_app_packages(["pflseg"])
    shutil.rmtree(out_dir / name, ignore_errors=True)
    job.export_job(str(out_dir))
    return out_dir / name


if __name__ == "__main__":  # run by FloorClientAPIExecutor at a site
    echo()
