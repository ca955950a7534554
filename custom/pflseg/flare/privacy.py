"""What leaves a site, besides the models its method sends: aggregate metrics, nothing about its files.

Every reply of a site leaves through one exit, ``pflseg.flare.outbox.leave``, which uses this module:

- ``per_case`` entries (Dice per case, keyed by case ids that come from the site's file names) are dropped,
  unless the job sets ``privacy.per_case: true`` (and the site's policy allows it); then each case id becomes a
  pseudonym: an HMAC-SHA256 of the id under a random salt that never leaves the site
  (``<site state root>/privacy_salt``), the same for every job of that site, so per-case numbers of two methods can
  be compared without naming a case.
- ``predictions`` (where a site wrote its predicted masks) becomes ``"written at the site: <job>/predictions"``,
  relative to the site's state root.
- every other string loses its paths and data file names (``public_text``): a path inside the site's state root
  becomes ``<state>/<relative path>`` (a data file's name in it a pseudonym); a path to one of pflseg's own files
  (``OWN_FILE``: ``pflseg_site.json``, ``datalist.json``, ...) ``.../<name>``; any other absolute path, a relative
  path to a data file and a bare data file name (``.png``, ``.nii.gz``, ... : ``DATA_FILE``) become ``file-<hmac>``
  pseudonyms. The site's own log keeps the full text.

Errors (``public_error``): whatever raised it, an exception leaves the site as a code and pseudonyms, never with
its own words, unless pflseg wrote them:

- a data problem (a ``DataError`` made of ``pflseg.data.errors.Problem`` objects: a corrupt file, a case in two
  splits, ...): problem codes, counts and pseudonyms (``file-<hmac>`` for a file, ``case-<hmac>`` for a case id);
- an error pflseg raised itself (``authored``: its class is pflseg's, or a ``raise`` statement in pflseg's code
  made it: a config value, the state folder, the site's policy, a refused DP release): its message through
  ``public_text``;
- anything else (the OS, PIL, nibabel, MONAI, torch, FLARE, a KeyError or ValueError from a library or a builtin
  inside pflseg's code): its type as the code (``FileNotFoundError (ENOENT)``, ``PIL.UnidentifiedImageError``) and
  the pseudonyms of the files it names; its message never leaves.

The full detail (message, paths, which pseudonym is which file or case, the traceback) goes to the site-local log
``<state root>/site_errors.log`` (``write_local_log``, mode 0600), never to FLARE's logs, which FLARE can stream to
the server.

Differential privacy of a model update (``private_update``, ``pflseg.algorithms.dp``): the noise comes from fresh
OS randomness at every release (``pflseg.algorithms.dp.fresh_generator``), never from anything the server chose,
and a site releases a noised update of one (job, task, round) once only (``Releases``): a second request is refused.

Test metrics are sent once, at the end (the final ``test`` task); IOP-FL's per-round test Dice only with
``privacy.round_test: true`` (``pflseg.flare.sites.iopfl``).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import linecache
import os
import re
import secrets
import time
import traceback
from pathlib import Path

import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from pflseg.algorithms.dp import floor_at, fresh_generator, privatize
from pflseg.flare.state import private_dir

SALT_FILE = "privacy_salt"
#: the site-local error log in the site's state root: what an error reply leaves out, for the site's operator
LOCAL_LOG = "site_errors.log"
#: the folder of the site's DP releases in its state root (``Releases``)
RELEASES = "dp_releases"
#: pseudonyms named per problem code in an error reply (the count says how many there are)
MAX_NAMED = 5

#: characters that end a path-like token in a text (whitespace, quotes, brackets, separators of a message)
_STOP = r"\s'\"`,;:()\[\]{}<>|*?="
_TOKEN = re.compile(rf"(?:<state>)?[^{_STOP}]+")
#: a data file's name: images, masks, volumes, arrays (what a site's file names, i.e. patients, hide in)
DATA_FILE = re.compile(r"\.(nii(\.gz)?|gz|png|jpe?g|bmp|tiff?|gif|webp|dcm|dicom|ima|mha|mhd|nrrd|nhdr|npy|npz|h5|"
                       r"hdf5?|mat|raw|img|hdr|zip|tar)$", re.IGNORECASE)
#: pflseg's own files, named by it (an absolute path to one is sent as ``.../<name>``, its folders hidden)
OWN_FILE = re.compile(r"^(pflseg_site\.json|datalist\.json|dataset\.json|site_errors\.log|privacy_salt|resources\.json"
                      r"|round_\d+\.pt|best\.pt|final\.pt|results\.json)$")
#: an absolute path (``/a``, ``\\\\host``, ``~/a``; a Windows drive's ``C:`` is cut off at the colon before)
_ABSOLUTE = re.compile(r"(?:/+|\\+|~[/\\])[^/\\]")
_QUOTED = re.compile(r"(['\"])([^'\"\n]+?)\1")
_DRIVE = re.compile(r"(?<![\w])[A-Za-z]:(?=[/\\])")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the pflseg package this module belongs to


def public_text(text: str, state_root: str | Path | None = None, pseudonyms: Pseudonyms | None = None,
                named: dict | None = None) -> str:
    """``text`` without paths or data file names (see the module docstring).

    Args:
        state_root: the site's state root: paths inside it are named ``<state>/...``.
        pseudonyms: the site's ``Pseudonyms`` (``file-<hmac>``); None: a path or file becomes ``<file>``.
        named: filled with pseudonym -> the path it stands for (for the site-local log).
    """
    if state_root is not None:
        root = os.path.abspath(state_root)
        text = text.replace(root + os.sep, "<state>/").replace(root, "<state>")

    def hide(path: str) -> str:
        try:
            name = pseudonyms.file(path) if pseudonyms is not None else "<file>"
        except (OSError, ValueError):  # no salt (unwritable state root): no pseudonym either
            name = "<file>"
        if named is not None and name != "<file>":
            named[name] = path
        return name

    def token(match: re.Match) -> str:
        word = match.group(0)
        stem = word.rstrip(".")  # a sentence's full stop is no part of a path
        tail = word[len(stem):]
        if stem.startswith("<state>"):  # pflseg's own folders; a data file's name in them (predictions) hidden
            head, _, last = stem.rpartition("/")
            return f"{head}/{hide(stem)}{tail}" if head and DATA_FILE.search(last) else word
        if _ABSOLUTE.match(stem) and OWN_FILE.match(re.split(r"[/\\]", stem)[-1]):
            return ".../" + re.split(r"[/\\]", stem)[-1] + tail  # pflseg's own file: its name says what to fix
        if _ABSOLUTE.match(stem) or DATA_FILE.search(stem):
            return hide(stem) + tail
        return word

    def quoted(match: re.Match) -> str:  # a quoted path may hold spaces: hidden whole
        inner = match.group(2)
        if _ABSOLUTE.match(inner) or DATA_FILE.search(inner.rstrip(".")):
            return match.group(1) + hide(inner) + match.group(1)
        return match.group(0)

    text = _DRIVE.sub("", text)  # a Windows drive letter: the path after it is hidden like any other
    return _TOKEN.sub(token, _QUOTED.sub(quoted, text))


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
        return public_text(value, state_root, pseudonym if isinstance(pseudonym, Pseudonyms) else None)
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
                private_dir(self.path.parent)
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
    """``(public, detail)`` of an exception in site ``site``'s task ``task``, whatever raised it (see the module
    docstring).

    ``public`` may leave the site (error reply, FLARE's logs); ``detail`` is for ``write_local_log`` only.
    ``pseudonyms`` None (no state root): codes and counts, files as ``<file>``.
    """
    from pflseg.data import DataError

    trace = "".join(traceback.format_exception(exc)).rstrip()
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
            parts.append(f"{code} x{count}" + _listed(named))
        public = f"site {site}: task '{task}': {len(problems)} data problem(s): " + "; ".join(parts)
        detail = f"site {site}: task '{task}': {exc}\n" + "".join(
            f"  {n or p.code} = {p}\n" for p, n in zip(problems, names)) + trace
        return public, detail
    files: dict = {}
    if authored(exc):  # pflseg's own words: they leave, without paths or data file names
        message = str(exc) if str(exc).startswith(f"site {site}") else f"site {site}: {exc}"
        public = public_text(message, state_root, pseudonyms, files)
    else:  # anyone else's words stay: the code and the files it names (pseudonyms)
        for path in (getattr(exc, "filename", None), getattr(exc, "filename2", None)):
            if isinstance(path, (str, bytes, os.PathLike)):
                public_text(f"'{os.fsdecode(path)}'", state_root, pseudonyms, files)
        public_text(str(exc), state_root, pseudonyms, files)
        public = f"site {site}: task '{task}' failed: {error_code(exc)}" + _listed(list(files))
    detail = f"site {site}: task '{task}': {type(exc).__name__}: {exc}\n" + "".join(
        f"  {name} = {path}\n" for name, path in files.items()) + trace
    return public, detail


def _listed(names: list[str]) -> str:
    """`` [a, b, +3 more]``: at most ``MAX_NAMED`` pseudonyms; empty without any."""
    if not names:
        return ""
    more = f", +{len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return " [" + ", ".join(names[:MAX_NAMED]) + more + "]"


def error_code(exc: BaseException) -> str:
    """What an exception is, without its words: its type (qualified by its package when it is not a builtin:
    ``PIL.UnidentifiedImageError``) and, for an OS error, its errno's name (``FileNotFoundError (ENOENT)``)."""
    kind = type(exc)
    package = kind.__module__.split(".")[0]
    code = kind.__qualname__ if package == "builtins" else f"{package}.{kind.__qualname__}"
    number = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    return f"{code} ({errno.errorcode[number]})" if number in errno.errorcode else code


def authored(exc: BaseException) -> bool:
    """Whether pflseg wrote ``exc``'s words: its class is pflseg's, or a ``raise`` statement in pflseg's own code
    raised it (not a builtin or library call that failed inside pflseg's code: ``int(name)``, ``d[case]``,
    ``open(path)``)."""
    if type(exc).__module__.split(".")[0] == "pflseg":
        return True
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename)
    if not where.startswith(_PACKAGE + os.sep):
        return False
    return linecache.getline(where, tb.tb_lineno).lstrip().startswith("raise ")


