"""``map_ts``: the MAP of ``map`` on 90% of the training split, recalibrated by one temperature
fitted on the held-out 10%; and the shared validation split."""

import dataclasses

import pytest
import torch

from pyro_bdl.app.compare import METHODS, Problem
from pyro_bdl.app.compare.map import train_map
from pyro_bdl.app.compare.problem import predictive_probs, seed_everything, split_validation
from pyro_bdl.app.compare.temperature import validation_temperature
from pyro_bdl.app.data import load_digits
from pyro_bdl.diagnostics import fit_temperature, metrics


def _problem(**kwargs):
    # 400 training rows and one epoch keep the two MAP fits below a few seconds.
    digits = load_digits()
    small = dataclasses.replace(digits, x_train=digits.x_train[:400], y_train=digits.y_train[:400])
    return Problem(small, epochs=1, batch_size=64, progress=False, **kwargs)


def test_split_validation_partitions_the_training_rows():
    problem = _problem(seed=3)
    train, x_val, y_val = split_validation(problem)
    n = problem.num_train
    assert len(y_val) == round(0.1 * n) and train.num_train == n - len(y_val)
    # Disjoint and complete: every training row lands in exactly one part.
    rows = torch.cat([train.dataset.x_train, x_val]).flatten(1)
    assert torch.equal(
        torch.unique(rows, dim=0), torch.unique(problem.dataset.x_train.flatten(1), dim=0)
    )
    assert torch.equal(train.dataset.x_test, problem.dataset.x_test)  # the test set is untouched
    # Drawn with the problem's seed: the same rows every call (subnet_laplace holds these out).
    assert torch.equal(split_validation(problem)[1], x_val)
    with pytest.raises(ValueError, match="fraction must lie in"):
        split_validation(problem, 1.5)


def test_map_ts_only_rescales_the_map_it_trained():
    assert "map_ts" in METHODS and "map" in METHODS
    problem = _problem()
    x_test, y_test = problem.dataset.x_test, problem.dataset.y_test
    seed_everything(problem.seed)
    predict = METHODS["map_ts"](problem)
    probs = predict(x_test)
    temperature = predict.temperature
    assert temperature > 0 and temperature != 1.0

    # The same MAP, trained again on the same rows with the same seed: tempering its logits by
    # the reported T reproduces map_ts, and the argmax (so the accuracy) is the MAP's.
    seed_everything(problem.seed)
    train, _, _ = split_validation(problem)
    _, model, guide = train_map(train)
    plain = predictive_probs(model, guide, x_test, num_samples=1)
    logits = plain.double().log()
    expected = (logits / temperature).softmax(-1)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-4, atol=1e-6)  # float32 round
    assert torch.equal(probs.argmax(-1), plain.argmax(-1))
    assert metrics.accuracy(probs, y_test) == metrics.accuracy(plain, y_test)


def test_validation_temperature_keeps_t_one_when_every_row_is_right():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.0, 3.0]])
    # Every label top-scoring: the validation NLL has no finite minimiser, so T = 1 and a warning.
    with pytest.warns(RuntimeWarning, match="all 3 validation rows right.*keeping T = 1"):
        assert validation_temperature(logits, torch.tensor([0, 1, 2])) == 1.0
    # One mistake: the fitted temperature.
    y = torch.tensor([0, 2, 2])
    assert validation_temperature(logits, y) == fit_temperature(logits, y)
