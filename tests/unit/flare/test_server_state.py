"""ServerState with tiny hand-made parts: the flat checkpoint each kind gives, restore (a part the file lacks keeps its
fresh value), the guard's snapshot / rollback over the guarded parts only, and undeclared state refused."""

import math

import pytest
import torch

from pflseg.flare.server_state import BY_SITE, NET, ServerState


def tiny() -> ServerState:
    state = ServerState(["a", "b"])
    state.add("history", [])
    state.add("global_state", {"w": torch.tensor([1.0])}, NET, "global", guarded=True)
    state.add("person", {"a": {"w": torch.tensor([2.0])}, "b": {"w": torch.tensor([3.0])}}, BY_SITE, "person",
              guarded=True)
    state.add("heads", {}, BY_SITE, "heads")
    return state


def test_each_kind_is_saved_flat_in_the_order_declared():
    state = tiny()
    state.history.append({"round": 1})
    state.heads = {"b": {"bias": torch.tensor([0.5])}}
    ckpt = state.checkpoint()
    assert list(ckpt) == ["history", "global.w", "person.a.w", "person.b.w", "heads.b.bias"]
    assert ckpt["history"] == [{"round": 1}] and float(ckpt["person.b.w"]) == 3.0


def test_restore_puts_a_checkpoint_back_and_keeps_what_it_lacks():
    saved = tiny()
    saved.global_state = {"w": torch.tensor([9.0])}
    saved.person = {"a": {"w": torch.tensor([8.0])}, "b": {"w": torch.tensor([7.0])}}
    saved.history.append({"round": 1})
    ckpt = saved.checkpoint()
    del ckpt["history"]  # a checkpoint written before this part existed
    state = tiny()
    state.restore(ckpt)
    assert float(state.global_state["w"]) == 9.0 and float(state.person["b"]["w"]) == 7.0
    assert state.history == [] and state.heads == {}  # not in the file: fresh
    ckpt["history"] = [{"round": 1}]
    state.restore(ckpt)
    ckpt["history"].append({"round": 2})
    assert state.history == [{"round": 1}]  # a copy, not the checkpoint's list


def test_rollback_restores_the_guarded_parts_and_names_the_bad_value():
    state = tiny()
    before = state.snapshot()
    assert sorted(before) == ["global_state", "person"]
    assert state.first_nonfinite() is None
    state.history.append({"round": 1})
    state.person = {**state.person, "b": {"w": torch.tensor([math.nan])}}
    assert state.first_nonfinite() == "'person.b.w' holds NaN or Inf"
    state.rollback(before)
    assert float(state.person["b"]["w"]) == 3.0 and state.first_nonfinite() is None
    assert state.history == [{"round": 1}]  # not guarded: untouched


def test_undeclared_or_twice_declared_state_is_refused():
    state = tiny()
    with pytest.raises(AttributeError, match=r"no part 'momentum': declare it .*state\.add\('momentum'"):
        state.momentum = {}
    with pytest.raises(AttributeError, match=r"no part 'momentum' \(declared: history, global_state"):
        state.momentum
    with pytest.raises(ValueError, match="'history' is declared twice"):
        state.add("history", [])
    with pytest.raises(ValueError, match="kind 'dict' is not one of"):
        state.add("x", {}, "dict")
