"""State on disk: server round checkpoints and each site's personalized state, one file per round.

Files are ``<dir>/round_NNNN.pt`` holding a plain dict (tensors, numbers, strings, nested dicts), written
atomically (temporary file + rename) and read with ``torch.load(weights_only=True)``; a file that cannot
be read whole raises ``StateError`` naming it (no silent partial load). Because everything a site keeps
between rounds is here, results do not depend on how many simulator threads run the sites, and a
stopped run resumes from its last completed round.

Where state lives: ``$PFLSEG_STATE_DIR/<site>/<job>`` when set (``pflseg run`` sets it), else the
site-local config's ``state_dir``, else ``./pflseg_state/<job>`` under the site's working directory. The
job's name comes from whoever submits the job: a folder that would not lie inside its state root (an
absolute name, ``..``) is refused. A file is durable once ``save_file`` returns (the file and its folder are
fsynced); temporaries a crash left behind (``*.tmp``) are removed when a store is opened or cleared. A write
that fails (disk full, no permission) raises ``StateError`` naming the file and its folder, leaving no
temporary behind and the files of earlier rounds as they were.

Whose state it is: the folder is named after the job (``<state root>/<job name>``), and FLARE may run two jobs
of one name one after the other, or at once. ``claim`` makes the folder the state of one FLARE job id: it
records the id in ``owner.json``, holds an exclusive lock (``fcntl.flock`` on ``<folder>/.lock``) while the
job runs there, refuses a second job of the same name while the first runs (``StateError`` naming the folder
and the other job), and, when a fresh (non-resume) job of another id finds an earlier job's state, moves it
aside to ``<job name>.<earlier job id>`` before anything is written: never deleted. ``resume: true``
continues whatever is there. The simulator gives every run the job id ``simulate_job``: running it again
is the same job, whose round-0 start replaces the state as before.

Who may read it: models trained on patient data and the site's overlays and predictions, so folders pflseg makes
for state are ``0700`` and the files it writes ``0600`` (``PRIVATE_DIR``, ``PRIVATE_FILE``; set when created,
whatever the process's umask); a state folder a job claims is made ``0700`` too. The state root can lie outside
the FLARE workspace (the site settings' ``state_dir``, ``pflseg site init --state-dir``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from pathlib import Path

import torch

from pflseg.data.files import PRIVATE_DIR, private_dir  # noqa: F401 - state's folders

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; ownership is still recorded
    fcntl = None

_ROUND_FILE = re.compile(r"round_(\d{4,})\.pt$")
log = logging.getLogger("pflseg.state")
#: modes of what pflseg makes for state: folders only the site's (or server's) user can enter (``PRIVATE_DIR``, made
#: by ``private_dir``: every folder pflseg makes), files only it reads
PRIVATE_FILE = 0o600


class StateError(RuntimeError):
    """A state file is missing or corrupt."""


def state_dir(site: str, job: str, configured: str | None = None) -> Path:
    """The state folder of ``job`` at ``site`` (see the module docstring).

    Raises:
        ValueError: the folder would not lie inside its root (``job`` absolute, ``..``, several folders, empty).
    """
    env = os.environ.get("PFLSEG_STATE_DIR")
    if env:
        root, folder = Path(env), Path(env) / site / job
    elif configured:
        root, folder = Path(configured), Path(configured) / job
    else:
        root = Path.cwd() / "pflseg_state"
        folder = root / job
    if not job or len(Path(job).parts) != 1 or not inside(folder, root):
        raise ValueError(f"state folder {folder} of job {job!r} at {site} is not inside the state root {root}: "
                         "a job name is one plain folder name (^[A-Za-z0-9_-]+$)")
    return folder


def inside(path: str | Path, root: str | Path) -> bool:
    """Whether ``path`` lies strictly inside ``root``, both made absolute and normalised (``..`` resolved
    lexically, so symbolic links an operator made inside the root are followed as the operator meant)."""
    path, root = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    return path != root and path.is_relative_to(root)


class RoundStore:
    """Per-round state files in one folder; keeps the last ``keep`` rounds (plus named files).

    Opening a store removes the ``*.tmp`` files an interrupted write left in its folder, unless ``clean`` is
    false (a store only read, e.g. another job's checkpoints).
    """

    def __init__(self, root: str | Path, keep: int = 2, clean: bool = True):
        self.root = Path(root)
        self.keep = keep
        self._last: tuple[int, tuple | None, dict] | None = None  # (round, file_stamp, payload) of the last save
        if clean:
            self.remove_tmp()

    def remove_tmp(self) -> None:
        """Remove the temporaries (``*.tmp``) of writes that never completed."""
        if self.root.is_dir():
            for tmp in self.root.glob("*.tmp"):
                if tmp.is_file():
                    tmp.unlink(missing_ok=True)

    def path(self, round_num: int) -> Path:
        return self.root / f"round_{round_num:04d}.pt"

    def rounds(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _ROUND_FILE.match(p.name)))

    def latest(self) -> int | None:
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def save(self, round_num: int, payload: dict) -> Path:
        path = self.path(round_num)
        save_file(path, payload)
        self._last = (round_num, file_stamp(path), cpu_copy(payload))
        for old in self.rounds()[: -self.keep] if self.keep else []:
            self.path(old).unlink(missing_ok=True)
        return path

    def load(self, round_num: int) -> dict:
        """The state of ``round_num``: a copy of what this store saved last when that file is still the one it wrote
        (same inode, size and time: nobody replaced it), else read from disk (``load_file``)."""
        if self._last is not None and self._last[0] == round_num and self._last[1] == file_stamp(self.path(round_num)):
            return cpu_copy(self._last[2])
        return load_file(self.path(round_num))

    def clear(self) -> None:
        for r in self.rounds():
            self.path(r).unlink(missing_ok=True)
        self.final_path.unlink(missing_ok=True)
        self.remove_tmp()

    @property
    def final_path(self) -> Path:
        """The server's checkpoint of the models the final test scored (written after the last round)."""
        return self.root / "final.pt"

    def final(self) -> dict:
        """The final checkpoint when the run finished, else the last completed round's."""
        if self.final_path.is_file():
            return load_file(self.final_path)
        latest = self.latest()
        if latest is None:
            raise StateError(f"no checkpoint in {self.root}: the run never completed a round")
        return self.load(latest)


def save_file(path: str | Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically and durably: temporary file, fsync, rename, fsync of the folder.

    Raises:
        StateError: the write failed (e.g. disk full); names the file and its folder. No temporary is left and
            an earlier file at ``path`` is unchanged.
    """
    _write(Path(path), lambda f: torch.save(payload, f), "wb")


def write_text(path: str | Path, text: str) -> None:
    """``save_file`` for a text file (e.g. results.json)."""
    _write(Path(path), lambda f: f.write(text), "w")


def private_open(path: str | Path, mode: str = "wb"):
    """``open(path, mode)`` for writing, the file created (or truncated) with mode ``PRIVATE_FILE`` (0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)  # a file that existed keeps its mode otherwise
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _write(path: Path, write, mode: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        private_dir(path.parent)
        with private_open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        reason = exc.strerror or str(exc)
        fix = ("free space there" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
               else "check the folder and its permissions")
        raise StateError(f"could not write {path.name} into state folder {path.parent}: {reason} "
                         f"(errno {errno.errorcode.get(exc.errno, exc.errno)}); {fix}") from exc
    fsync_dir(path.parent)


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # file systems that cannot sync a folder say so; anything else is an error
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def file_stamp(path: str | Path) -> tuple | None:
    """``(inode, size, mtime ns)`` of ``path``; None when it does not exist. A write (``save_file``: a new file
    renamed over the old) changes it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def cpu_copy(payload):
    """``payload`` as ``load_file`` would return it after ``save_file``: every tensor copied to the CPU, dicts,
    lists and tuples rebuilt, everything else as is (numbers, strings)."""
    if torch.is_tensor(payload):
        return payload.detach().to("cpu", copy=True)
    if isinstance(payload, dict):
        return {k: cpu_copy(v) for k, v in payload.items()}
    if isinstance(payload, (list, tuple)):
        return type(payload)(cpu_copy(v) for v in payload)
    return payload


def load_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise StateError(f"state file {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        raise StateError(
            f"state file {path} is corrupt or not a pflseg state ({exc.__class__.__name__}: {exc}); "
            "delete it to restart from the previous round, or start the run without resume"
        ) from exc
    if not isinstance(payload, dict):
        raise StateError(f"state file {path} holds {type(payload).__name__}, expected a dict")
    return payload


def prefixed(prefix: str, state: dict) -> dict:
    """``{"a": t}`` -> ``{"<prefix>.a": t}``: several networks in one flat message."""
    return {f"{prefix}.{k}": v for k, v in state.items()}


def unprefixed(prefix: str, flat: dict) -> dict:
    """Keys of ``flat`` that start with ``<prefix>.``, with the prefix removed."""
    head = prefix + "."
    return {k[len(head):]: v for k, v in flat.items() if k.startswith(head)}


# ---- whose state: owner and lock ------------------------------------------------------------------------
OWNER, LOCK = "owner.json", ".lock"
#: Folders this process holds the lock of: absolute path -> (job id, lock file descriptor).
_HELD: dict[str, tuple[str, int]] = {}


def owner(folder: str | Path) -> str | None:
    """The FLARE job id recorded in ``folder`` (None: none recorded, or unreadable)."""
    try:
        return str(json.loads((Path(folder) / OWNER).read_text())["job_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def claim(folder: str | Path, job_id: str, resume: bool, wait: float = 30.0) -> Path | None:
    """Make ``folder`` the state folder of FLARE job ``job_id`` for as long as this process runs it.

    Takes the exclusive lock ``<folder>/.lock`` (kept until ``release`` or the end of the process). Another
    job holding it is an error at once; the same job id holding it (a previous worker of this job still
    exiting, as the simulator swaps workers) is waited for up to ``wait`` seconds. A fresh job (``resume``
    false) whose id differs from the recorded owner moves the earlier job's state aside, to
    ``<folder>.<owner id>`` (``.2``, ``.3``, ... when taken), and starts with an empty folder; ``resume``
    keeps what is there. The folder then records ``job_id`` as its owner.

    Returns:
        Where the earlier job's state was moved, or None.

    Raises:
        StateError: another job holds the folder (names the folder and that job).
    """
    folder = Path(os.path.abspath(folder))
    held = _HELD.get(str(folder))
    if held is not None:
        if held[0] == job_id:
            return None
        raise _in_use(folder, held[0])
    private_dir(folder)
    _make_private(folder)
    fd = _lock(folder, job_id, wait)
    try:
        previous, moved = owner(folder), None
        if previous != job_id and not resume and _holds_state(folder):
            moved = _aside(folder, previous or "unknown")
            os.rename(folder, moved)  # the held lock travels with the moved folder's .lock
            folder.mkdir(mode=PRIVATE_DIR)
            _make_private(folder)
            fd_new = _lock(folder, job_id, 0)
            os.close(fd)
            fd = fd_new
        if previous != job_id or moved:
            write_text(folder / OWNER, json.dumps({"job_id": job_id, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                  "previous": previous, "resumed": bool(resume and previous)}))
    except BaseException:
        os.close(fd)
        raise
    _HELD[str(folder)] = (job_id, fd)
    return moved


def release(folder: str | Path) -> None:
    """Give up this process's lock on ``folder`` (taken by ``claim``); nothing when it holds none."""
    held = _HELD.pop(os.path.abspath(folder), None)
    if held is not None:
        os.close(held[1])


def _lock(folder: Path, job_id: str, wait: float) -> int:
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    if fcntl is None:
        return fd
    deadline, waiting = time.monotonic() + wait, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
        holder = owner(folder)
        if holder != job_id or time.monotonic() >= deadline:
            os.close(fd)
            raise _in_use(folder, holder)
        if not waiting:
            log.info("state folder %s: waiting for job %s's previous worker to let go of it", folder, job_id)
            waiting = True
        time.sleep(0.2)  # this job's previous worker is still exiting


def _in_use(folder: Path, holder: str | None) -> StateError:
    return StateError(f"state folder {folder} is in use by job {holder or '(unknown id)'}, which is running with the "
                      f"same job name '{folder.name}' (it holds {folder / LOCK}); wait until that job ends, or give "
                      "this job another name")


def _make_private(folder: Path) -> None:
    """A claimed state folder: ``PRIVATE_DIR`` even when it was made before (an older pflseg made it 0755)."""
    try:
        os.chmod(folder, PRIVATE_DIR)
    except PermissionError:  # another user's folder: left as it is (the operator's choice)
        log.warning("state folder %s: cannot make it private (mode %o); only its owner can", folder,
                    folder.stat().st_mode & 0o777)


def _holds_state(folder: Path) -> bool:
    return any(p.name not in (OWNER, LOCK) for p in folder.iterdir())


def _aside(folder: Path, job_id: str) -> Path:
    base = folder.with_name(f"{folder.name}.{re.sub(r'[^A-Za-z0-9_-]+', '_', job_id)}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}.{n}")
    return path
