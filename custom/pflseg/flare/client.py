"""The single FLARE Client API script of pflseg: every job's sites run this file.

    flare.init(); while flare.is_running(): model = flare.receive(); site.tasks()[task](model); flare.send()

The job's configuration arrives from the server in ``meta["pflseg"]``; the method's site class
(``pflseg.flare.methods``) answers the tasks its method has. A failing task becomes an error reply that
names the problem (the server leaves the site out of that round), never a dead site.
"""

from __future__ import annotations

import logging
import time

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.config import check_effective
from pflseg.data import DataError
from pflseg.flare.methods import method

log = logging.getLogger("pflseg.client")


def main() -> None:
    import nvflare.client as flare
    from nvflare.client.tracking import SummaryWriter

    flare.init()
    name = flare.get_site_name()
    writer = SummaryWriter()
    site = None
    while flare.is_running():
        msg = flare.receive()
        if msg is None:
            break
        task = flare.get_task_name()
        try:
            if site is None:
                cfg = check_effective(msg.meta["pflseg"], "job config sent by the server")
                site = method(cfg).site(name, cfg, msg.meta["sites"])
            handler = site.tasks().get(task)
            if handler is None:
                raise ValueError(f"site {name}: task '{task}' is not one of this method's tasks {sorted(site.tasks())}")
            t0 = time.time()
            out = handler(msg)
            out.metrics = {**(out.metrics or {}), "compute_seconds": time.time() - t0}
        except (DataError, ValueError, RuntimeError, OSError, FloatingPointError) as exc:
            log.error("site %s: %s", name, exc)
            out = FLModel(params={}, meta={"pflseg_error": str(exc), "site": name})
            site = None if isinstance(exc, DataError) else site
        for key, value in out.metrics.items() if out.metrics else []:
            if isinstance(value, (int, float)):
                writer.add_scalar(f"{name}/{key}", value, msg.current_round or 0)
        flare.send(out)


if __name__ == "__main__":
    main()
