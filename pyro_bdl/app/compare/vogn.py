"""The registry's VOGN entry (:func:`fit_vogn`) and its settings for ``pyro-bdl compare``
(docs/design/vogn.md).

VOGN reads its prior from the problem's lifted network and takes the problem's learning rate.

Settings, chosen on a validation split of the training rows (``split_validation``; the figures
are in the README):

- **Damping γ = 3e-2 · sqrt(T / 3000)**, T = epochs · ⌈N/B⌉ the number of steps. γ bounds the
  step α m/(s + δ̃ + γ) of weights the data barely constrain (rarely active pixels and units:
  s ≈ 0, and δ̃ = τδ/N is tiny), which a few examples would otherwise move by α m/δ̃ until the
  posterior mean memorises them. Such a weight random-walks by about (α/γ)|ĝ|·sqrt(T), so holding
  that drift fixed makes γ grow as sqrt(T); γ is in the units of s (a per-example squared
  gradient) and leaves σ alone.
- **β₂ = 0.01** (the weight of the new ĥ): s averages ~100 steps, so one noisy minibatch cannot
  shrink s, and with it inflate both σ and the step.
- **τ = 0.03**: a tempered posterior; at τ = 1 the weights the data barely constrain sit at their
  prior and the predictions drown in weight noise.

**Training.** :func:`fit_vogn` trains :class:`~pyro_bdl.infer.VOGN` by :func:`train_loop`, by
default with compare's settings (:func:`make_vogn`); a problem that needs others (the UCI regression
benchmark) passes them as ``settings``, the keyword arguments of :class:`~pyro_bdl.infer.VOGN` other
than the model, the dataset size and the rate (``problem.lr``); the prior is the one declared in
``bayesianize``. With ``problem.lr_decay`` the rate in :attr:`VOGN.optimizer`'s parameter groups
decays exponentially, by that factor over the run. BatchNorm parameters stay point estimates, and
predictions average ``problem.num_samples`` draws of :attr:`VOGN.guide` with BatchNorm in evaluation
mode (docs/design/vogn.md).

VOGN updates only lifted weights, so a regression σ is always known to it: under
``Problem.sigma == "own"`` the caller passes the MAP's point estimate as ``Problem.noise`` (the
UCI benchmark does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pyro_bdl.app.compare.problem import Predictor, Problem, train_loop
from pyro_bdl.infer import VOGN

__all__ = ["damping", "fit_vogn", "make_vogn"]

TEMPERATURE = 0.03
BETAS = (0.9, 0.01)
#: γ at :data:`DAMPING_STEPS` optimisation steps; see :func:`damping`.
DAMPING = 3e-2
DAMPING_STEPS = 3000


def damping(steps: int) -> float:
    """γ for a run of ``steps`` VOGN steps: ``DAMPING · sqrt(steps / DAMPING_STEPS)``, which keeps
    the random-walk drift of weights the data barely constrain about the same (module docstring).
    """
    return DAMPING * math.sqrt(max(steps, 1) / DAMPING_STEPS)


def make_vogn(problem: Problem, model) -> VOGN:
    """:class:`~pyro_bdl.infer.VOGN` over ``model`` with compare's settings for ``problem``: the
    prior its network was lifted with, its learning rate, and γ for ``problem.epochs`` epochs."""
    return VOGN(
        model,
        dataset_size=problem.num_train,
        lr=problem.lr,
        betas=BETAS,
        temperature=TEMPERATURE,
        damping=damping(problem.epochs * math.ceil(problem.num_train / problem.batch_size)),
    )


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
