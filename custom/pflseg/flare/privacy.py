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

Test metrics are sent once, at the end (the final ``test`` task); IOP-FL's per-round test Dice only with
``privacy.round_test: true`` (``pflseg.flare.sites.iopfl``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

SALT_FILE = "privacy_salt"

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
        if self._salt is None:
            if not self.path.is_file():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:  # another worker of this site made it meanwhile
                    pass
                else:
                    with os.fdopen(fd, "w") as f:
                        f.write(secrets.token_hex(32))
            self._salt = bytes.fromhex(self.path.read_text().strip())
        return self._salt

    def __call__(self, case: str) -> str:
        return "case-" + hmac.new(self.salt(), case.encode(), hashlib.sha256).hexdigest()[:16]
