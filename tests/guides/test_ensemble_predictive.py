"""The compare methods ``ensemble`` and ``multiswag``: their predictive is the exact equal-weight
mixture of the members' predictives (slow: trains several small networks on digits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pyro_bdl.app.compare import METHODS, Problem
from pyro_bdl.app.compare.ensemble import fit_ensemble, fit_multiswag
from pyro_bdl.app.compare.map import fit_map
from pyro_bdl.app.compare.problem import seed_everything
from pyro_bdl.app.compare.swag import BN_FRACTION
from pyro_bdl.app.data import load_digits
from pyro_bdl.guides.batchnorm import predict_with_bn_refresh
from tests.common import assert_close
from tests.compare.test_registry import _problem as regression_problem

pytestmark = pytest.mark.slow

M = 3


def _problem() -> Problem:
    data = load_digits()
    data = dataclasses.replace(
        data,
        x_train=data.x_train[:300],
        y_train=data.y_train[:300],
        x_test=data.x_test[:100],
        y_test=data.y_test[:100],
    )
    return Problem(data, epochs=3, num_samples=6, progress=False, seed=11)


def test_ensemble_is_the_average_of_independent_map_runs():
    # Member k is `map` under seed + k: the same initial weights, batches and steps, so the
    # ensemble's probabilities are the mean of M separate `map` predictives, to round-off.
    problem = _problem()
    x = problem.dataset.x_test
    seed_everything(problem.seed)
    ensemble = fit_ensemble(problem, num_members=M)(x)
    maps = []
    for k in range(M):
        member = dataclasses.replace(problem, seed=problem.seed + k)
        seed_everything(member.seed)
        maps.append(fit_map(member)(x))
    assert_close(ensemble, torch.stack(maps).mean(0), rtol=1e-5, atol=1e-6)
    # The members differ, so the mixture is not any one of them.
    assert (maps[0] - maps[1]).abs().max() > 1e-3


def test_multiswag_is_the_average_of_its_members_swag_predictives():
    problem = _problem()
    x = problem.dataset.x_test
    seed_everything(problem.seed)
    predict = fit_multiswag(problem, num_members=M)
    guide, net = predict.guide, predict.model.net  # no BatchNorm: one net serves every member
    per_member = -(-problem.num_samples // M)
    torch.manual_seed(3)
    mixed = predict(x)
    torch.manual_seed(3)
    own = [
        predict_with_bn_refresh(
            member,
            net,
            x,
            num_samples=per_member,
            bn_data=problem.dataset.x_train,
            bn_fraction=BN_FRACTION,
        )
        for member in guide.members
    ]
    assert_close(mixed, torch.stack(own).mean(0))
    assert_close(mixed.sum(-1), torch.ones(len(x)), rtol=1e-5)


@pytest.mark.parametrize("name", ["ensemble", "multiswag"])
def test_regression_predictive_is_the_mixture_over_every_members_draws(name):
    problem = regression_problem(epochs=20, batch_size=48, lr=1e-2, noise=0.5, num_samples=4)
    predict = METHODS[name](problem, num_members=M)
    dist = predict(problem.dataset.x_test)
    per_member = 1 if name == "ensemble" else -(-problem.num_samples // M)
    assert dist.batch_shape == (len(problem.dataset.y_test),)
    assert dist.component_distribution.batch_shape[-1] == M * per_member
    assert torch.isfinite(dist.log_prob(problem.dataset.y_test)).all()


def test_multiswag_from_trained_members_swags_around_each_of_them():
    # Given a deep ensemble's members, member k runs only the SWAG phase from member k's
    # weights: at an Adam rate of 1e-7 over 9 steps no weight moves by more than ~1e-6 and the
    # SWAG spread is as small, so the predictive mean is the ensemble's (outputs O(1): 1e-4
    # leaves two orders of magnitude), while members trained from scratch would differ by O(0.1).
    problem = regression_problem(epochs=3, num_samples=6, seed=5)
    x = problem.dataset.x_test
    seed_everything(problem.seed)
    ensemble = fit_ensemble(problem, num_members=M)
    starts = ensemble.member_values
    assert len(starts) == M
    swag = fit_multiswag(problem, num_members=M, optimizer="adam", swa_lr=1e-7, starts=starts)
    assert_close(swag(x).mean, ensemble(x).mean, rtol=0.0, atol=1e-4)
    scratch = fit_multiswag(problem, num_members=M)
    assert (scratch(x).mean - ensemble(x).mean).abs().max() > 1e-2
    with pytest.raises(ValueError, match="num_members"):
        fit_multiswag(problem, num_members=M + 1, starts=starts)
