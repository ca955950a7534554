"""A run's workspace: one run per workspace at a time, and the record of what the run is.

``workspace_lock`` holds ``<workspace>/.lock`` (``fcntl.flock``) and writes the holder (pid, command, start time)
into it; a second run there fails at once naming the holder (``WorkspaceBusy``). Every run records what makes it the
run it is in ``<workspace>/run.json`` (``run_record``: its effective config, its data (dataset.json and each site's
datalist.json, by content and hash), its sites and other inputs); ``judge`` tells whether an earlier run of a
workspace is the same run (read back, resumed) or another one, naming the keys that differ, and ``move_aside`` keeps
another one at ``<workspace>.<timestamp>`` (results are never deleted). ``server_state``: where a run keeps a job's
server state.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

from pflseg.data.datalist import DATALIST_JSON
from pflseg.flare.methods import own_config
from pflseg.flare.state import PRIVATE_DIR, RoundStore, private_dir, write_text

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

LOCK, RECORD = ".lock", "run.json"
#: workspaces whose lock this process holds: absolute path -> [lock file descriptor, nesting depth]
_LOCKS: dict[str, list[int]] = {}


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace."""


def server_state(workspace: str | Path, job: str) -> Path:
    """Where a run in ``workspace`` keeps job ``job``'s server state: its rounds, ``results.json``, the bundle a
    post-training job reads."""
    return Path(workspace) / "state" / "server" / job


