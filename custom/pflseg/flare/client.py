"""The site entry point of pflseg: ``answer`` is a site's reply to one task, whatever runs it.

Every job's sites answer through it: FLARE's plain executor ``pflseg.flare.executor.SiteExecutor`` calls it inside
``execute()`` (the default), and ``main`` is the Client API script around it (config ``site.executor:
client_api``)::

    flare.init(); while flare.is_running(): model = flare.receive(); flare.send(answer(name, task, model, site))

The job's configuration arrives from the server in ``meta["pflseg"]``; the method's site class
(``pflseg.flare.methods``) answers the tasks its method has. A failing task, whatever the exception,
becomes an error reply that names the problem (the server leaves the site out of that round), never a
dead site. Every reply, an error's too, leaves through the site's one exit (``pflseg.flare.outbox.leave``: the
site's policy, the privacy path, the error-text rule): the reply, and the ERROR line in FLARE's log, carry what may
leave the site only (``pflseg.flare.privacy.public_error``: codes and pseudonyms, pflseg's own words without paths;
never another library's message); the full detail goes to the site-local ``<state root>/site_errors.log``, which
the reply names. A task stopped because it was aborted (``pflseg.train.loop.TaskAborted``: the executor's stop
check, between training batches) is no failure: no reply and no state of the round are written; the exception goes
on to the executor. The site claims its state folder for the FLARE job's id (``flare.get_job_id()``). Before
the site is made and before every task, the site's own policy (``pflseg.flare.policy.check_task``, read from its
settings every time) may refuse what the job asks; a test reply names the site's data source (``data_source``).
"""

from __future__ import annotations

import logging
import time

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.algorithms.robust import first_nonfinite
from pflseg.config import check_effective
from pflseg.data import DataError
from pflseg.flare.methods import METHODS, method
from pflseg.flare.outbox import Outgoing, leave, site_state_root
from pflseg.flare.policy import check_task
from pflseg.flare.settings import data_source, site_settings
from pflseg.train.loop import TaskAborted

log = logging.getLogger("pflseg.client")


def answer(name: str, task: str, msg: FLModel, site, job_id: str | None = None):
    """Site ``name``'s reply to ``task``: ``(reply, site)``, ``site`` made on the first message (None when it
    must be made again, after a data error) for FLARE job ``job_id``. The reply leaves through the site's one exit
    (``pflseg.flare.outbox.leave``), which is also where any exception of the task becomes an error reply (meta
    ``pflseg_error``: codes and pseudonyms plus where the site keeps the detail; the server leaves the site out of
    that round), never a dead site; the detail (full message, paths, traceback) goes to the site-local log
    ``<state root>/site_errors.log`` only. Nothing is added to the reply after it left the exit."""
    store = getattr(site, "store", None)
    state_root = store.root.parent if store is not None else None
    try:
        if site is None:
            cfg, sites = check_effective(msg.meta["pflseg"], "job config sent by the server"), msg.meta["sites"]
            state_root = site_state_root(name)
        else:
            cfg, sites = site.cfg, site.sites
        # read again for every task: the site may tighten its policy mid-job (policy.methods: registered names only)
        settings = site_settings(name, registered=METHODS)
        entry = method(cfg) if site is None else METHODS[cfg["method"]]  # the method's config rules: first message
        check_task(name, task, cfg, sites, settings, job_id, entry)  # the site's own policy, before anything is made
        if site is None:
            site = entry.site(name, cfg, sites, job_id)
        handler = site.tasks().get(task)
        if handler is None:
            raise ValueError(f"site {name}: task '{task}' is not one of this method's tasks {sorted(site.tasks())}")
        refuse_broken(name, task, msg)
        t0 = time.time()
        out = handler(msg)
        if isinstance(out, Outgoing):  # anything else is refused at the exit
            out.metrics = {**out.metrics, "compute_seconds": time.time() - t0}
            if isinstance(out.metrics.get("test"), dict):  # results.json and the admin's table name each site's data
                out.metrics["test"] = {**out.metrics["test"], "data_source": data_source(settings)}
    except TaskAborted as exc:  # aborted (stop_when): no reply, no state; the site (new or not) goes with it
        exc.site = site
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is a reply, never a dead site
        reply = leave(name, task, site=site, error=exc, state_root=state_root)
        return reply, None if isinstance(exc, DataError) else site  # made again from the next message (data fixed?)
    return leave(name, task, out, site=site, settings=settings), site


def refuse_broken(name: str, task: str, msg: FLModel) -> None:
    """Refuse a received model holding NaN / Inf or a value beyond ``pflseg.algorithms.robust.MAX_ABS`` (a broken or
    hostile aggregate): ValueError naming the key, before anything of it is loaded or trained on."""
    reason = first_nonfinite(msg.params or {})
    if reason:
        raise ValueError(f"site {name}: refusing the model received with task '{task}': {reason} (the server's "
                         "aggregate is broken; nothing of it was loaded)")


def scalars(out: FLModel) -> list[tuple[str, int | float]]:
    """The reply's numeric metrics, tracked under their own names (the same name at every site: FLARE's receivers keep
    the sites apart, tb_events/<site>/ and an MLflow run each)."""
    return [(k, v) for k, v in (out.metrics or {}).items() if isinstance(v, (int, float))]


def main() -> None:
    import nvflare.client as flare
    from nvflare.client.tracking import SummaryWriter

    flare.init()
    name, job_id = flare.get_site_name(), flare.get_job_id()
    writer = SummaryWriter()
    site = None
    while flare.is_running():
        msg = flare.receive()
        if msg is None:
            break
        task = flare.get_task_name()
        out, site = answer(name, task, msg, site, job_id)
        for key, value in scalars(out):
            writer.add_scalar(key, value, msg.current_round or 0)
        flare.send(out)


if __name__ == "__main__":
    main()