def write_local_log(state_root: str | Path | None, public: str, detail: str) -> str | None:
    """Append ``detail`` (under the ``public`` line it explains) to ``<state_root>/site_errors.log`` (0600, in a
    0700 folder); return how a reply names that file (``<state>/site_errors.log``), None when it could not be
    written."""
    if state_root is None:
        return None
    path = Path(state_root) / LOCAL_LOG
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{stamp} {public}\n{detail}\n\n")
    except OSError:
        return None
    return f"<state>/{LOCAL_LOG}"


def report_local(exc: BaseException, site: str, task: str, state_root: str | Path | None,
                 pseudonyms: Pseudonyms | None) -> str:
    """``exc`` written to the site-local log (``write_local_log``); returns its public line (``public_error``), the
    only text of it that FLARE's log (or a reply) may carry."""
    public, detail = public_error(exc, site, task, state_root, pseudonyms)
    write_local_log(state_root, public, detail)
    return public


# ---- differential privacy of a model update --------------------------------------------------------------
class ReleaseRefused(RuntimeError):
    """A site refuses to release a noised update of a (job, task, round) it released before."""


class Releases:
    """The noised updates a site released: one marker file per (job id, job, task, round) in
    ``<state root>/dp_releases/`` (0700), made with O_EXCL, so two workers of the site cannot both release one."""

    def __init__(self, state_root: str | Path):
        self.root = Path(state_root) / RELEASES

    def claim(self, site: str, job_id: str | None, job: str, task: str, round_num: int | None) -> Path:
        """Record the release of round ``round_num`` of ``task`` in job ``job`` (FLARE id ``job_id``) before it is
        made.

        Raises:
            ReleaseRefused: it was released before; names the job, the round and the marker file.
        """
        parts = [job_id or "no-job-id", job, task, f"round{round_num}"]
        path = private_dir(self.root) / ".".join(re.sub(r"[^A-Za-z0-9_-]+", "_", str(p)) for p in parts)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ReleaseRefused(
                f"site {site}: refusing a second release of round {round_num} of job {job} (job id {job_id}, task "
                f"'{task}'): its noised update left the site once (<state>/{RELEASES}/{path.name}); a second "
                "release with fresh noise would let the server average the noise away. Fix: run a new job; an "
                "operator who knows the first release never left may delete that file") from None
        with os.fdopen(fd, "w") as f:
            f.write(time.strftime("%Y-%m-%d %H:%M:%S\n"))
        return path


