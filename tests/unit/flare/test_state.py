import pytest
import torch

from pflseg.flare.state import RoundStore, StateError, load_file, prefixed, save_file, unprefixed


def test_round_store_keeps_last_rounds_and_roundtrips(tmp_path):
    store = RoundStore(tmp_path, keep=2)
    for r in range(4):
        store.save(r, {"round": r, "w": torch.full((2,), float(r))})
    assert store.rounds() == [2, 3] and store.latest() == 3
    assert torch.equal(store.load(3)["w"], torch.full((2,), 3.0))


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
