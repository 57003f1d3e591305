"""The point-estimate baseline: MAP under the same prior, trained with SVI and ``AutoDelta``."""

from __future__ import annotations

from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.app.compare.problem import Predictor, Problem, train_svi

__all__ = ["fit_map", "train_map"]


def train_map(problem: Problem, desc: str = "map"):
    """``(bnn, model, guide)``: the MAP network trained on ``problem``'s training rows, starting
    from ``problem.init`` when given. Under ``problem.sigma == "own"`` a regression MAP learns σ
    as a point estimate with the weights (the maximum of the joint density over weights and σ)."""
    bnn, model = problem.bayesian_model(noise="point")
    guide = AutoDelta(model, init_loc_fn=problem.init_loc_fn())
    svi = SVI(model, guide, problem.optimizer(), Trace_ELBO())
    train_svi(problem, svi, desc)
    return bnn, model, guide


def fit_map(problem: Problem) -> Predictor:
    """The MAP's predictive (one draw of the point mass); ``predictor.guide.median()`` holds the
    MAP site values."""
    _, model, guide = train_map(problem)
    return problem.predictor(model, guide, num_samples=1)