# ---- one run per workspace --------------------------------------------------------------------------------
@contextlib.contextmanager
def workspace_lock(workspace: str | Path):
    """Hold ``<workspace>/.lock`` (``fcntl.flock``) while the block runs and write the holder into it (pid,
    command, start time). Re-entrant within this process (a command that prepares a run takes it, the runner
    takes it again); released at the end of the block or of the process.

    Raises:
        WorkspaceBusy: another process holds it (names the workspace and the holder).
    """
    ws = Path(workspace).resolve()
    held = _LOCKS.get(str(ws))
    if held is not None:
        held[1] += 1
        try:
            yield ws
        finally:
            held[1] -= 1
        return
    check_workspace(ws)
    fd = os.open(ws / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise WorkspaceBusy(_busy(ws)) from None
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": _command(), "since": _now()}).encode(), 0)
    _LOCKS[str(ws)] = [fd, 1]
    try:
        yield ws
    finally:
        del _LOCKS[str(ws)]
        os.ftruncate(fd, 0)
        os.close(fd)


def check_workspace(workspace: str | Path) -> Path:
    """Make ``workspace`` (a folder) if it is not there; returns it.

    Raises:
        NotADirectoryError: it, or a folder above it, is a file (names the file and the fix).
        PermissionError: it cannot be made or written there.
    """
    ws = Path(workspace).resolve()
    blocker = next((p for p in [ws, *ws.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise NotADirectoryError(f"workspace {ws}: {blocker} is a file, not a folder; give --workspace a folder (a "
                                 "new one is made) or move the file away")
    try:
        private_dir(ws)
    except PermissionError as exc:
        raise PermissionError(f"workspace {ws}: cannot make or write it ({exc.strerror}); give --workspace a folder "
                              "you may write") from None
    if not os.access(ws, os.W_OK | os.X_OK):
        raise PermissionError(f"workspace {ws}: not writable; give --workspace a folder you may write")
    return ws


def _busy(ws: Path) -> str:
    try:
        holder = json.loads((ws / LOCK).read_text())
        who = f"pid {holder['pid']} (`{holder['command']}`, started {holder['since']})"
        stop = f"stop it (Ctrl-C in its terminal, or kill -INT {holder['pid']})"
    except (OSError, ValueError, KeyError, TypeError):
        who, stop = "another process (it has not named itself yet)", "stop it"
    return (f"workspace {ws} is in use by {who}, which holds {ws / LOCK}; wait until it ends, {stop}, or give "
            "this run another workspace (--workspace)")


def _command() -> str:
    return shlex.join([Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python", *sys.argv[1:]])


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ---- what a run is: run.json --------------------------------------------------------------------------------
def job_config(job_dir: str | Path) -> dict:
    """The effective config an exported job carries (its server controller's ``config`` argument)."""
    path = Path(job_dir) / "app" / "config" / "config_fed_server.json"
    for workflow in json.loads(path.read_text()).get("workflows", []):
        cfg = workflow.get("args", {}).get("config")
        if isinstance(cfg, dict):
            return cfg
    raise ValueError(f"{path}: no controller with a pflseg config in it")


def run_record(cfg: dict, data: str | Path | None = None, sites: list[str] | dict[str, str] | None = None,
               inputs: dict | None = None) -> dict:
    """What makes a run the run it is: its effective config (without ``resume``, which only says how it
    starts), its data, its sites and other ``inputs``, each by content, and the sha256 of all of it.

    Args:
        cfg: the effective job config (``load_job_config`` = what an exported job carries, ``job_config``).
        data: the data root (None: synthetic data made at each site from the config's ``data.synth_*``).
        sites: the FLARE site names, or ``{FLARE name: the site's folder under data}`` (a renamed site).
        inputs: anything else the run reads, e.g. ``{"bundle_run": <sha256 of the training run's record>}``.

    Returns:
        ``{"config", "data", "sites", "inputs", "sha256"}``; ``data`` holds the root (not compared: a root may
        move), dataset.json's content (without its ``sites`` list) and each site's datalist.json sha256.
    """
    cfg = json.loads(json.dumps(cfg, sort_keys=True))
    cfg.pop("resume", None)
    names = dict(sites) if isinstance(sites, dict) else {s: s for s in sites or []}
    if data is None:
        fingerprint: dict = {"synthetic": "made at each site from the config's data.synth_* settings"}
    else:
        root = Path(data).resolve()
        info = json.loads((root / "dataset.json").read_text())
        info.pop("sites", None)  # a view of the root lists its sites under their FLARE names
        fingerprint = {"root": str(root), "dataset": info,
                       "datalists": {n: _file_sha(root / folder / DATALIST_JSON) for n, folder in names.items()}}
    body = {"config": cfg, "data": fingerprint, "sites": list(names), "inputs": dict(inputs or {})}
    return {**body, "sha256": _sha(_comparable(body))}


def record_run(workspace: Path, job_dir: Path, data: Path | None, sites: list[str], inputs: dict | None) -> dict:
    """Write ``<workspace>/run.json`` for a run of the exported ``job_dir`` about to start; returns the record."""
    try:
        cfg = job_config(job_dir)
    except (OSError, ValueError):  # not a pflseg job folder: FLARE will say what is wrong with it
        cfg = {}
    record = {**run_record(cfg, data, sites, inputs), "job": Path(job_dir).name, "command": _command(),
              "started": _now(), "finished": None}
    write_text(Path(workspace) / RECORD, json.dumps(record, indent=1, sort_keys=True))
    return record


def finish_record(workspace: Path, record: dict) -> None:
    """Write ``record`` (``record_run``'s) back to ``<workspace>/run.json`` with its finish time: the run is done."""
    write_text(Path(workspace) / RECORD, json.dumps({**record, "finished": _now()}, indent=1, sort_keys=True))


def read_record(workspace: str | Path, job: str) -> dict | None:
    """The record of the earlier run in ``workspace``: its run.json, else (a run made before run.json existed)
    the config of its exported job ``<workspace>/job/<job>`` marked ``"legacy": true``; None when neither."""
    ws = Path(workspace)
    try:
        return json.loads((ws / RECORD).read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return {"unreadable": str(ws / RECORD)}
    try:
        cfg = job_config(ws / "job" / job)
    except (OSError, ValueError):
        return None
    cfg = {k: v for k, v in cfg.items() if k != "resume"}
    return {"config": cfg, "legacy": True}


def differences(earlier: dict, now: dict, more_rounds: bool = False) -> list[str]:
    """``"key: earlier -> now"`` for every key in which two run records differ (config keys dotted, e.g.
    ``train.lr``; ``data.…``, ``sites``, ``inputs.…``). A legacy record (config only) is compared on its config.
    ``more_rounds``: a larger ``rounds`` now is no difference (resuming a finished run extends it)."""
    if "unreadable" in earlier:
        return [f"the earlier run's record {earlier['unreadable']} cannot be read"]
    a, b = _comparable(earlier), _comparable(now)
    for section in ("data", "sites", "inputs"):
        if section not in a:
            b.pop(section, None)
    rounds_a, rounds_b = a.get("config", {}).get("rounds"), b.get("config", {}).get("rounds")
    if more_rounds and isinstance(rounds_a, int) and isinstance(rounds_b, int) and rounds_b >= rounds_a:
        b["config"]["rounds"] = rounds_a
    flat_a, flat_b = _flat(a), _flat(b)
    unset = "(unset)"
    out = []
    for key in [*flat_b, *(k for k in flat_a if k not in flat_b)]:
        va, vb = flat_a.get(key, unset), flat_b.get(key, unset)
        if va != vb:
            label = key[len("config."):] if key.startswith("config.") else key
            out.append(f"{label}: {_short(va)} -> {_short(vb)}")
    return out


def judge(workspace: str | Path, job: str, expected: dict, more_rounds: bool = False) -> tuple[str, list[str]]:
    """What the earlier run of ``job`` in ``workspace`` is to a run with the record ``expected``.

    Returns:
        ``(verdict, lines)``. Verdicts: "none" (nothing to reuse: no earlier run, or one of these settings that
        completed no round), "finished" (these settings, results there: read it back), "stopped" (these
        settings, stopped after a completed round: resume it), "differs" (``lines`` name what differs: keep it
        aside and run afresh). With "finished" / "stopped", ``lines`` may hold a note (a legacy record:
        its data and sites were not recorded, so only its config was compared).
    """
    ws = Path(workspace)
    server = server_state(ws, job)
    results = (server / "results.json").is_file()
    rounds = RoundStore(server, clean=False).latest() is not None
    earlier = read_record(ws, job)
    if earlier is None:
        if results or rounds:
            return "differs", [f"no record of the earlier run's settings ({ws / RECORD})"]
        return "none", []
    diffs = differences(earlier, expected, more_rounds)
    if diffs:
        return "differs", diffs
    note = ["run made before run.json existed: its config (exported job) matches; its data and sites were not "
            "recorded"] if earlier.get("legacy") else []
    if results:
        return "finished", note
    return ("stopped", note) if rounds else ("none", [])


def move_aside(workspace: str | Path) -> Path:
    """Move everything in ``workspace`` (but its lock) to ``<workspace>.<YYYYmmdd-HHMMSS>`` (``.2``, ... when
    taken), never deleting anything; returns that folder."""
    ws = Path(workspace).resolve()
    base = ws.with_name(f"{ws.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = base, 1
    while aside.exists():
        n += 1
        aside = base.with_name(f"{base.name}.{n}")
    private_dir(aside.parent)
    aside.mkdir(mode=PRIVATE_DIR)  # a new folder (raises when one is there)
    for entry in ws.iterdir():
        if entry.name != LOCK:
            os.rename(entry, aside / entry.name)
    return aside


def _comparable(record: dict) -> dict:
    """The part of a record that decides identity (no root path, times, command or hash)."""
    out = {k: json.loads(json.dumps(record[k])) for k in ("config", "data", "sites", "inputs") if k in record}
    if isinstance(out.get("config"), dict):  # another method's section does not change what this run is
        out["config"] = own_config(out["config"])
    if isinstance(out.get("data"), dict):
        out["data"].pop("root", None)
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v, n: int = 60) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= n else text[: n - 3] + "..."


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
