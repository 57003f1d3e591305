"""The registry's full-network Laplace: the GGN Laplace over every lifted weight at the MAP, with
the linearized predictive (probit for classification, Gaussian for regression; for a
heteroscedastic problem, whose network gives the mean and the log-variance, the GGN is the
Gaussian's Fisher in both outputs and the predictive the mixture over draws of the linearized
outputs: :meth:`~pyro_bdl.guides.laplace.AutoSubnetLaplace.predictive_distribution`).

The MAP is ``problem.init`` when the problem starts from one (the UCI benchmark trains it once
and reuses it), else trained here as the ``map`` method does. The prior precision λ is
``prior_precision`` when it is a number (e.g. tuned on held-out rows with
``predictor.guide.tune_prior_precision``), the marginal-likelihood optimum on the training rows
for ``"marglik"``, else the prior declared in ``bayesianize``. The
posterior is dense in the number of weights D (D² memory), so this is for small networks; the
subnetwork variant (``subnet_laplace``) scales to larger ones (docs/design/laplace.md).

References:
    Daxberger, Kristiadi, Immer, Eschenhagen, Bauer & Hennig, "Laplace Redux — Effortless
    Bayesian Deep Learning", NeurIPS 2021.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from pyro_bdl.app.compare.map import train_map
from pyro_bdl.app.compare.problem import Predictor, Problem, attach_posterior
from pyro_bdl.guides.laplace import AutoSubnetLaplace

__all__ = ["fit_laplace"]


def fit_laplace(
    problem: Problem,
    *,
    prior_precision: float | str | None = None,
    subnetwork: str = "all",
    hessian_structure: str = "full",
) -> Predictor:
    """Fit the full GGN Laplace at the MAP; the predictor carries the fitted guide
    (``predictor.guide``, an :class:`~pyro_bdl.guides.laplace.AutoSubnetLaplace`).

    :param prior_precision: λ > 0, ``"marglik"``, or ``None`` (the declared prior).
    :param str subnetwork: the weights the posterior covers: ``"all"`` (dense D × D), or
        ``"last_layer"`` for networks too wide for that (e.g. the MNIST table's MLP).
    :param str hessian_structure: ``"full"`` (dense), ``"kron"`` (KFAC per layer) or
        ``"diag"``, as :class:`~pyro_bdl.guides.laplace.AutoSubnetLaplace` takes it.
    """
    if isinstance(prior_precision, str) and prior_precision != "marglik":
        raise ValueError(
            f"prior_precision must be a number > 0, 'marglik' or None; got {prior_precision!r}. "
            "Pass 'marglik' to tune it, or a number such as 1.0."
        )
    if problem.init is None:
        _, _, delta = train_map(problem, "laplace")
        problem = dataclasses.replace(
            problem, init={k: v.detach() for k, v in delta.median().items()}
        )
    _, model = problem.bayesian_model()
    make = partial(
        AutoSubnetLaplace,
        model,
        subnetwork=subnetwork,
        hessian_structure=hessian_structure,
        accumulate_dtype=torch.float64,
        batch_size=256,
        init_loc_fn=problem.init_loc_fn(),
    )
    if prior_precision is None or isinstance(prior_precision, str):
        laplace = make()  # the prior declared in bayesianize
    else:
        laplace = make(prior_precision=prior_precision)
    x = problem.dataset.x_train.to(problem.device)
    y = problem.dataset.y_train.to(problem.device)
    laplace(x[:2], y[:2])  # set up the packed MAP point
    laplace.fit((x, y))
    if prior_precision == "marglik":
        laplace.tune_prior_precision(method="marglik")

    def predict(x_test: torch.Tensor):
        if problem.heteroscedastic:
            # The library's 1000 draws of the 2-d linearized outputs (cheap beside the
            # Jacobians; about 3% relative Monte Carlo error in a density), not the
            # problem's num_samples forward passes of the sampling methods.
            g = torch.Generator().manual_seed(problem.seed)
            return laplace.predictive_distribution(x_test, generator=g)
        if problem.is_regression:
            mean, var = laplace.predict(x_test)
            return torch.distributions.Normal(mean.to(x_test), var.to(x_test).sqrt())
        return laplace.predict(x_test, link="probit").to(x_test)

    return attach_posterior(predict, model, laplace)
