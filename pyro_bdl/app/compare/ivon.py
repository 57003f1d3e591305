"""The registry's IVON entry (:func:`fit_ivon`) and its settings for ``pyro-bdl compare``
(docs/design/ivon.md).

IVON reads its prior from the problem's lifted network. Its rate is its own, not
``problem.lr``: an IVON step is a natural-gradient step whose scale (rates of 0.1 to 1) is far
from Adam's, so ``--lr`` (Adam's rate, shared by the other methods) would leave it nearly still.

Settings (from the grid of ``tests/infer/test_ivon_quality.py``, scored on a validation split):

- **rate 0.3**, decayed linearly to zero over the run, as in that test and the paper;
- **hess_init 0.5**: the starting curvature, so the first steps are no larger than ``rate / 0.5``;
- **ess = 10 N**: a tempered posterior (τ = 0.1), the usual practice on small data sets, for the
  same reason as VOGN's τ (:mod:`pyro_bdl.app.compare.vogn`).

References:
    Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan & Möllenhoff,
    "Variational Learning is Effective for Large Deep Networks", ICML 2024.
"""

from __future__ import annotations

from pyro_bdl.app.compare.problem import Predictor, Problem, train_loop
from pyro_bdl.infer import IVON

__all__ = ["ESS_FACTOR", "HESS_INIT", "RATE", "fit_ivon"]

RATE = 0.3
HESS_INIT = 0.5
ESS_FACTOR = 10.0


def fit_ivon(
    problem: Problem, *, ivon_lr: float = RATE, ess_factor: float = ESS_FACTOR
) -> Predictor:
    """Train IVON for ``problem.epochs`` epochs, one MC sample a step, the rate decaying linearly
    from ``ivon_lr`` to zero; predictions average ``problem.num_samples`` draws of its guide, and
    the predictor's ``lr`` is ``ivon_lr``.

    :param float ivon_lr: IVON's rate (not ``problem.lr``; see the module docstring).
    :param float ess_factor: the effective sample size as a multiple of the training rows.
    """
    net, model = problem.bayesian_model()
    ivon = IVON(
        model,
        dataset_size=problem.num_train,
        lr=ivon_lr,
        hess_init=HESS_INIT,
        ess=ess_factor * problem.num_train,
    )

    def on_step(count: int) -> None:
        for group in ivon.optimizer.param_groups:
            group["lr"] = ivon_lr * max(0.0, 1 - count / max(problem.num_steps, 1))

    net.train()
    train_loop(problem, ivon.step, "ivon", on_step=on_step)
    net.eval()
    predict = problem.predictor(model, ivon.guide)
    predict.lr = ivon_lr  # type: ignore[attr-defined]  # compare records the rate used
    return predict
