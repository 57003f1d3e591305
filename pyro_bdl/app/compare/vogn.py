"""VOGN's settings for ``pyro-bdl compare`` (docs/design/vogn.md); the registry's entry that
trains it is :func:`pyro_bdl.app.compare.vogn_fit.fit_vogn`.

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
"""

from __future__ import annotations

import math

from pyro_bdl.app.compare.problem import Problem
from pyro_bdl.infer.vogn import VOGN

__all__ = ["damping", "make_vogn"]

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
