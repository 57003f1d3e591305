"""Mean-field Gaussian (Bayes by Backprop) and Radial VI for ``pyro-bdl compare``.

Both train ``SVI`` with ``TraceMeanField_ELBO`` (the exact KL to the Normal prior, since the guides
put the posterior on each weight site itself) and predict by averaging ``problem.num_samples``
posterior draws.
"""

from __future__ import annotations

import pyro
from pyro.infer import SVI, TraceMeanField_ELBO

from pyro_bdl.compare.problem import Predictor, Problem, predictive_probs, train_svi
from pyro_bdl.guides import AutoMeanField, AutoRadial

__all__ = ["fit_meanfield", "fit_radial"]

#: Initial posterior scale: small against the MLP's weights (≈ 0.1), as DESIGN.md 4.2 advises.
INIT_SCALE = 1e-2


def _fit(problem: Problem, guide_cls, desc: str) -> Predictor:
    _, model = problem.bayesian_model()
    guide = guide_cls(model, init_scale=INIT_SCALE)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": problem.lr}), TraceMeanField_ELBO())
    train_svi(problem, svi, desc)
    return lambda x: predictive_probs(model, guide, x, num_samples=problem.num_samples)


def fit_meanfield(problem: Problem) -> Predictor:
    """Mean-field Gaussian VI with :class:`~pyro_bdl.guides.AutoMeanField`."""
    return _fit(problem, AutoMeanField, "meanfield")


def fit_radial(problem: Problem) -> Predictor:
    """Radial VI with :class:`~pyro_bdl.guides.AutoRadial`."""
    return _fit(problem, AutoRadial, "radial")
