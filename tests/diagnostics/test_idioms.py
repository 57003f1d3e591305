"""Everyday PyTorch habits with the diagnostics: predictions passed straight from a network,
still carrying its graph."""

import pytest
import torch

from pyro_bdl import diagnostics

CLASSIFICATION = {
    "nll": diagnostics.nll,
    "ece": diagnostics.ece,
    "reliability": lambda p, y: diagnostics.reliability(p, y).mce,
}


@pytest.mark.parametrize("metric", CLASSIFICATION.values(), ids=CLASSIFICATION.keys())
def test_classification_metrics_take_probabilities_that_require_grad(metric):
    # ece read them into numpy ("Can't call numpy() on Tensor that requires grad") and nll
    # warned about a scalar that requires grad.
    logits = torch.randn(20, 3, requires_grad=True)
    probs, y = torch.softmax(logits, -1), torch.randint(0, 3, (20,))
    assert metric(probs, y) == metric(probs.detach(), y)


def test_temperature_scale_passes_the_gradient_to_a_tensor_temperature():
    # float(T) cut T from the graph: a T fitted by gradient descent silently stayed where it
    # started.
    logits, y = torch.randn(30, 4), torch.randint(0, 4, (30,))
    temperature = torch.tensor(2.0, requires_grad=True)
    probs = diagnostics.temperature_scale(logits, temperature)
    assert torch.equal(probs, diagnostics.temperature_scale(logits, 2.0))
    nll = -probs.gather(-1, y.unsqueeze(-1)).log().mean()
    nll.backward()
    # d NLL / d T = -(1/T²) · d NLL / d β at β = 1/T, with dL/dβ = mean(E_p[z] - z_y).
    p = probs.detach()
    slope = ((p * logits).sum(-1) - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)).mean()
    torch.testing.assert_close(temperature.grad, -slope / 4.0)


def test_temperature_scale_refuses_several_temperatures_naming_the_shape():
    with pytest.raises(ValueError, match=r"temperature must be one number.*\(2,\)"):
        diagnostics.temperature_scale(torch.randn(3, 4), torch.tensor([1.0, 2.0]))
