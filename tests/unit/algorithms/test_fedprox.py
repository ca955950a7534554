import pytest
import torch
from torch import nn

from pflseg.algorithms.fedprox import proximal_term


def test_proximal_term_closed_form_and_gradient():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 3.0]]))
    anchor = {"weight": torch.tensor([[0.0, 1.0]])}
    term = proximal_term(model, anchor, mu=0.5)
    assert term.item() == pytest.approx(0.25 * (1 + 4))  # mu/2 * ||w - w_g||^2
    term.backward()
    assert torch.allclose(model.weight.grad, 0.5 * torch.tensor([[1.0, 2.0]]))  # mu (w - w_g)


def test_mu_zero_is_fedavg_and_negative_mu_is_an_error():
    model = nn.Linear(2, 1)
    anchor = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    assert proximal_term(model, anchor, 0.0).item() == 0.0
    with pytest.raises(ValueError, match="mu"):
        proximal_term(model, anchor, -1.0)
