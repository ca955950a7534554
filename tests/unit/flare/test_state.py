import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from pflseg.flare.state import RoundStore, StateError, claim, load_file, owner, prefixed, release, save_file, unprefixed


def test_round_store_keeps_last_rounds_and_roundtrips(tmp_path):
    store = RoundStore(tmp_path, keep=2)
    for r in range(4):
        store.save(r, {"round": r, "w": torch.full((2,), float(r))})
    assert store.rounds() == [2, 3] and store.latest() == 3
    assert torch.equal(store.load(3)["w"], torch.full((2,), 3.0))


def test_the_last_saved_round_is_read_back_from_memory_only_while_its_file_is_unchanged(tmp_path):
    """RoundStore.load of the round just saved returns a copy of it (what torch.load would give: CPU tensors, equal
    values), not the object saved and not one the caller's changes reach; a file replaced or cut short since is read
    from disk (and a cut one is the StateError it is)."""
    store = RoundStore(tmp_path)
    saved = {"round": 1, "w": torch.arange(4.0), "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": [0.1]}}
    store.save(1, saved)
    first = store.load(1)
    assert torch.equal(first["w"], saved["w"]) and first["w"] is not saved["w"] and first["optim"]["lr"] == [0.1]
    first["w"].add_(1)
    saved["w"].add_(10)
    assert torch.equal(store.load(1)["w"], torch.arange(4.0)), "the copy is isolated from both sides"
    save_file(store.path(1), {"round": 1, "w": torch.zeros(4)})  # another writer (a new file renamed over it)
    assert torch.equal(store.load(1)["w"], torch.zeros(4))
    store.path(1).write_bytes(store.path(1).read_bytes()[:50])
    with pytest.raises(StateError, match="round_0001.pt"):
        store.load(1)


def test_corrupt_file_is_detected_and_named(tmp_path):
    path = tmp_path / "round_0001.pt"
    save_file(path, {"w": torch.ones(1000)})
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(StateError, match="round_0001.pt"):
        load_file(path)


def test_non_tensor_pickles_are_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"f": print}, path)
    with pytest.raises(StateError, match="evil.pt"):
        load_file(path)  # weights_only refuses arbitrary objects


def test_prefix_roundtrip():
    state = {"a.b": torch.ones(1)}
    flat = prefixed("global", state)
    assert list(flat) == ["global.a.b"] and unprefixed("global", flat) == state


# ---- whose state: owner.json, the lock, an earlier job's state moved aside ---------------------------------
@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "site-1" / "fedbn"
    yield path
    release(path)


def test_claim_records_the_owner_and_a_rerun_of_the_same_job_keeps_its_state(folder):
    assert claim(folder, "simulate_job", resume=False) is None
    assert owner(folder) == "simulate_job" and (folder / ".lock").is_file()
    save_file(folder / "round_0000.pt", {"round": 0})
    release(folder)
    assert claim(folder, "simulate_job", resume=False) is None  # the simulator's next run: the same job id
    assert (folder / "round_0000.pt").is_file()  # left to the job (its round 0 replaces it, as before)


def test_a_fresh_job_of_another_id_moves_the_earlier_state_aside_never_deletes(folder):
    claim(folder, "job-a", resume=False)
    save_file(folder / "round_0003.pt", {"round": 3})
    save_file(folder / "best.pt", {"round": 2})
    release(folder)
    moved = claim(folder, "job-b", resume=False)
    assert moved == folder.with_name("fedbn.job-a")
    assert sorted(p.name for p in moved.iterdir()) == [".lock", "best.pt", "owner.json", "round_0003.pt"]
    assert owner(moved) == "job-a" and owner(folder) == "job-b"
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "owner.json"]  # job-b starts empty
    release(folder)
    save_file(folder / "round_0000.pt", {"round": 0})
    claim(folder, "job-a", resume=False)  # job-a's id again (e.g. the simulator's): its old folder is taken
    assert folder.with_name("fedbn.job-b").is_dir() and moved.is_dir()
    release(folder)
    save_file(folder / "round_0000.pt", {"round": 0})
    assert claim(folder, "job-b", resume=False) == folder.with_name("fedbn.job-a.2")


def test_resume_continues_whatever_is_there_under_the_new_id(folder):
    claim(folder, "job-a", resume=False)
    save_file(folder / "round_0001.pt", {"round": 1})
    release(folder)
    assert claim(folder, "job-b", resume=True) is None
    assert (folder / "round_0001.pt").is_file() and owner(folder) == "job-b"
    assert json.loads((folder / "owner.json").read_text())["previous"] == "job-a"


def test_state_of_unknown_owner_is_moved_aside_too(folder):
    save_file(folder / "round_0000.pt", {"round": 0})  # written before owners were recorded
    assert claim(folder, "job-b", resume=False) == folder.with_name("fedbn.unknown")


def test_a_second_job_of_the_same_name_fails_at_once_naming_the_folder_and_the_job(folder):
    claim(folder, "job-a", resume=False)
    with pytest.raises(StateError) as err:
        claim(folder, "job-b", resume=False)  # the same process
    assert str(folder) in str(err.value) and "job-a" in str(err.value)


def test_the_lock_holds_across_processes(folder):
    script = textwrap.dedent(f"""
        import sys, time
        from pflseg.flare.state import claim
        claim({str(folder)!r}, "job-a", resume=False)
        print("held", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateError, match=rf"{re.escape(str(folder))} is in use by job job-a"):
            claim(folder, "job-b", resume=False, wait=5)  # another job: at once, no waiting
        assert owner(folder) == "job-a" and not folder.with_name("fedbn.job-a").exists()
    finally:
        holder.communicate("")
    claim(folder, "job-b", resume=False)  # free once the other job ended
    assert owner(folder) == "job-b"


@pytest.mark.parametrize("broken", ["save", "replace"])
def test_a_full_disk_is_a_state_error_naming_the_folder_and_leaves_the_old_file(broken, tmp_path, monkeypatch):
    path = tmp_path / "site-1" / "fedbn" / "round_0001.pt"
    save_file(path, {"round": 1, "w": torch.ones(2)})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch if broken == "save" else os, broken, full)
    with pytest.raises(StateError,
                       match=rf"round_0001.pt into state folder {re.escape(str(path.parent))}: No space left "
                       r".*ENOSPC.*free space"):
        save_file(path, {"round": 1, "w": torch.zeros(2)})
    monkeypatch.undo()
    assert sorted(p.name for p in path.parent.iterdir()) == ["round_0001.pt"]  # no temporary left
    assert torch.equal(load_file(path)["w"], torch.ones(2))


def test_state_is_private_whatever_the_umask(tmp_path):
    """Before: state folders 0755 and files 0644 inside the FLARE workspace (a site's models, its lock, results)."""
    previous = os.umask(0o022)
    try:
        folder = tmp_path / "pflseg_state" / "fedavg"
        claim(folder, "job-1", resume=False)
        RoundStore(folder).save(0, {"w": torch.ones(2)})
        (tmp_path / "old").mkdir(mode=0o755)  # a folder an older pflseg made: private once a job claims it
        claim(tmp_path / "old", "job-1", resume=False)
    finally:
        os.umask(previous)
        release(folder)
        release(tmp_path / "old")
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "pflseg_state") == mode(folder) == mode(tmp_path / "old") == 0o700
    assert {p.name: mode(p) for p in folder.iterdir()} == {"owner.json": 0o600, ".lock": 0o600, "round_0000.pt": 0o600}
