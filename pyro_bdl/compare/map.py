"""The point-estimate baseline: MAP under the same prior, trained with SVI and ``AutoDelta``."""

from __future__ import annotations

import pyro
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.compare.problem import Predictor, Problem, predictive_probs, train_svi
from pyro_bdl.nn import init_to_network

__all__ = ["fit_map", "train_map"]


def train_map(problem: Problem, desc: str = "map"):
    """``(bnn, model, guide)``: the MAP network trained on ``problem``'s training rows."""
    bnn, model = problem.bayesian_model()
    guide = AutoDelta(model, init_loc_fn=init_to_network)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": problem.lr}), Trace_ELBO())
    train_svi(problem, svi, desc)
    return bnn, model, guide


def fit_map(problem: Problem) -> Predictor:
    _, model, guide = train_map(problem)
    return lambda x: predictive_probs(model, guide, x, num_samples=1)
