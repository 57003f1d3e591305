"""The likelihoods' refusals after the network's forward pass: a Gaussian likelihood's range
check reads the network's output, so it can refuse a batch on any call, not only the first; the
refusal leaves the running statistics and the random state as they were, whichever ELBO runs the
model (Pyro's own included)."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models
from tests.faults.common import assert_same, rng_states

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
