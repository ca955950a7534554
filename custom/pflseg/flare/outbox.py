"""The one exit of a site: every reply it sends is made here (``leave``), whatever the method and the task.

A task's handler (``Site.train``, ``validate``, ``test``, IOP-FL's ``submit_model``, ...) returns an ``Outgoing``:
what the site would send, of which nothing has left yet (``Site.reply`` makes it). ``pflseg.flare.client.answer``
adds the task's ``compute_seconds`` (and a test reply's ``data_source``) to it and hands it to ``leave``, which
applies, in this order::

    1. the site's policy      per-case entries leave only when the job asks (privacy.per_case) AND the site's
                              policy (read for this task) allows them
    2. the privacy path       metrics and meta made public (``privacy.public_metrics``: no per-case entries but
                              by 1, no path, no data file name); a model update (``n_samples`` given) as
                              ``privacy.update`` says (``privacy.private_update``: diff, clip, DP noise from fresh
                              randomness, one release per (job, task, round): ``privacy.Releases``)
    3. the error-text rule    an exception of the task, or of 1-2 (e.g. a refused second release), becomes an
                              error reply: codes and pseudonyms only (``privacy.public_error``); the detail goes
                              to the site-local ``<state root>/site_errors.log``

and returns the ``FLModel`` FLARE sends. No site class makes an ``FLModel`` itself, and nothing is added to one
after it left here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from nvflare.app_common.abstract.fl_model import FLModel

from pflseg.data import DataError
from pflseg.flare.policy import deployed
from pflseg.flare.privacy import (
    Pseudonyms,
    Releases,
    private_update,
    public_error,
    public_metrics,
    write_local_log,
)
from pflseg.flare.settings import site_settings
from pflseg.flare.state import state_dir

log = logging.getLogger("pflseg.client")


@dataclass
class Outgoing:
    """What a site's task would send; nothing of it has left the site yet (``leave`` decides what does).

    Attributes:
        params: the method's tensors (prefixed keys).
        metrics: the task's metrics, as the site computed them (per-case entries, paths and all).
        n_samples: a model update's weight n_k; None: the reply is no model update.
        received: the task message a model update answers (``privacy.update`` takes the update against it).
        meta: further fields of the reply (``published``, ``why``, ``round``, ...); ``leave`` adds ``site`` (and
            ``NUM_STEPS_CURRENT_ROUND`` for an update).
    """

    params: dict
    metrics: dict
    n_samples: int | None = None
    received: FLModel | None = None
    meta: dict = field(default_factory=dict)


def leave(name: str, task: str, out: Outgoing | None = None, *, site=None, error: BaseException | None = None,
          settings: dict | None = None, state_root: str | Path | None = None) -> FLModel:
    """The reply of site ``name`` to ``task``: ``out`` through the site's policy and the privacy path, or, when
    ``error`` is given or either step raises, the error reply of the error-text rule (see the module docstring).

    Args:
        site: the site object (``pflseg.flare.sites.base.Site``; None when it could not be made).
        settings: the site's settings read for this task (None: read now).
        state_root: the site's state root when there is no site object (None: from its settings).
    """
    if error is None:
        try:
            return _release(name, task, out, site, settings)
        except Exception as exc:  # noqa: BLE001 - refused at the exit: an error reply like any other
            error = exc
    return _error_reply(name, task, error, site, state_root)


def _release(name: str, task: str, out, site, settings: dict | None) -> FLModel:
    if not isinstance(out, Outgoing) or site is None:
        raise TypeError(f"site {name}: task '{task}' answered with a {type(out).__name__}, not an Outgoing: a site's "
                        "task returns self.reply(...), and only pflseg.flare.outbox.leave makes the reply")
    root = site.store.root.parent
    per_case = allows_per_case(site.cfg, settings if settings is not None else site_settings(name), site.job_id)
    metrics = public_metrics(out.metrics, per_case, site.pseudonyms, root)
    meta = {**public_metrics(out.meta, False, site.pseudonyms, root), "site": name}
    if out.n_samples is None:
        return FLModel(params=out.params, metrics=metrics, meta=meta)
    meta["NUM_STEPS_CURRENT_ROUND"] = out.n_samples
    r = out.received.current_round if out.received is not None else None
    params, kind = private_update(
        out.params, out.received, site.cfg["privacy"]["update"], site=name, prefixes=site.dp_prefixes,
        variances=site.running_variances(),
        claim=lambda: Releases(root).claim(name, site.job_id, site.cfg["name"], task, r))
    return FLModel(params=params, params_type=kind, metrics=metrics, meta=meta)


def allows_per_case(cfg: dict, settings: dict, job_id: str | None) -> bool:
    """Step 1, the site's policy: per-case entries leave only when the job asks (``privacy.per_case``) and the site's
    policy allows them (``policy.per_case``; null: in the simulator only). The job is refused before it runs when it
    asks and the policy does not (``pflseg.flare.policy.check_task``): this is the exit's own check of that rule."""
    allowed = settings["policy"]["per_case"]
    if allowed is None:
        allowed = not deployed(job_id)
    return bool(cfg["privacy"]["per_case"] and allowed)


def _error_reply(name: str, task: str, exc: BaseException, site, state_root) -> FLModel:
    store = getattr(site, "store", None)
    if store is not None:
        state_root = store.root.parent
    elif state_root is None:
        state_root = site_state_root(name)
    pseudonyms = getattr(site, "pseudonyms", None) or Pseudonyms(state_root)
    error, detail = public_error(exc, name, task, state_root, pseudonyms)
    where = write_local_log(state_root, error, detail)
    error += f" (detail in the site's {where})" if where else " (detail: no site-local log could be written)"
    log.error("%s", error)
    return FLModel(params={}, meta={"pflseg_error": error, "site": name})


def site_state_root(name: str) -> Path:
    """The site's state root (errors name paths in it relative to it; its local error log lies in it): from the
    site's settings, ``PFLSEG_STATE_DIR`` or the working directory (``pflseg.flare.state.state_dir``); an
    unusable site config counts as none."""
    try:
        configured = site_settings(name)["state_dir"]
    except (DataError, ValueError, OSError, KeyError, TypeError):
        configured = None
    return state_dir(name, "_", configured).parent
