"""The stop check of the one training loop (``pflseg.train.loop.stop_when``, ``TaskAborted``): an aborted task stops
before its next batch, its model and optimizer left mid-way; without a stop condition nothing differs."""

import threading

import pytest
import torch
from torch import nn

from pflseg.train import Hooks, build_loss, make_loader, train_epochs
from pflseg.train.loop import TaskAborted, stop_when
from tests.unit.train.test_loop import Squares

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class Counted(nn.Module):
    """A loss that counts the batches it is computed on."""

    def __init__(self):
        super().__init__()
        self.loss, self.calls = build_loss("dice"), 0

    def forward(self, logits, label):
        self.calls += 1
        return self.loss(logits, label)


def run(epochs=3, batch_size=2, hooks=None):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = Counted()
    return model, opt, loss, lambda: train_epochs(model, make_loader(Squares(), batch_size, True, seed=1), opt, loss,
                                                  epochs, CPU, hooks)


def test_training_stops_before_the_batch_after_the_condition_holds_and_is_left_mid_way():
    model, opt, loss, train = run()  # 3 epochs of 3 batches: 9 in all
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with stop_when(lambda: loss.calls >= 4), pytest.raises(TaskAborted, match="after 4 batch"):
        train()
    assert loss.calls == 4  # the 5th batch (epoch 2) was never begun
    assert {s["step"].item() for s in opt.state_dict()["state"].values()} == {4}  # 4 steps of 9
    assert not all(torch.equal(start[k], v) for k, v in model.state_dict().items())  # trained, mid-way

    full, _, _, train_full = run()
    train_full()
    assert not all(torch.equal(full.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_condition_that_holds_from_the_start_trains_nothing_and_a_custom_step_stops_too():
    model, opt, loss, train = run()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with stop_when(lambda: True), pytest.raises(TaskAborted, match="after 0 batch"):
        train()
    assert loss.calls == 0 and all(torch.equal(start[k], v) for k, v in model.state_dict().items())

    seen = []
    model, opt, loss, train = run(hooks=Hooks(step=lambda m, batch, o, f: seen.append(1) or 0.5))
    with stop_when(lambda: len(seen) >= 2), pytest.raises(TaskAborted):
        train()
    assert len(seen) == 2


def test_without_a_stop_or_with_one_that_never_holds_training_is_bit_identical():
    plain, plain_opt, _, train = run()
    out = train()
    checked, checked_opt, _, train = run()
    with stop_when(lambda: False):
        checked_out = train()
    assert out == checked_out
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in checked.state_dict().items())
    assert str(plain_opt.state_dict()) == str(checked_opt.state_dict())


def test_the_condition_belongs_to_its_thread_and_its_block():
    errors = []

    def elsewhere():  # another thread sees no condition
        try:
            run(epochs=1)[3]()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with stop_when(lambda: True):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join(30)
        with stop_when(None):  # nested: none inside, the outer one again after it
            run(epochs=1)[3]()
        with pytest.raises(TaskAborted):
            run(epochs=1)[3]()
    run(epochs=1)[3]()  # none after the block
    assert errors == []


def test_an_aborted_task_is_no_exception_an_error_handler_would_catch():
    assert not issubclass(TaskAborted, Exception) and issubclass(TaskAborted, BaseException)
