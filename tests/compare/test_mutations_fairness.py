"""The fairness promises of ``pyro-bdl compare``, checked exactly with stand-in methods: the test
split never chooses anything, every method gets the same budget from the same starting state,
the chosen setting is then trained on the whole training split, and the validation rows are
the ones :func:`split_validation` defines (disjoint from the rows trained on)."""

import json
import math

import pyro
import pytest
import torch

from pyro_bdl.app.compare import METHODS, Problem, run, tuning, write_json
from pyro_bdl.app.compare import temperature as map_ts
from pyro_bdl.app.compare.checks import MAX_SEED
from pyro_bdl.app.compare.evaluate import evaluate
from pyro_bdl.app.compare.problem import split_validation
from pyro_bdl.app.data import Dataset, load_digits
from pyro_bdl.diagnostics import metrics, ood


def _classes(n_train: int = 60, n_test: int = 20) -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return Dataset("toy", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes=2)


def _indexed(n_train: int, n_test: int = 5) -> Problem:
    """A regression problem whose row i is (i, i): every row names its own index."""
    x = torch.arange(n_train + n_test, dtype=torch.float64).unsqueeze(1)
    data = Dataset("rows", x[:n_train], x[:n_train, 0], x[n_train:], x[n_train:, 0], None)
    return Problem(data, noise=1.0, progress=False)


def _lr_predictor(p: Problem):
    """Class probabilities whose confidence in the right class grows with ``p.lr``: the
    largest rate of ``LR_GRID`` fits best (1e-2 · 50 = 0.5 of the mass on the label)."""

    def predict(x):
        right = torch.nn.functional.one_hot((x[:, 0] > 0).long(), 2).float()
        return right * p.lr * 50 + (1 - p.lr * 50) / 2 * torch.ones_like(right)

    return predict


# ---------------------------------------------------------------------------------------------
# tuning.tune / tuning.select


def test_the_chosen_setting_is_trained_on_the_whole_training_split():
    data = _classes()
    problem = Problem(data, progress=False)
    chosen, _, record = tuning.tune("map", lambda p: _lr_predictor(p), problem)
    # The search trained on 90% of the rows; the final fit gets all 60 and the same test rows.
    assert record["validation_rows"] == 6
    assert chosen.num_train == 60 and torch.equal(chosen.dataset.x_train, data.x_train)
    assert torch.equal(chosen.dataset.x_test, data.x_test)


@pytest.mark.parametrize("name", list(tuning.GRIDS))
def test_every_setting_of_every_grid_starts_from_the_problems_seed(name):
    problem = Problem(_classes(), progress=False, seed=7)
    pyro.set_rng_seed(problem.seed)
    expected = float(torch.rand(()))
    draws, settings = [], []

    def fit(p: Problem, **keywords):
        draws.append(float(torch.rand(())))  # what a network's initialisation would draw
        settings.append((p.lr, repr(p.prior), tuple(sorted(keywords.items()))))
        return _lr_predictor(p)

    torch.manual_seed(12345)  # whatever the caller's state, each setting restarts at seed 7
    _, _, record = tuning.tune(name, fit, problem)
    # The same budget for every method: one fit per grid point, every point distinct.
    size = math.prod(len(v) for v in tuning.GRIDS[name].values())
    assert len(draws) == len(record["grid"]) == size == 6
    assert len(set(settings)) == size
    assert draws == [expected] * size


def test_a_setting_whose_predictive_is_nan_scores_inf_and_loses():
    # The first grid point (lr=1e-3, both prior scales) predicts NaN; a NaN score must not win
    # by coming first (min() never replaces a NaN it started from).
    problem = _indexed(50)
    x_val = split_validation(problem, tuning.VALIDATION_FRACTION)[1]

    def fit(p: Problem):
        if p.lr == min(tuning.LR_GRID):
            return lambda x: torch.distributions.Normal(
                torch.full((len(x),), math.nan), 1.0, validate_args=False
            )
        return lambda x: torch.distributions.Normal(x[:, 0] + 1 / (p.lr * 100), 1.0)

    _, _, record = tuning.tune("map", fit, problem)
    scores = [r["val_nll"] for r in record["grid"]]
    assert scores[:2] == [math.inf, math.inf] and all(math.isfinite(s) for s in scores[2:])
    assert record["setting"]["lr"] == max(tuning.LR_GRID)
    # The regression score is the mean NLL of the targets, computed here independently.
    best = min(scores)
    y = x_val[:, 0]
    want = float(-torch.distributions.Normal(y + 1.0, 1.0).log_prob(y).mean())
    assert best == pytest.approx(want, rel=1e-12)


