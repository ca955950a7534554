"""The pseudonym salt: made whole or not at all, private, and refused when it is not a salt."""

import os
import stat

import pytest

from pflseg.flare.privacy import SALT_FILE, Pseudonyms


def test_the_salt_is_made_once_private_and_gives_stable_pseudonyms(tmp_path):
    first = Pseudonyms(tmp_path / "state")
    name = first("case001")
    path = tmp_path / "state" / SALT_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
    assert Pseudonyms(tmp_path / "state")("case001") == name != first("case002")
    assert [p.name for p in path.parent.iterdir()] == [SALT_FILE]  # no temporary file left behind


def test_a_full_disk_leaves_no_empty_salt(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # where a full disk shows itself for a small buffered write
    with pytest.raises(OSError, match="No space"):
        Pseudonyms(tmp_path)("case001")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # nothing anyone could recompute pseudonyms under


def test_a_file_that_is_no_salt_is_an_error_naming_it(tmp_path):
    (tmp_path / SALT_FILE).write_text("")
    with pytest.raises(ValueError, match=f"{SALT_FILE}: not a pseudonym salt"):
        Pseudonyms(tmp_path)("case001")
