"""The registry's MC dropout: it trains and predicts, its spread vanishes with the rate, and it
refuses a rate outside [0, 1)."""

import dataclasses

import pytest
import torch
from torch import nn

from pyro_bdl.app.compare import METHODS, Problem
from pyro_bdl.app.compare.mc_dropout import fit_mc_dropout, with_dropout
from pyro_bdl.app.data import Dataset


def _problem(**fields) -> Problem:
    """y = sin(2x) + 0.1 ε on 48 rows, a 32-unit tanh network, full batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, generator=g) * 3 - 1.5
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(64, generator=g)
    data = Dataset("toy", x[:48], y[:48], x[48:], y[48:], num_classes=None)

    def net(input_shape, outputs):
        return nn.Sequential(nn.Linear(input_shape[0], 32), nn.Tanh(), nn.Linear(32, outputs))

    base = Problem(data, network=net, epochs=150, batch_size=48, lr=1e-2, progress=False, noise=0.1)
    return dataclasses.replace(base, **fields)


def test_dropout_goes_before_every_linear_layer():
    net = with_dropout(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)), 0.1)
    kinds = [type(m).__name__ for m in net]
    assert kinds == ["Dropout", "Linear", "ReLU", "Dropout", "Linear"]


def test_mc_dropout_trains_and_predicts_a_distribution_over_the_targets():
    problem = _problem(num_samples=32)
    predict = METHODS["mc_dropout"](problem, rate=0.05)
    x, y = problem.dataset.x_test, problem.dataset.y_test
    dist = predict(x)
    assert isinstance(dist, torch.distributions.Distribution) and dist.batch_shape == (16,)
    # Trained: the mean fits sin(2x) far better than the target's own spread (std ≈ 0.7).
    assert float((dist.mean - y).square().mean().sqrt()) < 0.4
    assert predict.rate == 0.05


def test_the_predictive_spread_shrinks_to_the_noise_as_the_rate_goes_to_zero():
    problem = _problem(num_samples=64)
    x = problem.dataset.x_test
    spread = {
        rate: float(fit_mc_dropout(problem, rate=rate)(x).variance.mean())
        for rate in (0.3, 0.05, 0.0)
    }
    # Rate 0: every mask keeps every unit, so the mixture is N(f(x), σ²) exactly.
    assert spread[0.0] == pytest.approx(0.1**2, rel=1e-4)
    # Each rate's masks add the variance of f over masks to σ²: more dropout, more spread.
    assert spread[0.3] > spread[0.05] > spread[0.0]


def test_without_a_rate_it_is_chosen_on_held_out_training_rows():
    problem = _problem(epochs=60, num_samples=8)
    predict = fit_mc_dropout(problem, rates=(0.01, 0.5))
    assert set(predict.validation) == {0.01, 0.5}
    assert predict.rate == max(predict.validation, key=predict.validation.get)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan")])
def test_a_rate_outside_zero_one_is_refused(rate):
    with pytest.raises(ValueError, match=r"rate must lie in \[0, 1\)"):
        fit_mc_dropout(_problem(epochs=1), rate=rate)
    with pytest.raises(ValueError, match=r"rates must lie in \[0, 1\)"):
        fit_mc_dropout(_problem(epochs=1), rates=(0.1, rate))
