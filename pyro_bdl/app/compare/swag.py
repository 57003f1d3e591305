"""SWAG and SWAG-diag: SGD with momentum on the MAP objective, then a constant-rate SWAG phase.

The first ``1 − SWAG_FRACTION`` of the epochs train the point estimate; the rest keep the same
SGD and collect a snapshot every c steps, with c chosen to gather about ``2 · rank`` snapshots
(so the ring buffer of the last ``rank`` deviations is full and the moments average over twice as
many). When the problem starts from a trained point estimate (``Problem.init``), every epoch is
the SWAG phase, as in the paper's use from a pretrained solution. Classification predictions
average softmax over ``problem.num_samples`` draws, refreshing BatchNorm for each draw when the
network has BatchNorm; regression predictions are the mixture over draws. Under
``Problem.sigma == "own"`` a regression σ is a point estimate trained with the SGD/SWAG iterates
(maximum likelihood, starting from ``Problem.noise``), not part of the SWAG posterior.

References:
    Maddox, Izmailov, Garipov, Vetrov & Wilson, "A Simple Baseline for Bayesian Uncertainty in
    Deep Learning", NeurIPS 2019.
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.app.compare.problem import Predictor, Problem, attach_posterior, train_loop
from pyro_bdl.guides.batchnorm import predict_with_bn_refresh
from pyro_bdl.guides.swag import AutoSWAG

__all__ = ["data_scaled", "fit_swag", "fit_swag_diag", "train_swag"]

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


def data_scaled(problem: Problem, rate: float) -> float:
    """A per-example SGD ``rate`` scaled to the data: for regression, times min(1, σ²), since the
    Gaussian likelihood's per-example curvature grows as 1/σ² (a rate stable at σ = 1 diverges at
    σ = 0.1 on a dataset the rate was never tried on); classification keeps ``rate``."""
    if problem.is_regression and problem.noise is not None:
        return rate * min(1.0, float(problem.noise) ** 2)
    return rate


def _svi(model, guide, lr: float, n: int, optimizer: str) -> SVI:
    if optimizer == "adam":
        return SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    # Pyro's ELBO sums the likelihood over the N examples, so a per-example rate is divided by N.
    return SVI(model, guide, pyro.optim.SGD({"lr": lr / n, "momentum": MOMENTUM}), Trace_ELBO())


def train_swag(
    problem: Problem,
    guide: AutoSWAG,
    model,
    desc: str,
    *,
    swa_lr: float = SWA_LR,
    optimizer: str = "sgd",
    snapshots: int | None = None,
    sgd_lr: float = SGD_LR,
) -> torch.Tensor:
    """SGD with momentum on the MAP objective through ``guide``, then the SWAG phase: a constant
    rate ``swa_lr`` with a snapshot every c steps (no SGD phase when ``problem.init`` is given).

    :param str optimizer: the SWAG phase's optimiser: ``"sgd"`` (with momentum; ``swa_lr`` is a
        per-example rate) or ``"adam"`` (``swa_lr`` is Adam's rate).
    :param int snapshots: about how many snapshots to gather (default ``2 · rank``).
    :param float sgd_lr: the SGD phase's per-example rate.
    :returns: the SGD point estimate at the end of the SGD phase (a copy of ``guide.loc``).
    """
    check_choice("optimizer", optimizer, ("sgd", "adam"))
    n = problem.num_train
    swag_epochs = (
        problem.epochs
        if problem.init is not None
        else max(1, round(SWAG_FRACTION * problem.epochs))
    )
    first_swag_epoch = max(0, problem.epochs - swag_epochs)
    steps_per_epoch = math.ceil(n / problem.batch_size)
    target = 2 * guide.rank if snapshots is None else check_positive_int("snapshots", snapshots)
    every = max(1, (problem.epochs - first_swag_epoch) * steps_per_epoch // target)
    state: dict = {"svi": _svi(model, guide, sgd_lr, n, "sgd"), "sgd_loc": None, "step": 0}

    def on_epoch(epoch: int) -> None:
        state["swag"] = epoch >= first_swag_epoch
        if epoch == first_swag_epoch:
            if epoch > 0:
                state["sgd_loc"] = guide.loc.detach().clone()
            state["svi"] = _svi(model, guide, swa_lr, n, optimizer)

    def on_step(_: int) -> None:
        if state["swag"]:
            state["step"] += 1
            if state["step"] % every == 0:
                guide.collect()

    train_loop(
        problem,
        lambda x, y: state["svi"].step(x, y),
        desc,
        on_epoch=on_epoch,
        on_step=on_step,
        status=lambda: {"snapshots": guide.num_collected},
    )
    svi = state["svi"]
    sgd_loc = state["sgd_loc"]
    extra = problem.epochs
    while guide.num_collected < 2:  # tiny runs: make sure the posterior exists
        for x, y in problem.batches(extra):
            svi.step(x, y)
        guide.collect()
        extra += 1
    return guide.loc.detach().clone() if sgd_loc is None else sgd_loc


def _fit(problem: Problem, *, diag_only: bool, desc: str, **schedule) -> Predictor:
    bnn, model = problem.bayesian_model(noise="point")
    guide = AutoSWAG(model, rank=RANK, diag_only=diag_only, init_loc_fn=problem.init_loc_fn())
    train_swag(problem, guide, model, desc, **schedule)
    if problem.is_regression:
        return problem.predictor(model, guide)
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


def fit_swag(
    problem: Problem,
    *,
    swa_lr: float = SWA_LR,
    optimizer: str = "sgd",
    snapshots: int | None = None,
) -> Predictor:
    """SWAG (rank-``RANK`` plus diagonal covariance); the keywords set the SWAG phase as in
    :func:`train_swag`."""
    schedule = {"swa_lr": swa_lr, "optimizer": optimizer, "snapshots": snapshots}
    return _fit(problem, diag_only=False, desc="swag", **schedule)


def fit_swag_diag(
    problem: Problem,
    *,
    swa_lr: float = SWA_LR,
    optimizer: str = "sgd",
    snapshots: int | None = None,
) -> Predictor:
    """SWAG-diag (diagonal covariance only); keywords as :func:`fit_swag`."""
    schedule = {"swa_lr": swa_lr, "optimizer": optimizer, "snapshots": snapshots}
    return _fit(problem, diag_only=True, desc="swag_diag", **schedule)
