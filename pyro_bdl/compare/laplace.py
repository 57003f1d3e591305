"""Subnetwork linearized Laplace: MAP training with the guide as a point estimate, then the GGN
Laplace over the 1,000 weights (at most) of largest diagonal-Laplace variance, the probit
predictive, and the prior precision tuned by the subnetwork's marginal likelihood."""

from __future__ import annotations

import pyro
from pyro.infer import SVI, Trace_ELBO

from pyro_bdl.compare.problem import Predictor, Problem, train_svi
from pyro_bdl.guides.laplace import AutoSubnetLaplace
from pyro_bdl.priors import Normal

#: S: the paper's subnetworks are a few thousand weights; 1,000 keeps fit under a few seconds.
SUBNETWORK_SIZE = 1000


def fit_subnet_laplace(problem: Problem) -> Predictor:
    _, model = problem.bayesian_model()
    scale = problem.prior.scale if isinstance(problem.prior, Normal) else 1.0
    total = sum(p.numel() for p in problem.net().parameters())
    guide = AutoSubnetLaplace(
        model,
        subnetwork="largest_variance",
        size=min(SUBNETWORK_SIZE, total),
        prior_precision=1.0 / scale**2,
        batch_size=128,
    )
    svi = SVI(model, guide, pyro.optim.Adam({"lr": problem.lr}), Trace_ELBO())
    train_svi(problem, svi, "subnet_laplace")
    x = problem.dataset.x_train.to(problem.device)
    y = problem.dataset.y_train.to(problem.device)
    guide.fit((x, y))
    guide.tune_prior_precision(method="marglik")
    return lambda x_test: guide.predict(x_test, link="probit").float()
