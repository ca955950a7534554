"""State on disk: server round checkpoints and each site's personalized state, one file per round.

Files are ``<dir>/round_NNNN.pt`` holding a plain dict (tensors, numbers, strings, nested dicts), written
atomically (temporary file + rename) and read with ``torch.load(weights_only=True)``; a file that cannot
be read whole raises ``StateError`` naming it (no silent partial load). Because everything a site keeps
between rounds is here, results do not depend on how many simulator threads run the sites, and a
stopped run resumes from its last completed round.

Where state lives: ``$PFLSEG_STATE_DIR/<site>/<job>`` when set (``pflseg run`` sets it), else the
site-local config's ``state_dir``, else ``./pflseg_state/<job>`` under the site's working directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

_ROUND_FILE = re.compile(r"round_(\d{4,})\.pt$")


class StateError(RuntimeError):
    """A state file is missing or corrupt."""


def state_dir(site: str, job: str, configured: str | None = None) -> Path:
    env = os.environ.get("PFLSEG_STATE_DIR")
    if env:
        return Path(env) / site / job
    if configured:
        return Path(configured) / job
    return Path.cwd() / "pflseg_state" / job


class RoundStore:
    """Per-round state files in one folder; keeps the last ``keep`` rounds (plus named files)."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep

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
        for old in self.rounds()[: -self.keep] if self.keep else []:
            self.path(old).unlink(missing_ok=True)
        return path

    def load(self, round_num: int) -> dict:
        return load_file(self.path(round_num))

    def clear(self) -> None:
        for r in self.rounds():
            self.path(r).unlink(missing_ok=True)
        self.final_path.unlink(missing_ok=True)

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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


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
