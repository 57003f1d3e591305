"""The likelihoods' refusals: a Gaussian likelihood's range check reads the network's output, so
it can refuse a batch on any call, not only the first, and the refusal leaves the running
statistics and the random state as they were, whichever ELBO runs the model (Pyro's own
included); a non-finite mean is named as the network's; complex labels are refused by dtype;
labels are checked against the width of the logits, not only the last layer's."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models
from tests.faults.common import assert_same, rng_states
from tests.test_models import _TokenLM, _tokens

N = 32


def _net(outputs: int):
    torch.manual_seed(0)
    return bayesianize(
        nn.Sequential(
            nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, outputs)
        )
    )


REGRESSORS = {
    "fixed": lambda: models.regressor(_net(1), N, 0.5),
    "point": lambda: models.regressor(_net(1), N, 0.5, noise="point"),
    "learned": lambda: models.regressor(_net(1), N, noise="learned"),
    "heteroscedastic": lambda: models.heteroscedastic_regressor(_net(2), N),
}


@pytest.mark.parametrize("noise", list(REGRESSORS))
def test_a_range_refusal_after_the_first_call_leaves_buffers_and_rng(noise):
    model = REGRESSORS[noise]()
    x, y = torch.randn(16, 3), torch.randn(16)
    model(x, y)
    model(x, y)  # past the first call, which runs under rollback anyway
    before = {
        "buffers": {k: v.clone() for k, v in model.net.state_dict().items()},
        "rng": rng_states(),
        "params": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
    }
    with pytest.raises(ValueError, match=r"the Gaussian likelihood overflows torch\.float32"):
        model(x, y * 1e30)
    after = {
        "buffers": dict(model.net.state_dict()),
        "rng": rng_states(),
        "params": {k: v.detach() for k, v in pyro.get_param_store().items()},
    }
    assert_same(before, after)


def _with_bias(net: nn.Module, column: int, value: float) -> nn.Module:
    with torch.no_grad():
        net.bias[column] = value
    return net


@pytest.mark.parametrize(
    "make",
    [
        lambda: models.regressor(_with_bias(nn.Linear(3, 1), 0, float("nan")), N, 1.0),
        lambda: models.heteroscedastic_regressor(_with_bias(nn.Linear(3, 2), 0, float("inf")), N),
    ],
    ids=["regressor", "heteroscedastic"],
)
def test_a_non_finite_mean_is_named_as_the_networks_output_not_an_overflow(make):
    # The inputs and targets are finite (checked before the network runs): a NaN or inf mean
    # comes from the network's weights, and "standardise the targets" would not help.
    with pytest.raises(ValueError, match=r"the network's output \(the Gaussian's mean\) holds 6 "):
        make()(torch.randn(6, 3), torch.randn(6))


@pytest.mark.parametrize(
    "make,labels",
    [
        (lambda: models.classifier(nn.Linear(3, 4), N), torch.tensor([0, 1, 2, 3, 0, 1])),
        (lambda: models.binary_classifier(nn.Linear(3, 1), N), torch.tensor([0, 1, 1, 0, 0, 1])),
        (lambda: models.multilabel_classifier(nn.Linear(3, 2), N), torch.ones(6, 2)),
        (lambda: models.language_model(_TokenLM(), N), torch.ones(6, 5, dtype=torch.long)),
    ],
    ids=["categorical", "binary", "multilabel", "tokens"],
)
def test_complex_labels_are_refused_by_dtype(make, labels):
    model = make()
    x = _tokens(rows=6, vocab=7) if model.likelihood == "tokens" else torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"torch\.complex64"):
        model(x, labels.to(torch.complex64))


class _FirstTwo(nn.Sequential):
    """A Sequential whose forward keeps 2 of its last layer's outputs: the width read from the
    layers (4) is not the width of the logits (2)."""

    def forward(self, x):
        return super().forward(x)[..., :2]


@pytest.mark.parametrize("validation", [False, True])
def test_labels_are_checked_against_the_logits_width_not_the_last_layers(validation):
    # Label 3 passes the check against the last layer's 4 outputs; against the 2 logits it is
    # out of range (a gather out of bounds: on a GPU, a device-side assert that ends the process).
    pyro.enable_validation(validation)
    classifier = models.classifier(bayesianize(_FirstTwo(nn.Linear(3, 4))), N)
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 2\); got min 0, max 3"):
        classifier(torch.randn(3, 3), torch.tensor([0, 1, 3]))
    lm = models.language_model(bayesianize(_FirstTwo(nn.Embedding(5, 4), nn.Linear(4, 4))), N)
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"token labels must lie in \[0, 2\) or be -100"):
        lm(ids, torch.tensor([[0, 1, 3], [1, 0, 1]]))
