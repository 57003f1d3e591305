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
