"""The site executor of every pflseg job: a plain FLARE ``Executor`` that answers each task inside ``execute()``.

    execute(task, shareable): FLModel <- shareable; reply, site = client.answer(...); metrics -> analytics events;
                              shareable <- reply   (a failure of these last two: the exit's error reply instead)

``SiteExecutor`` runs the same site entry point as the Client API script (``pflseg.flare.client.answer``: the
site's policy, the method's site class, the site's one exit ``pflseg.flare.outbox.leave``) without FLARE's
Client API machinery around it. That machinery costs a fixed amount every round, whatever the site computes: the
in-process Client API looks for the script's result every 0.5 s (docs/running.md, "Site executor"; the fixed cost
per round measured both ways: docs/speed.md). Here the reply is ready the
moment the site has computed it.

What the Client API script gives, this executor gives too: the site object lives between tasks (its state is on
disk anyway: results do not depend on it), the site claims its state folder for the FLARE job's id, numeric
metrics go to FLARE's analytics events under the names the script's ``SummaryWriter`` uses (``analytix_log_stats``,
turned into ``fed.analytix_log_stats`` by the job's ``ConvertToFedEvent``: the TensorBoard and MLflow receivers
on the server see the same series), and torch tensors travel end to end (FLARE's ``TensorDecomposer``). Tasks run
one at a time in the site's one worker thread (as the Client API script runs in one), so an aborted task
(``abort_signal``: the server's task timeout, an aborted or ending job) is answered TASK_ABORTED at once, as the
Client API executor answers it, and the site stops computing it: the worker runs the task under
``pflseg.train.loop.stop_when(abort_signal.triggered)``, so the one training loop stops before its next batch
(``TaskAborted``: no reply, no state of the round written: the model left mid-way is saved nowhere; the state
files are written whole or not at all). A task aborted after its training (while it scores or saves its model) ends
as before: its state is written, its reply not sent. The next task waits for the worker; a task aborted before it
began is never begun. Without an abort nothing differs: the check only reads the signal.

Package-mode jobs name ``pflseg.flare.executor.SiteExecutor`` (sites allow it: ``pflseg.flare.allowlist``); BYOC
jobs name ``job_client.SiteExecutor`` (``pflseg/flare/job_client.py``, carried in the job's ``app/custom``), whose
module puts the job's own pflseg first before it imports this one. ``ClientAPISiteExecutor`` is the Client API
route (config ``site.executor: client_api``): FLARE's in-process Client API executor running the installed
launcher ``pflseg/flare/job_client.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_opt.pt.decomposers import TensorDecomposer
from nvflare.client.config import ExchangeFormat
from nvflare.fuel.utils import fobs

from pflseg.flare import client, outbox
from pflseg.train.loop import TaskAborted, stop_when

log = logging.getLogger("pflseg.client")

#: the Client API launcher of the installed pflseg (``ClientAPISiteExecutor``)
LAUNCHER = Path(__file__).resolve().with_name("job_client.py")

#: seconds between two looks at the abort signal while the site computes (the reply itself is taken the moment it
#: is ready: this is no poll on the result)
ABORT_CHECK = 0.1


class SiteExecutor(Executor):
    """Answers every task of a pflseg job at this site: ``pflseg.flare.client.answer`` inside ``execute()``."""

    def __init__(self):
        super().__init__()
        fobs.register(TensorDecomposer)  # messages carry torch tensors end to end
        self._site = None  # the method's site object, made from the first message (client.answer)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # tasks for the worker, in order
        self._worker: threading.Thread | None = None  # the site's one worker thread, started with the first task
        self._running = threading.Event()  # set while the worker computes a task

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        name, job_id = fl_ctx.get_identity_name(), fl_ctx.get_job_id()
        shareable.set_header(FLMetaKey.JOB_ID, job_id)  # as the Client API gives them to its script (FLModel.meta)
        shareable.set_header(FLMetaKey.SITE_NAME, name)
        try:
            msg = FLModelUtils.from_shareable(shareable)
        except Exception as exc:  # noqa: BLE001 - a malformed task is refused, never a dead site
            self.log_error(fl_ctx, f"site {name}: task '{task_name}' is no FLModel ({type(exc).__name__}); refused")
            return make_reply(ReturnCode.BAD_TASK_DATA)
        if self._worker is None:  # a daemon: a site stuck in a task never holds the job's process open
            self._worker = threading.Thread(target=self._serve, name=f"pflseg_site_{name}", daemon=True)
            self._worker.start()
        done: dict = {"finished": threading.Event()}
        self._inbox.put((name, task_name, msg, job_id, abort_signal, done))
        while not done["finished"].wait(ABORT_CHECK):  # returns the moment the site has answered
            if abort_signal.triggered:
                self.log_info(fl_ctx, f"task '{task_name}' aborted; a site that has begun it stops before its next "
                                      "training batch")
                return make_reply(ReturnCode.TASK_ABORTED)
        if "reply" not in done:  # answer() turns every Exception into a reply: only a BaseException gets here
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            self.log_error(fl_ctx, f"site {name}: task '{task_name}' stopped by {done.get('stopped', 'nothing')}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        out = done["reply"]
        try:
            self._track(out, msg.current_round or 0, fl_ctx)
            reply = FLModelUtils.to_shareable(out)
        except Exception as exc:  # noqa: BLE001 - FLARE's own failure leaves through the exit's error-text rule too
            reply = FLModelUtils.to_shareable(outbox.leave(name, task_name, site=self._site, error=exc))
        current_round = shareable.get_header(AppConstants.CURRENT_ROUND)
        if current_round is not None:
            reply.set_header(AppConstants.CURRENT_ROUND, current_round)
        return reply

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.END_RUN and self._running.is_set():
            self.log_warning(fl_ctx, "the job ends while the site still computes an aborted task; it stops before "
                                     "its next training batch")

    def _serve(self) -> None:
        """The worker: the site's tasks one after the other, each answered by ``client.answer``; training stops before
        its next batch once the task's ``abort_signal`` triggers (``stop_when``: ``TaskAborted``)."""
        while True:
            name, task, msg, job_id, abort_signal, done = self._inbox.get()
            try:
                if not abort_signal.triggered:  # aborted while it waited for the task before it: never begun
                    self._running.set()
                    with stop_when(lambda signal=abort_signal: signal.triggered):
                        done["reply"], self._site = client.answer(name, task, msg, self._site, job_id)
            except TaskAborted as exc:  # the task was aborted: no reply, nothing of the round saved
                if exc.site is not None:
                    self._site = exc.site  # the site made for this task (a later one finds it made)
                done["stopped"] = type(exc).__name__
                log.info("site %s: task '%s' (round %s) stopped, aborted: %s; nothing of it is saved", name, task,
                         msg.current_round, exc)
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit: named in execute()
                done["stopped"] = type(exc).__name__
            finally:
                self._running.clear()
                done["finished"].set()
            msg = done = abort_signal = None  # nothing of the task is held while the worker waits for the next one

    def _track(self, out, step: int, fl_ctx: FLContext) -> None:
        """The reply's numeric metrics as FLARE analytics events, as the Client API script's ``SummaryWriter``
        sends them (the same names at every site: FLARE's receivers keep the sites apart)."""
        with fl_ctx.get_engine().new_context() as ctx:
            for key, value in client.scalars(out):
                dxo = create_analytic_dxo(tag=key, value=value, data_type=AnalyticsDataType.SCALAR,
                                          writer=LogWriterName.TORCH_TB, global_step=step)
                send_analytic_dxo(self, dxo=dxo, fl_ctx=ctx, event_type=ANALYTIC_EVENT_TYPE)


class ClientAPISiteExecutor(ClientAPIExecutor):
    """``ClientAPIExecutor(in_process, task_script_path=<installed pflseg>/flare/job_client.py)``, torch tensors end
    to end: the Client API route of package-mode jobs (``site.executor: client_api``)."""

    def __init__(self):
        super().__init__(
            execution_mode="in_process",
            task_script_path=str(LAUNCHER),
            params_exchange_format=ExchangeFormat.PYTORCH,
            server_expected_format=ExchangeFormat.PYTORCH,
        )
