"""What leaves a site, besides the models its method sends: aggregate metrics, nothing about its files.

Every reply of a site passes ``public_metrics`` (``Site.reply``) and every error it reports passes
``public_text`` (``pflseg.flare.client.answer``):

- ``per_case`` entries (Dice per case, keyed by case ids that come from the site's file names) are dropped,
  unless the job sets ``privacy.per_case: true``; then each case id becomes a pseudonym: an HMAC-SHA256 of
  the id under a random salt that never leaves the site (``<site state root>/privacy_salt``), the same for
  every job of that site, so per-case numbers of two methods can be compared without naming a case.
- ``predictions`` (where a site wrote its predicted masks) becomes ``"written at the site: <job>/predictions"``,
  relative to the site's state root.
- every other string loses its absolute paths: a path inside the site's state root becomes
  ``<state>/<relative path>``, any other absolute path its last component after ``.../``. The site's own log
  keeps the full text.

Errors (``public_error``, used by ``pflseg.flare.client.answer``): a data problem (a ``DataError`` made of
``pflseg.data.errors.Problem`` objects: a corrupt file, a case in two splits, ...) is sent as problem codes,
counts and pseudonyms only (``file-<hmac>`` for a file, ``case-<hmac>`` for a case id, under the same salt);
another actionable error (a config value, the state folder, a missing data location) as its message through
``public_text``; an unforeseen exception as its type only. The full detail (message, paths, which pseudonym
is which file or case, the traceback) goes to the site-local log ``<state root>/site_errors.log``
(``write_local_log``, mode 0600), never to FLARE's logs, which FLARE can stream to the server.

Test metrics are sent once, at the end (the final ``test`` task); IOP-FL's per-round test Dice only with
``privacy.round_test: true`` (``pflseg.flare.sites.iopfl``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
import traceback
from pathlib import Path

SALT_FILE = "privacy_salt"
#: the site-local error log in the site's state root: what an error reply leaves out, for the site's operator
LOCAL_LOG = "site_errors.log"
#: pseudonyms named per problem code in an error reply (the count says how many there are)
MAX_NAMED = 5

_STOP = r"\s'\"`,;:()\[\]{}<>|*?"
#: An absolute POSIX path (``/a/b``, ``~/a``) not preceded by a word character, or a Windows one (``C:\\a``).
_PATH = re.compile(rf"(?<![\w.<>/~-])(?:~|[A-Za-z]:)?[/\\](?:[^{_STOP}/\\]+[/\\]?)+")


def public_text(text: str, state_root: str | Path | None = None) -> str:
    """``text`` without absolute paths (see the module docstring)."""
    if state_root is not None:
        root = os.path.abspath(state_root)
        text = text.replace(root + os.sep, "<state>/").replace(root, "<state>")

    def last(match: re.Match) -> str:
        parts = [p for p in re.split(r"[/\\]", match.group(0)) if p and p != "~" and not p.endswith(":")]
        return ".../" + parts[-1] if parts else "..."

    return _PATH.sub(last, text)


def public_metrics(value, per_case: bool, pseudonym, state_root: str | Path | None = None):
    """A copy of ``value`` (metrics: nested dicts, lists, numbers, strings) fit to leave the site.

    Args:
        per_case: keep ``per_case`` entries (their keys replaced by ``pseudonym(case id)``); False drops them.
        pseudonym: case id -> the name it is sent under (``Pseudonyms``); called only when ``per_case``.
        state_root: the site's state root (prediction folders are named relative to it).
    """
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "per_case" and isinstance(item, dict):
                if per_case:
                    out[key] = {pseudonym(str(case)): public_metrics(v, per_case, pseudonym, state_root)
                                for case, v in item.items()}
            elif key == "predictions" and isinstance(item, str):
                out[key] = f"written at the site: {_relative(item, state_root)}"
            else:
                out[key] = public_metrics(item, per_case, pseudonym, state_root)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(public_metrics(v, per_case, pseudonym, state_root) for v in value)
    if isinstance(value, str):
        return public_text(value, state_root)
    return value


def _relative(path: str, state_root) -> str:
    if state_root is not None:
        try:
            return Path(os.path.abspath(path)).relative_to(os.path.abspath(state_root)).as_posix()
        except ValueError:
            pass
    return Path(path).name


class Pseudonyms:
    """Case id -> HMAC-SHA256 pseudonym (16 hex digits) under the site's salt, made on first use in
    ``<state_root>/privacy_salt`` (readable by the site's user only)."""

    def __init__(self, state_root: str | Path):
        self.path = Path(state_root) / SALT_FILE
        self._salt: bytes | None = None

    def salt(self) -> bytes:
        """The site's salt, made on first use: written whole to a private temporary file, flushed to disk, then
        linked into place (atomic, never over an existing salt: a full disk leaves no empty salt that anyone could
        recompute pseudonyms under). A salt file that is not 64 hex digits is an error naming it."""
        if self._salt is None:
            if not self.path.is_file():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name(f".{SALT_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(secrets.token_hex(32))
                        f.flush()
                        os.fsync(f.fileno())
                    try:
                        os.link(tmp, self.path)
                    except FileExistsError:  # another worker of this site made it meanwhile: theirs holds
                        pass
                finally:
                    tmp.unlink(missing_ok=True)
            text = self.path.read_text().strip()
            if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
                raise ValueError(f"{self.path}: not a pseudonym salt (64 hex digits); move it aside and the site "
                                 "makes a new one (earlier pseudonyms then change)")
            self._salt = bytes.fromhex(text)
        return self._salt

    def __call__(self, case: str) -> str:
        return "case-" + self._digest(case)

    def file(self, path: str | Path) -> str:
        """A data file's pseudonym (``file-`` + HMAC of its path as the site names it)."""
        return "file-" + self._digest(str(path))

    def _digest(self, text: str) -> str:
        return hmac.new(self.salt(), text.encode(), hashlib.sha256).hexdigest()[:16]


def public_error(exc: BaseException, site: str, task: str, state_root: str | Path | None = None,
                 pseudonyms: Pseudonyms | None = None) -> tuple[str, str]:
    """``(public, detail)`` of an exception in site ``site``'s task ``task`` (see the module docstring).

    ``public`` may leave the site (error reply, FLARE's logs); ``detail`` is for ``write_local_log`` only.
    ``pseudonyms`` None (no state root): data problems are sent as codes and counts without pseudonyms.
    """
    from pflseg.data import DataError

    problems = getattr(exc, "problems", None) if isinstance(exc, DataError) else None
    if problems:
        names = []
        for p in problems:
            try:
                names.append(None if pseudonyms is None else pseudonyms(p.case) if p.case else pseudonyms.file(p.file))
            except (OSError, ValueError):  # no salt (unwritable state root): codes and counts only
                names.append(None)
        parts = []
        for code in dict.fromkeys(p.code for p in problems):
            named = list(dict.fromkeys(n for p, n in zip(problems, names) if p.code == code and n))
            count = sum(p.code == code for p in problems)
            more = f", +{len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
            shown = ", ".join(named[:MAX_NAMED]) + more
            parts.append(f"{code} x{count}" + (f" [{shown}]" if shown else ""))
        public = f"site {site}: task '{task}': {len(problems)} data problem(s): " + "; ".join(parts)
        detail = f"site {site}: task '{task}': {exc}\n" + "\n".join(
            f"  {n or p.code} = {p}" for p, n in zip(problems, names))
        return public, detail
    if isinstance(exc, (DataError, ValueError, RuntimeError, OSError, FloatingPointError)):  # a person can act on it
        message = str(exc) if str(exc).startswith(f"site {site}") else f"site {site}: {exc}"
        return public_text(message, state_root), message
    detail = f"site {site}: task '{task}' failed:\n" + "".join(traceback.format_exception(exc)).rstrip()
    return f"site {site}: task '{task}' failed: {type(exc).__name__}", detail


def write_local_log(state_root: str | Path | None, public: str, detail: str) -> str | None:
    """Append ``detail`` (under the ``public`` line it explains) to ``<state_root>/site_errors.log`` (0600);
    return how a reply names that file (``<state>/site_errors.log``), None when it could not be written."""
    if state_root is None:
        return None
    path = Path(state_root) / LOCAL_LOG
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{stamp} {public}\n{detail}\n\n")
    except OSError:
        return None
    return f"<state>/{LOCAL_LOG}"
