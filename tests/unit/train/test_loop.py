import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from pflseg.train import Hooks, build_loss, derive_seed, evaluate, make_loader, pick_device, train_epochs
from pflseg.train.evaluate import dice_scores


class Squares(Dataset):
    """Two 'cases' of 3 slices each; label = a square; image = the label (so identity is a perfect model)."""

    def __init__(self):
        self.items = []
        for c in range(2):
            for s in range(3):
                lab = torch.zeros(1, 8, 8)
                lab[:, 2:6, 2 + c:6 + c] = 1
                self.items.append({"image": lab.clone(), "label": lab, "case": f"case{c}", "slice": s})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Scale(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(float(w)))

    def forward(self, x):
        return self.w * (x - 0.5)


def test_perfect_model_scores_one_and_cases_are_reassembled():
    out = evaluate(Scale(10.0), Squares(), torch.device("cpu"))
    assert out["dice"] == pytest.approx(1.0) and out["dice_image"] == pytest.approx(1.0)
    assert out["n_cases"] == 2 and out["n_images"] == 6 and set(out["per_case"]) == {"case0", "case1"}


def test_inverted_model_scores_zero():
    assert evaluate(Scale(-10.0), Squares(), torch.device("cpu"))["dice"] == pytest.approx(0.0)


def test_dice_empty_vs_empty_is_one_and_missed_class_is_zero():
    empty = torch.zeros(2, 4, 4, dtype=torch.bool)
    label = empty.clone()
    label[1, 0, 0] = True
    assert dice_scores(empty, empty).tolist() == [1.0, 1.0]
    assert dice_scores(empty, label).tolist() == [1.0, 0.0]


def test_training_reduces_loss_and_extra_loss_hook_is_applied():
    model = Scale(0.1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = make_loader(Squares(), 3, shuffle=True, seed=0)
    calls = []

    def extra(m, batch, logits):
        calls.append(logits.shape)
        return 0.0 * m.w

    first = train_epochs(model, loader, opt, build_loss("dice"), 1, torch.device("cpu"), Hooks(extra_loss=extra))
    later = train_epochs(model, loader, opt, build_loss("dice"), 5, torch.device("cpu"))
    assert len(calls) == first["steps"] == 2 and later["loss"] < first["loss"]


def test_custom_step_replaces_the_default_step():
    model = Scale(1.0)
    seen = []
    hooks = Hooks(step=lambda m, batch, opt, loss_fn: seen.append(batch["image"].shape[0]) or 0.5)
    out = train_epochs(model, make_loader(Squares(), 4, False), torch.optim.SGD(model.parameters(), lr=1),
                       build_loss("dice"),
                       1, torch.device("cpu"), hooks)
    assert seen == [4, 2] and out["loss"] == 0.5 and model.w.item() == 1.0


def test_non_finite_loss_stops_with_advice():
    model = Scale(float("nan"))
    with pytest.raises(FloatingPointError, match="train.lr"):
        train_epochs(model, make_loader(Squares(), 6, False), torch.optim.SGD(model.parameters(), lr=1),
                     build_loss("dice_ce"), 1, torch.device("cpu"))


def test_seeds_are_stable_and_distinct():
    assert derive_seed(0, "site-1", 3) == derive_seed(0, "site-1", 3)
    assert len({derive_seed(0, f"site-{k}", r) for k in range(3) for r in range(3)}) == 9


def test_device_selection():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            pick_device("cuda")


def test_build_optimizer_puts_loaded_state_on_the_parameters_device():
    """The state is loaded after the model is on the device (here "meta", a device other than the CPU where
    the state was saved): a model moved after loading would leave its moments on the CPU."""
    from pflseg.train import build_optimizer

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    fresh = torch.nn.Linear(3, 2)
    rebuilt = build_optimizer(fresh, torch.device("meta"), 0.1, opt.state_dict())
    params = {p.device.type for p in fresh.parameters()}
    moments = {v.device.type for s in rebuilt.state.values() for k, v in s.items() if k != "step"}
    assert params == moments == {"meta"}