def private_update(params: dict, received: FLModel | None, update_cfg: dict, *, site: str, prefixes: tuple,
                   variances: list[str], claim=None) -> tuple[dict, ParamsType]:
    """``params`` as ``privacy.update`` (``update_cfg``) says they leave the site, and their FLARE kind.

    Defaults (``send: weights``, ``dp.clip: null``): ``params`` unchanged, ``ParamsType.FULL``. Otherwise every key
    the site also received (same shape) becomes an update u = sent - received; with ``dp.clip`` C the update of the
    ``prefixes`` keys (the model weights the server aggregates) is clipped to L2 norm C and, with
    ``dp.noise_multiplier`` sigma > 0, N(0, (sigma C)^2) is added per float coordinate
    (``pflseg.algorithms.dp.privatize``; integer buffers untouched; the ``variances`` keys, batch norm's running
    variances, then floored so that received + u >= 0). The noise comes from fresh OS randomness
    (``fresh_generator``): nothing the server knows or chose seeds it; ``claim()`` (``Releases.claim``) is called
    before it is drawn and refuses a second release. ``send: diff`` sends the updates (keys not received as they
    are: an update against zero) with ``ParamsType.DIFF``, FLARE's WEIGHT_DIFF, which the server adds back to what
    it sent and FLARE's filters expect; ``send: weights`` sends received + u for the clipped keys, the rest as
    trained.
    """
    dp = update_cfg["dp"]
    if update_cfg["send"] == "weights" and dp["clip"] is None:
        return params, ParamsType.FULL
    if received is None:
        raise RuntimeError(f"site {site}: this method's reply does not pass the model it received, so "
                           "privacy.update (send: diff, dp) cannot apply; set privacy.update to its defaults")
    sent = received.params or {}
    common = {k for k, v in params.items() if torch.is_tensor(v) and torch.is_tensor(sent.get(k))
              and sent[k].shape == v.shape}
    update = {k: (params[k] - sent[k].to(params[k].device)) if k in common else params[k] for k in params}
    if dp["clip"] is not None:
        covered = sorted(k for k in params if k.startswith(prefixes))
        unsent = [k for k in covered if k not in common]
        if unsent:
            raise RuntimeError(f"site {site}: '{unsent[0]}' was not received in this task, so its update cannot be "
                               "clipped and noised (privacy.update.dp)")
        noised = dp["noise_multiplier"] > 0
        if noised and claim is not None:
            claim()
        private, _ = privatize({k: update[k] for k in covered}, dp["clip"], dp["noise_multiplier"],
                               fresh_generator() if noised else None)
        private = floor_at(private, sent, variances)
        update.update(private)
        if update_cfg["send"] == "weights":
            params = {**params, **{k: (sent[k] + private[k]).to(params[k].dtype) for k in covered}}
    if update_cfg["send"] == "diff":
        return update, ParamsType.DIFF
    return params, ParamsType.FULL
