"""The single FLARE Client API script of pflseg: every job's sites run this file.

    flare.init(); while flare.is_running(): model = flare.receive(); site.tasks()[task](model); flare.send()

The job's configuration arrives from the server in ``meta["pflseg"]``; the method's site class
(``pflseg.flare.methods``) answers the tasks its method has. A failing task, whatever the exception,
becomes an error reply that names the problem (the server leaves the site out of that round), never a
dead site; the reply's text carries no absolute paths (``pflseg.flare.privacy.public_text``), the site's
log has the full message. The site claims its state folder for the FLARE job's id (``flare.get_job_id()``).
"""

from __future__ import annotations

import logging
import time

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import check_effective
from pflseg.data import DataError
from pflseg.flare.methods import method
from pflseg.flare.privacy import public_text
from pflseg.flare.settings import site_settings
from pflseg.flare.state import state_dir

log = logging.getLogger("pflseg.client")


def answer(name: str, task: str, msg: FLModel, site, job_id: str | None = None):
    """Site ``name``'s reply to ``task``: ``(reply, site)``, ``site`` made on the first message (None when it
    must be made again, after a data error) for FLARE job ``job_id``. Any exception in a task is an error
    reply naming the site, the task and the exception (meta ``pflseg_error``, without absolute paths; the
    server leaves the site out of that round), never a dead site; unexpected ones are logged with their
    traceback."""
    store = getattr(site, "store", None)
    state_root = store.root.parent if store is not None else None
    try:
        if site is None:
            cfg = check_effective(msg.meta["pflseg"], "job config sent by the server")
            state_root = _state_root(name, cfg)
            site = method(cfg).site(name, cfg, msg.meta["sites"], job_id)
        handler = site.tasks().get(task)
        if handler is None:
            raise ValueError(f"site {name}: task '{task}' is not one of this method's tasks {sorted(site.tasks())}")
        t0 = time.time()
        out = handler(msg)
        out.metrics = {**(out.metrics or {}), "compute_seconds": time.time() - t0}
        return out, site
    except (DataError, ValueError, RuntimeError, OSError, FloatingPointError) as exc:  # problems a person can act on
        log.error("site %s: %s", name, exc)
        error = str(exc) if str(exc).startswith(f"site {name}") else f"site {name}: {exc}"
        if isinstance(exc, DataError):
            site = None  # made again from the next message (the data may be fixed meanwhile)
    except Exception as exc:  # a bug or an unforeseen input: the traceback goes to the site's log
        log.exception("site %s: task '%s' failed", name, task)
        error = f"site {name}: task '{task}' failed: {type(exc).__name__}: {exc}"
    return FLModel(params={}, meta={"pflseg_error": public_text(error, state_root), "site": name}), site


def _state_root(name: str, cfg: dict):
    """The site's state root (errors name paths in it relative to it), or None when it cannot be told yet."""
    try:
        return state_dir(name, cfg["name"], site_settings(name)["state_dir"]).parent
    except (DataError, ValueError, RuntimeError, OSError, KeyError):
        return None


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
        for key, value in out.metrics.items() if out.metrics else []:
            if isinstance(value, (int, float)):
                writer.add_scalar(f"{name}/{key}", value, msg.current_round or 0)
        flare.send(out)


if __name__ == "__main__":
    main()
