"""Submit a job to a provisioned federation through the FLARE API, follow it, fetch its results.

    results = submit("jobs/fedavg", kit="/path/to/admin@pflseg.org")   # the admin's startup kit folder

Progress lines are the server's "round k/N done" log lines (fetched with the FLARE API); the downloaded
job holds the server side, including pflseg's ``results.json`` (per-site validation and test Dice,
sites left out and why).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from pflseg.deploy.simulator import Interrupted, panic_reason
from pflseg.markdown import markdown_table

TERMINAL_OK = "FINISHED:COMPLETED"


class SubmitError(RuntimeError):
    """The job was refused or did not complete."""


class StillRunning(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped ``submit`` following a job: the job goes on at the server. ``str()`` says so and
    how to follow or abort it."""

    def __init__(self, job_id: str, kit: Path, signal_name: str = "SIGINT"):
        self.job_id, self.kit = job_id, kit
        super().__init__(f"stopped following job {job_id} ({signal_name}); the job goes on at the server. Follow or "
                         f"abort it in the admin console {kit}/startup/fl_admin.sh: `list_jobs`, `download_job "
                         f"{job_id}`, `abort_job {job_id}`")

    def __str__(self) -> str:
        return self.args[0]


def submit(job_dir: str | Path, kit: str | Path, user: str | None = None, timeout: float = 3600.0,
           out: str | Path | None = None, progress=print, poll: float = 2.0, reconnect: float = 60.0) -> dict:
    """Submit ``job_dir`` as ``user`` (default: the kit folder's name), wait, download, return results.json.

    A lost admin connection while following the job (FLARE's API gives up after ~1.5 s; a busy server answers later)
    is tried again until ``reconnect`` seconds have passed without an answer; then its error is raised.

    Returns the results dict plus ``job_id``, ``status`` (FLARE's final job status) and ``download`` (the
    downloaded folder). Raises SubmitError when the submission is refused (e.g. the user lacks the right)
    or the job ends without pflseg's results.
    """
    from nvflare.fuel.flare_api.api_spec import NoConnection
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    job_dir, kit = Path(job_dir).resolve(), Path(kit).resolve()
    if not (job_dir / "meta.json").is_file():
        raise SubmitError(f"{job_dir} is not a FLARE job folder (no meta.json); export one with `pflseg jobs export`")
    if not (kit / "startup" / "fed_admin.json").is_file():
        raise SubmitError(f"{kit} is not an admin startup kit (no startup/fed_admin.json)")
    user = user or kit.name
    sess = new_secure_session(user, str(kit), timeout=30.0)
    try:
        try:
            job_id = sess.submit_job(str(job_dir))
        except Exception as exc:
            raise SubmitError(f"job {job_dir.name} refused for {user}: {exc}") from exc
        progress(f"submitted {job_dir.name} as job {job_id} (user {user}); Ctrl-C stops following it, not the job")
        seen = _Follow(job_id, progress)
        deadline = time.time() + timeout if timeout > 0 else float("inf")  # 0: no limit (FLARE's meaning)
        said = None  # the server's last answer when the lost connection was said
        while True:
            try:
                left = deadline - time.time()
                _, meta = sess.monitor_job_and_return_job_meta(job_id, timeout=0 if left == float("inf") else
                                                               max(left, 0.001), poll_interval=poll, cb=seen)
                break
            except KeyboardInterrupt:
                raise StillRunning(job_id, kit) from None
            except Interrupted as exc:  # SIGTERM (pflseg.cli)
                raise StillRunning(job_id, kit, signal.Signals(exc.signum).name) from None
            except NoConnection as exc:
                if time.time() - seen.answered > reconnect or time.time() > deadline:
                    raise
                if said != seen.answered:  # once per outage
                    said = seen.answered
                    progress(f"[{time.time() - seen.t0:6.1f} s] no answer from the server ({exc}); trying again "
                             f"for up to {reconnect:.0f} s without one")
                time.sleep(poll)
        if meta is None:
            raise SubmitError(f"job {job_id} did not finish within {timeout:.0f} s")
        seen(sess, job_id, meta)
        status = meta.get("status")
        download = Path(sess.download_job_result(job_id, destination=str(out) if out else None))
    finally:
        sess.close()
    found = sorted(download.rglob("results.json"))
    if not found:
        logs = sorted(download.rglob("log.txt"))
        reason = next((r for r in map(panic_reason, logs) if r), None)
        raise SubmitError(f"job {job_id} ended {status} without results"
                          + (f": the server stopped it: {reason}" if reason else "")
                          + f". Server log: {logs[0] if logs else f'{download}/**/log.txt'}")
    if status != TERMINAL_OK:  # e.g. FINISHED:ABNORMAL when a site died: pflseg finished with the others
        progress(f"job {job_id} ended {status} (FLARE's view: a site's job process failed); pflseg results follow")
    results = json.loads(found[0].read_text())
    results.update(job_id=job_id, status=status, download=str(download))
    return results



