"""The registry's VOGN entry: :class:`~pyro_bdl.infer.VOGN` trained by :func:`train_loop`.

By default VOGN has compare's settings (:func:`pyro_bdl.app.compare.vogn.make_vogn`); a problem
that needs others (the UCI regression benchmark) passes them as ``settings``, the keyword
arguments of :class:`~pyro_bdl.infer.VOGN` other than the model, the dataset size and the rate
(``problem.lr``); the prior is the one declared in ``bayesianize``. With ``problem.lr_decay`` the
rate in :attr:`VOGN.optimizer`'s parameter groups decays exponentially, by that factor over the
run. BatchNorm parameters stay point estimates, and predictions average
``problem.num_samples`` draws of :attr:`VOGN.guide` with BatchNorm in evaluation mode
(docs/design/vogn.md).

VOGN updates only lifted weights, so a regression σ is always known to it: under
``Problem.sigma == "own"`` the caller passes the MAP's point estimate as ``Problem.noise`` (the
UCI benchmark does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyro_bdl.app.compare.problem import Predictor, Problem, train_loop
from pyro_bdl.app.compare.vogn import make_vogn
from pyro_bdl.infer.vogn import VOGN

__all__ = ["fit_vogn"]


def fit_vogn(problem: Problem, *, settings: Mapping[str, Any] | None = None) -> Predictor:
    """Train VOGN for ``problem.epochs`` epochs, one MC sample a step.

    :param settings: keyword arguments for :class:`~pyro_bdl.infer.VOGN` (``betas``,
        ``damping``, ``temperature``, ...); ``None`` takes compare's (``make_vogn``).
    """
    net, model = problem.bayesian_model()
    if settings is None:
        vogn = make_vogn(problem, model)
    else:
        vogn = VOGN(model, dataset_size=problem.num_train, lr=problem.lr, **settings)
    decay = problem.lr_decay

    def on_step(count: int) -> None:
        if decay is not None:
            for group in vogn.optimizer.param_groups:
                group["lr"] = problem.lr * decay ** (count / max(problem.num_steps, 1))

    net.train()
    train_loop(problem, vogn.step, "vogn", on_step=on_step)
    net.eval()
    return problem.predictor(model, vogn.guide)
