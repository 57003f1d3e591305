from pyro_bdl.app.compare import Problem
from pyro_bdl.app.compare.map import fit_map
from pyro_bdl.app.data import load_digits
from pyro_bdl.diagnostics import metrics


def test_map_baseline_learns_digits():
    problem = Problem(load_digits(), epochs=3, progress=False)
    predict = fit_map(problem)
    probs = predict(problem.dataset.x_test)
    assert probs.shape == (len(problem.dataset.y_test), 10)
    # Chance is 0.1; three epochs of Adam on this MLP reliably exceed 0.8 (about 0.9 observed).
    assert metrics.accuracy(probs, problem.dataset.y_test) > 0.8


def test_batches_cover_the_training_set_once_per_epoch():
    problem = Problem(load_digits(), batch_size=100, progress=False)
    seen = [y for _, y in problem.batches(epoch=0)]
    assert sum(len(y) for y in seen) == problem.num_train
    again = [y for _, y in problem.batches(epoch=0)]
    assert all((a == b).all() for a, b in zip(seen, again))