def test_regression_tuning_picks_the_highest_validation_density():
    # Setting lr puts the predictive mean 1/(100 lr) above the target: lr=1e-2 is off by 1,
    # lr=1e-3 by 10, so the density of the targets is highest at the largest rate.
    problem = _indexed(50)

    def fit(p: Problem):
        return lambda x: torch.distributions.Normal(x[:, 0] + 1 / (p.lr * 100), 1.0)

    chosen, _, record = tuning.tune("map", fit, problem)
    assert chosen.lr == max(tuning.LR_GRID)
    scores = {r["setting"]["lr"]: r["val_nll"] for r in record["grid"]}
    # −log N(y | y + d, 1) = d²/2 + log √(2π) for every row.
    for lr, score in scores.items():
        d = 1 / (lr * 100)
        assert score == pytest.approx(d**2 / 2 + 0.5 * math.log(2 * math.pi), rel=1e-6), lr


def test_a_setting_whose_distribution_refuses_its_parameters_scores_inf():
    problem = Problem(_classes(), progress=False)

    def fit(p: Problem):
        if p.lr == max(tuning.LR_GRID):
            # What torch.distributions raises for NaN parameters after a diverged run.
            raise ValueError("Expected parameter loc to satisfy the constraint Real()")
        return _lr_predictor(p)

    _, _, record = tuning.tune("map", fit, problem)
    errors = [r.get("error", "") for r in record["grid"]]
    assert sum(e.startswith("ValueError: Expected parameter loc") for e in errors) == 2
    assert record["setting"]["lr"] == sorted(tuning.LR_GRID)[-2]


def test_run_with_tune_trains_the_final_fit_at_the_chosen_rate(monkeypatch):
    data = _classes()
    problem = Problem(data, progress=False)
    monkeypatch.setitem(METHODS, "map", lambda p: _lr_predictor(p))
    (row,) = run(problem, ["map"], tune=True)
    assert row["tuned"]["lr"] == max(tuning.LR_GRID) and row["lr"] == max(tuning.LR_GRID)
    # The figures are those of the chosen rate's predictor on the test rows.
    chosen = _lr_predictor(Problem(data, progress=False, lr=max(tuning.LR_GRID)))
    assert row["nll"] == metrics.nll(chosen(data.x_test), data.y_test)


def test_run_starts_every_methods_final_fit_from_the_problems_seed(monkeypatch):
    problem = Problem(_classes(), progress=False, seed=11)
    draws = []

    def fit(p: Problem):
        draws.append(float(torch.rand(())))
        return _lr_predictor(p)

    monkeypatch.setitem(METHODS, "map", fit)
    monkeypatch.setitem(METHODS, "swag", fit)
    torch.manual_seed(12345)
    run(problem, ["map", "swag"])
    pyro.set_rng_seed(problem.seed)
    assert draws == [float(torch.rand(()))] * 2


# ---------------------------------------------------------------------------------------------
# map_ts: the temperature is fitted on the validation rows


def test_map_ts_fits_its_temperature_on_the_validation_rows_only(monkeypatch):
    digits = load_digits()
    small = Dataset(
        "digits", digits.x_train[:120], digits.y_train[:120], digits.x_test[:30],
        digits.y_test[:30], num_classes=digits.num_classes,
    )  # fmt: skip
    problem = Problem(small, epochs=1, batch_size=64, progress=False)
    seen = []

    def spy(logits, y):
        seen.append((logits, y))
        return 2.0

    monkeypatch.setattr(map_ts, "validation_temperature", spy)
    predict = map_ts.fit_map_ts(problem)
    _, _, y_val = split_validation(problem, map_ts.VALIDATION_FRACTION)
    ((logits, y),) = seen
    assert torch.equal(y, y_val) and logits.shape == (len(y_val), digits.num_classes)
    assert predict.temperature == 2.0