def submit_report(job_dir: str | Path, kit: str | Path, user: str | None = None, timeout: float = 3600.0,
                  out: str | Path | None = None, say=print) -> dict:
    """``pflseg submit``: ``submit`` the job, then ``say`` its per-site metrics (``metrics_table``) and where it was
    downloaded. A server that cannot be reached is a RuntimeError naming the kit and what to check.

    Returns:
        The job's results (``submit``).
    """
    try:
        results = submit(job_dir, kit, user=user, timeout=timeout, out=out, progress=say)
    except ConnectionError as exc:  # nvflare's NoConnection: the server is down or not reachable
        raise RuntimeError(f"cannot reach the FLARE server of the admin kit {Path(kit).resolve()} ({exc}): is the "
                           "federation running? Start it (pflseg deploy local) or check the server's address and "
                           "port in the kit's startup/fed_admin.json") from None
    say(metrics_table(results))
    say(f"downloaded to {results['download']}")
    return results

class _Follow:
    """monitor_job callback: prints status changes and new round lines from the server's job log."""

    def __init__(self, job_id: str, progress):
        self.job_id, self.progress, self.status, self.lines, self.t0 = job_id, progress, None, set(), time.time()
        self.no_log = False
        self.answered = self.t0  # the server's last answer (a job status)

    def __call__(self, sess, job_id, meta, *args, **kwargs) -> bool:
        self.answered = time.time()
        status = meta.get("status")
        if status != self.status:
            self.progress(f"[{time.time() - self.t0:6.1f} s] job {job_id}: {status}")
            self.status = status
        try:
            logs = sess.get_job_logs(job_id, "server").get("logs", {})
        except Exception as exc:  # e.g. a policy without the get_job_log right: say so once, keep following the status
            if not self.no_log:
                self.progress(f"round lines unavailable (the server's job log: {exc}); following the job's status only")
                self.no_log = True
            logs = {}
        for text in logs.values():
            for line in str(text).splitlines():
                if not any(key in line for key in ("done in", "left out", "pflseg: ")):
                    continue
                msg = line.split(" - ")[-1].strip()
                if msg and msg not in self.lines:
                    self.lines.add(msg)  # a site left out: its whole reason and fix; a round line: short
                    self.progress(f"[{time.time() - self.t0:6.1f} s] {msg if 'left out' in msg else msg[:200]}")
        return True


def metrics_table(results: dict) -> str:
    """Per-site metrics of a finished job: final test Dice of the global and the site's own model, last
    validation Dice, each site's data source (``synthetic`` or ``site data``), and the sites left out with the
    reason. A value a site sent malformed (not a number in [0, 1], not a dict, ...) shows as ``?`` and a line names
    the site and the key; everything else is still shown."""
    bad: list[str] = []
    history = results.get("history") if isinstance(results.get("history"), list) else []
    last_val = _part(history[-1] if history else {}, "val_dice", "history[-1]", bad)
    test = _part(results, "test", "results", bad)
    title = (f"job {results.get('job_id', '')} {results.get('job', '?')} ({results.get('method', '?')}, "
             f"{results.get('rounds', '?')} rounds) {results.get('status', '')}".rstrip())
    rows = []
    sites = results.get("sites")
    if not isinstance(sites, list):
        bad.append(f"results: 'sites' is {sites!r}, not a list of site names; the sites' test results are listed")
        sites = sorted(test, key=str)
    for site in sites:
        own = test.get(site)
        if own is not None and not isinstance(own, dict):
            bad.append(f"site {site}: test is {_short(own)}, not a dict of its models' metrics")
            own = {}
        own = own or {}
        data = own.get("data_source", "-")
        if not isinstance(data, str) or len(data) > 40:
            bad.append(f"site {site}: test.data_source is {_short(data)}, not a short text")
            data = "?"
        cells = [_dice(own, ("global", "dice"), site, "test", bad), _dice(own, ("site", "dice"), site, "test", bad),
                 _dice(last_val, (site,), site, "history[-1].val_dice", bad)]
        rows.append([site, data, *cells])
    lines = [title, markdown_table(["site", "data", "test Dice (global)", "test Dice (site's own)", "last val Dice"],
                                   rows)]
    missing = _part(results, "missing", "results", bad)
    for site, why in sorted(missing.items(), key=lambda kv: str(kv[0])):
        lines.append(f"left out: {site}: {why}")
    lines += [f"malformed: {line}" for line in bad]
    return "\n".join(lines)


def _part(node, key: str, where: str, bad: list[str]) -> dict:
    """``node[key]`` when it is a dict; {} with a line in ``bad`` naming ``where.key`` when it is something else."""
    value = node.get(key) if isinstance(node, dict) else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        bad.append(f"{where}: '{key}' is {_short(value)}, not a dict")
        return {}
    return value


def _dice(node: dict, path: tuple, site: str, where: str, bad: list[str]) -> str:
    """The Dice at ``node[path...]`` as ``0.1234``; ``-`` when absent; ``?`` with a line in ``bad`` when it is not a
    number in [0, 1]."""
    value, name = node, where
    for key in path:
        if not isinstance(value, dict):
            bad.append(f"site {site}: {name} is {_short(value)}, not a dict")
            return "?"
        if key not in value:
            return "-"
        value = value[key]
        name = name if key == site else f"{name}.{key}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        bad.append(f"site {site}: {name} is {_short(value)}, not a Dice in [0, 1]")
        return "?"
    return f"{value:.4f}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
