"""Mean-field Gaussian (Bayes by Backprop) and Radial VI for ``pyro-bdl compare``.

Both train ``SVI`` with :class:`~pyro_bdl.infer.TraceSuffStat_ELBO`: the exact KL where one is
registered (the Normal prior; the guides put the posterior on each weight site itself), else a
``problem.num_kl_samples``-sample estimate at the memory of one; it also skips the latent sites'
unused log-densities, which makes a step ≈ 1.2–1.6× cheaper than ``TraceMeanField_ELBO``. They
predict by averaging ``problem.num_samples`` posterior draws. Under ``Problem.sigma == "own"`` a
regression σ is one more latent site (prior ``LogNormal(0, 1)`` over the standardised target's
noise), inferred with the weights and drawn with them in the predictive.
"""

from __future__ import annotations

from pyro.infer import SVI

from pyro_bdl.app.compare.problem import Predictor, Problem, train_svi
from pyro_bdl.guides import AutoMeanField, AutoRadial
from pyro_bdl.infer import TraceSuffStat_ELBO

__all__ = ["fit_meanfield", "fit_radial"]

#: Initial posterior scale: small against the MLP's weights (≈ 0.1), as
#: docs/design/variational.md advises.
INIT_SCALE = 1e-2


def _fit(problem: Problem, guide_cls, desc: str, init_scale: float) -> Predictor:
    _, model = problem.bayesian_model(noise="learned")
    guide = guide_cls(model, init_scale=init_scale, init_loc_fn=problem.init_loc_fn())
    elbo = TraceSuffStat_ELBO(num_kl_samples=problem.num_kl_samples)
    svi = SVI(model, guide, problem.optimizer(), elbo)
    train_svi(problem, svi, desc)
    return problem.predictor(model, guide)


def fit_meanfield(problem: Problem, *, init_scale: float = INIT_SCALE) -> Predictor:
    """Mean-field Gaussian VI with :class:`~pyro_bdl.guides.AutoMeanField`, every posterior
    scale starting at ``init_scale``."""
    return _fit(problem, AutoMeanField, "meanfield", init_scale)


def fit_radial(problem: Problem, *, init_scale: float = INIT_SCALE) -> Predictor:
    """Radial VI with :class:`~pyro_bdl.guides.AutoRadial`."""
    return _fit(problem, AutoRadial, "radial", init_scale)