# ---------------------------------------------------------------------------------------------
# split_validation and the minibatches


@pytest.mark.parametrize(("n", "fraction", "n_val"), [(47, 0.1, 5), (47, 0.01, 1), (10, 0.5, 5)])
def test_split_validation_holds_out_the_first_rows_of_the_seeded_permutation(n, fraction, n_val):
    problem = _indexed(n)
    problem.seed = 5
    train, x_val, y_val = split_validation(problem, fraction)
    # round(0.1 · 47) = 5 (4.7 rounds up), and at least one row when the share rounds to 0.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    assert torch.equal(x_val[:, 0], order[:n_val].double()) and torch.equal(y_val, x_val[:, 0])
    assert torch.equal(train.dataset.x_train[:, 0], order[n_val:].double())
    assert torch.equal(train.dataset.y_train, train.dataset.x_train[:, 0])
    assert torch.equal(train.dataset.x_test, problem.dataset.x_test)


def test_split_validation_refuses_a_share_that_leaves_no_training_row():
    # round(0.96 · 10) = 10: every row would be a validation row.
    with pytest.raises(ValueError, match="leaves none to train on"):
        split_validation(_indexed(10), 0.96)


def test_batches_reshuffle_every_epoch_and_cover_every_row_once():
    problem = _indexed(60)
    problem.batch_size = 25
    assert problem.num_steps == problem.epochs * 3  # ⌈60 / 25⌉ steps per epoch
    orders = []
    for epoch in range(2):
        rows = torch.cat([x[:, 0] for x, _ in problem.batches(epoch)])
        g = torch.Generator().manual_seed(problem.seed * 100_003 + epoch)
        assert torch.equal(rows, torch.randperm(60, generator=g).double())
        orders.append(rows)
    assert not torch.equal(orders[0], orders[1])


# ---------------------------------------------------------------------------------------------
# The figures of a row


def test_evaluate_scores_ood_inputs_as_the_positive_class():
    # Confident, correct in-distribution predictions; uniform ones on the OOD inputs: their
    # entropy is higher, so the AUROC is 1 and no OOD input is accepted at 95% TPR.
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    probs_ood = torch.full((2, 2), 0.5, dtype=torch.float64)
    row = evaluate(probs, y, probs_ood)
    assert row["ood_auroc"] == 1.0 and row["ood_fpr95"] == 0.0
    assert row["accuracy"] == metrics.accuracy(probs, y) == 2 / 3
    assert row["nll"] == metrics.nll(probs, y) and row["brier"] == metrics.brier(probs, y)
    assert row["ece"] == metrics.ece(probs, y) != row["brier"]
    assert row["ood_auroc"] == ood.ood_auroc(probs, probs_ood)


def test_write_json_turns_an_infinite_validation_score_into_null(tmp_path):
    problem = Problem(_classes(), progress=False)
    row = {"method": "map", "nll": math.inf, "tuning": {"grid": [{"val_nll": math.inf}]}}
    write_json([row], problem, tmp_path / "r.json", tune=True)
    (saved,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert saved["nll"] is None and saved["tuning"]["grid"][0]["val_nll"] is None


# ---------------------------------------------------------------------------------------------
# The registry and the Problem's checks


@pytest.mark.parametrize(("name", "diagonal"), [("swag", False), ("swag_diag", True)])
def test_swag_and_swag_diag_entries_fit_their_own_covariance(name, diagonal):
    problem = Problem(_classes(), epochs=2, batch_size=30, num_samples=2, progress=False)
    predict = METHODS[name](problem)
    assert predict.guide.diag_only is diagonal


def test_the_largest_seed_numpy_accepts_is_a_valid_problem_seed():
    assert Problem(_classes(), progress=False, seed=MAX_SEED).seed == 2**32 - 1
    with pytest.raises(ValueError, match=r"Problem.seed must be an int in \[0, 4294967295\]"):
        Problem(_classes(), progress=False, seed=MAX_SEED + 1)
