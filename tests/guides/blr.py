"""Bayesian linear regression (tests/scenarios.py) as a model whose weight site can be batched.

``models.regressor`` runs ``nn.Linear``, which cannot take a batch of weight tensors; the model
here computes the same mean ``x @ wᵀ`` by broadcasting, so ``TraceMeanField_ELBO`` can draw many
particles in one vectorized pass (the noise of the gradient falls as 1/√particles).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist

from tests.scenarios import BayesianLinearRegression


def batched_model(scenario: BayesianLinearRegression):
    """``model(x, y)`` over the scenario's lifted ``Linear(d, 1)``; the site is ``"weight"``."""
    net = scenario.network()
    # weight has shape (..., 1, d); one output row, broadcast against x of shape (n, d).
    net.forward = lambda x: (net.weight[..., 0, :] * x).sum(-1)

    def model(x, y=None):
        mean = net(x)
        with pyro.plate("data", scenario.n):
            pyro.sample("y", dist.Normal(mean, scenario.noise), obs=y)
        return mean

    model.net = net  # type: ignore[attr-defined]
    return model
