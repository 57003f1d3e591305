"""SWAG and SWAG-diag: SGD with momentum on the MAP objective, then a constant-rate SWAG phase.

The first ``1 − SWAG_FRACTION`` of the epochs train the point estimate; the rest keep the same
SGD and collect a snapshot every c steps, with c chosen to gather about ``2 · rank`` snapshots
(so the ring buffer of the last ``rank`` deviations is full and the moments average over twice as
many). Predictions average softmax over ``problem.num_samples`` draws, refreshing BatchNorm for
each draw when the network has BatchNorm.
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_bdl.compare.problem import Predictor, Problem, attach_posterior
from pyro_bdl.guides.batchnorm import predict_with_bn_refresh
from pyro_bdl.guides.swag import AutoSWAG

__all__ = ["fit_swag", "fit_swag_diag", "train_swag"]

#: Learning rate on the *per-example* loss; Pyro's ELBO sums over N examples, so the optimiser
#: gets ``SGD_LR / N``. With momentum 0.9 this trains the compare MLP and CNN stably.
SGD_LR = 0.05
#: The constant learning rate of the SWAG phase (same convention): higher than the SGD phase's,
#: so the iterates explore the basin around the SGD solution.
SWA_LR = 0.1
MOMENTUM = 0.9
#: Share of the epochs spent in the SWAG phase (at least one epoch).
SWAG_FRACTION = 0.25
RANK = 20
#: Fraction of the training inputs used to refresh BatchNorm for each draw.
BN_FRACTION = 0.25


def _svi(model, guide, lr: float, n: int) -> SVI:
    # Pyro's ELBO sums the likelihood over the N examples, so a per-example rate is divided by N.
    return SVI(model, guide, pyro.optim.SGD({"lr": lr / n, "momentum": MOMENTUM}), Trace_ELBO())


def train_swag(problem: Problem, guide: AutoSWAG, model, desc: str) -> torch.Tensor:
    """SGD with momentum on the MAP objective through ``guide``, then the SWAG phase: a constant
    rate ``SWA_LR`` with a snapshot every c steps.

    :returns: the SGD point estimate at the end of the SGD phase (a copy of ``guide.loc``).
    """
    n = problem.num_train
    swag_epochs = max(1, round(SWAG_FRACTION * problem.epochs))
    first_swag_epoch = max(0, problem.epochs - swag_epochs)
    steps_per_epoch = math.ceil(n / problem.batch_size)
    every = max(1, (problem.epochs - first_swag_epoch) * steps_per_epoch // (2 * guide.rank))
    svi = _svi(model, guide, SGD_LR, n)
    sgd_loc: torch.Tensor | None = None
    bar = problem.epoch_bar(desc)
    step = 0
    for epoch in bar:
        if epoch == first_swag_epoch:
            if epoch > 0:
                sgd_loc = guide.loc.detach().clone()
            svi = _svi(model, guide, SWA_LR, n)
        total = 0.0
        for x, y in problem.batches(epoch):
            total += svi.step(x, y)
            if epoch >= first_swag_epoch:
                step += 1
                if step % every == 0:
                    guide.collect()
        bar.set_postfix(loss=f"{total / n:.3f}", snapshots=guide.num_collected)
    extra = problem.epochs
    while guide.num_collected < 2:  # tiny runs: make sure the posterior exists
        for x, y in problem.batches(extra):
            svi.step(x, y)
        guide.collect()
        extra += 1
    return guide.loc.detach().clone() if sgd_loc is None else sgd_loc


def _fit(problem: Problem, *, diag_only: bool, desc: str) -> Predictor:
    bnn, model = problem.bayesian_model()
    guide = AutoSWAG(model, rank=RANK, diag_only=diag_only)
    train_swag(problem, guide, model, desc)
    x_train = problem.dataset.x_train.to(problem.device)

    def predict(x):
        return predict_with_bn_refresh(
            guide,
            bnn,
            x,
            num_samples=problem.num_samples,
            bn_data=x_train,
            bn_fraction=BN_FRACTION,
        )

    return attach_posterior(predict, model, guide)


def fit_swag(problem: Problem) -> Predictor:
    return _fit(problem, diag_only=False, desc="swag")


def fit_swag_diag(problem: Problem) -> Predictor:
    return _fit(problem, diag_only=True, desc="swag_diag")
