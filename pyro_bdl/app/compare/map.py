"""The point-estimate baseline: MAP under the same prior, trained with SVI and ``AutoDelta``;
optionally with the adversarial training of Lakshminarayanan et al. (2017)."""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl._validation import check_positive
from pyro_bdl.app.compare.problem import Predictor, Problem, train_loop, train_svi

__all__ = ["fit_map", "train_map"]


def _adversarial_step(problem: Problem, model, guide, epsilon: float):
    """One step of ``(loss(x) + loss(x_adv)) / 2`` with x_adv = x + ε·range·sign(∇ₓ loss), the
    fast-gradient-sign example of the deep-ensembles paper (ε a share of each input's range over
    the training rows). The mean of the two keeps the prior's weight in the objective."""
    x_train = problem.dataset.x_train.to(problem.device)
    step_size = epsilon * (x_train.max(0).values - x_train.min(0).values)
    elbo = Trace_ELBO()
    with poutine.trace(param_only=True) as params:
        elbo.differentiable_loss(model, guide, x_train[:2], problem.dataset.y_train[:2])
    leaves = [site["value"].unconstrained() for site in params.trace.nodes.values()]
    optimizer = torch.optim.Adam(leaves, lr=problem.lr)
    decay = 1.0 if problem.lr_decay is None else problem.lr_decay ** (1 / problem.num_steps)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, decay)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        x = x.clone().requires_grad_(True)
        clean = elbo.differentiable_loss(model, guide, x, y)
        (grad,) = torch.autograd.grad(clean, x, retain_graph=True)
        x_adv = (x + step_size * grad.sign()).detach()
        loss = 0.5 * (clean + elbo.differentiable_loss(model, guide, x_adv, y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        return float(loss.detach())

    return step


def train_map(problem: Problem, desc: str = "map", adversarial: float | None = None):
    """``(bnn, model, guide)``: the MAP network trained on ``problem``'s training rows, starting
    from ``problem.init`` when given. Under ``problem.sigma == "own"`` a regression MAP learns σ
    as a point estimate with the weights (the maximum of the joint density over weights and σ).

    :param adversarial: ε > 0 to train on clean and fast-gradient-sign adversarial inputs
        (ε times each input's range; the paper uses 0.01), Adam at ``problem.lr``; None for
        plain SVI.
    """
    bnn, model = problem.bayesian_model(noise="point")
    guide = AutoDelta(model, init_loc_fn=problem.init_loc_fn())
    if adversarial is None:
        svi = SVI(model, guide, problem.optimizer(), Trace_ELBO())
        train_svi(problem, svi, desc)
    else:
        check_positive("adversarial", adversarial, fix="Use e.g. 0.01, or None.")
        pyro.clear_param_store()  # the guide's parameters are created by the first trace
        train_loop(problem, _adversarial_step(problem, model, guide, adversarial), desc)
    return bnn, model, guide


def fit_map(problem: Problem) -> Predictor:
    """The MAP's predictive (one draw of the point mass); ``predictor.guide.median()`` holds the
    MAP site values."""
    _, model, guide = train_map(problem)
    return problem.predictor(model, guide, num_samples=1)
