"""VOGN for ``pyro-bdl compare``: natural-gradient VI trained like Adam (docs/design/vogn.md).

VOGN reads its prior from the problem's lifted network and takes the problem's learning rate;
BatchNorm parameters stay point estimates, and predictions average ``problem.num_samples`` draws
of :attr:`VOGN.guide` with BatchNorm in evaluation mode.

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
"""

from __future__ import annotations

import math

from pyro_bdl.compare.problem import Predictor, Problem, predictive_probs
from pyro_bdl.infer.vogn import VOGN

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


def fit_vogn(problem: Problem) -> Predictor:
    """Train :class:`~pyro_bdl.infer.VOGN` for ``problem.epochs`` epochs, one MC sample a step."""
    net, model = problem.bayesian_model()
    vogn = make_vogn(problem, model)
    bar = problem.epoch_bar("vogn")
    for epoch in bar:
        net.train()
        total = 0.0
        for x, y in problem.batches(epoch):
            total += vogn.step(x, y)
        bar.set_postfix(loss=f"{total / problem.num_train:.3f}")
    net.eval()
    return lambda x: predictive_probs(model, vogn.guide, x, num_samples=problem.num_samples)
