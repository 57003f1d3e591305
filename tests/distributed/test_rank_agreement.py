"""What the ranks must agree on beyond the gradients: optimizer state and frozen weights when
DataParallelSVI is built, the batch size of every step (equal short last batches stay exact), and
the bins of the sharded metrics.

One spawn of two ``gloo`` ranks runs every phase (set-up shared with test_data_parallel.py).
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.distributed import DataParallelSVI, shard_indices, sharded_metrics
from pyro_bdl.guides import AutoMeanField
from pyro_bdl.priors import Normal
from tests.distributed.test_data_parallel import WORLD, N, _dataset, _flat_params, spawn_phases

pytestmark = pytest.mark.distributed

# 41 examples on two ranks: shards of 20 (one example left out per epoch) in batches of 6, so
# every epoch ends with a batch of 2 per rank.
N_ODD, B_ODD = 41, 6


def _model(seed: int, *, frozen: bool = False, size: int = N):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if frozen:
        net[0].weight.requires_grad_(False)  # a frozen layer: bayesianize hides it as a buffer
    return models.classifier(bayesianize(net, Normal(scale=1.0)), size)


def _odd_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N_ODD, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (N_ODD,), generator=g)


def _odd_batches(rank: int) -> list[torch.Tensor]:
    shards = [shard_indices(N_ODD, rank=rank, world_size=WORLD, epoch=e) for e in range(2)]
    return [batch for shard in shards for batch in shard.split(B_ODD)]


def _odd_run(svi_class, batches) -> torch.Tensor:
    x, y = _odd_dataset()
    model = _model(0, size=N_ODD)
    guide = AutoMeanField(model, init_scale=0.05)
    guide(x[:2], y[:2])
    if svi_class is SVI:
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
        pyro.set_rng_seed(1)
    else:
        svi = _wrap(model, guide, pyro.optim.Adam({"lr": 0.05}))
    steps = []
    for batch in batches:
        svi.step(x[batch], y[batch])
        steps.append(_flat_params())
    return torch.stack(steps)


def _wrap(model, guide, optim) -> DataParallelSVI:
    return DataParallelSVI(model, guide, optim, TraceMeanField_ELBO(), shared_noise=True, seed=1)


def _error(run) -> str:
    try:
        run()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _phase_plain_step_first(rank: int) -> torch.Tensor:
    """The guide set up by a plain SVI step on each rank's own batch with the optimizer that
    DataParallelSVI then uses (what GuideNotInitializedError suggests): Adam's moments differ."""
    x, y = _dataset()
    model = _model(0)
    guide = AutoMeanField(model, init_scale=0.05)
    optim = pyro.optim.Adam({"lr": 0.05})
    own = slice(4 * rank, 4 * rank + 4)
    SVI(model, guide, optim, TraceMeanField_ELBO()).step(x[own], y[own])
    svi = _wrap(model, guide, optim)
    steps = []
    for t in range(3):
        batch = slice(8 + 4 * t + 12 * rank, 12 + 4 * t + 12 * rank)
        svi.step(x[batch], y[batch])
        steps.append(_flat_params())
    return torch.stack(steps)


def _phase_frozen(rank: int) -> dict:
    """Networks built from different seeds, whose frozen first layer is no parameter."""
    x, y = _dataset()
    model = _model(rank, frozen=True)
    guide = AutoMeanField(model, init_scale=0.05)
    guide(x[:2], y[:2])
    svi = _wrap(model, guide, pyro.optim.Adam({"lr": 0.05}))
    svi.step(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
    with torch.no_grad():
        out = model.net(x[:5])  # the posterior mean's outputs: the frozen layer included
    return {"frozen": model.net[0].weight.clone(), "out": out, "params": _flat_params()}


def _phase_state_on_one_rank(rank: int) -> str:
    """Optimizer state on rank 0 only (a checkpoint loaded there, or a step taken there)."""
    x, y = _dataset()
    model = _model(0)
    guide = AutoMeanField(model, init_scale=0.05)
    guide(x[:2], y[:2])
    optim = pyro.optim.Adam({"lr": 0.05})
    if rank == 0:
        SVI(model, guide, optim, TraceMeanField_ELBO()).step(x[:4], y[:4])
    return _error(lambda: _wrap(model, guide, optim))


def _phase_unequal(rank: int) -> dict:
    """Rank 0 passes 5 examples, rank 1 passes 4: the N/B_local scales differ."""
    x, y = _dataset()
    model = _model(0)
    guide = AutoMeanField(model, init_scale=0.05)
    guide(x[:2], y[:2])
    svi = _wrap(model, guide, pyro.optim.Adam({"lr": 0.05}))
    before = _flat_params()
    batch = slice(0, 5) if rank == 0 else slice(5, 9)
    error = _error(lambda: svi.step(x[batch], y[batch]))
    unchanged = torch.equal(before, _flat_params())
    # Equal batches still train after the refusal: the ranks stayed in step.
    loss = svi.step(x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
    return {"error": error, "unchanged": unchanged, "loss": loss}


def _phase_short_last_batches(rank: int) -> torch.Tensor:
    return _odd_run(DataParallelSVI, _odd_batches(rank))


def _phase_bins(rank: int) -> str:
    probs = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 2])
    return _error(lambda: sharded_metrics(probs, y, num_bins=15 if rank == 0 else 10))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    phases = {
        "plain_step_first": _phase_plain_step_first,
        "frozen": _phase_frozen,
        "state_on_one_rank": _phase_state_on_one_rank,
        "unequal": _phase_unequal,
        "bins": _phase_bins,
        "short": _phase_short_last_batches,
    }
    return spawn_phases(tmp_path_factory.mktemp("agreement"), phases)


def test_optimizer_state_from_a_step_before_wrapping_is_rank_0s(ranks):
    # Rank 0's Adam moments are broadcast with its parameters, so every step keeps the ranks
    # bitwise equal; with each rank's own moments they part at the first step.
    assert torch.equal(ranks[0]["plain_step_first"], ranks[1]["plain_step_first"])


def test_frozen_weights_are_rank_0s(ranks):
    # A frozen weight is a buffer of the lifted network: broadcast with the parameters, as
    # DistributedDataParallel broadcasts module buffers, so the ranks compute the same network.
    first, second = ranks[0]["frozen"], ranks[1]["frozen"]
    assert torch.equal(first["frozen"], second["frozen"])
    assert torch.equal(first["out"], second["out"])
    assert torch.equal(first["params"], second["params"])


def test_optimizer_state_on_one_rank_only_is_refused_on_every_rank(ranks):
    for r in ranks:
        assert r["state_on_one_rank"].startswith("RuntimeError: the optimizer holds state")
        assert "Load the checkpoint on every rank" in r["state_on_one_rank"]


def test_batches_of_different_sizes_are_refused_on_every_rank(ranks):
    for r in ranks:
        unequal = r["unequal"]
        assert unequal["error"].startswith("ValueError: step 0: the ranks passed batches")
        assert "subsample size per rank: [5, 4]" in unequal["error"]
        assert unequal["unchanged"]
    assert ranks[0]["unequal"]["loss"] == ranks[1]["unequal"]["loss"]


def test_short_last_batches_match_one_process_on_the_concatenated_batch(ranks):
    # Each rank scales by N/2 on a last batch of 2, the one process by N/4 on the 4 examples:
    # averaging gives the same estimator. The sums differ only in order (relative 1e-16 per
    # operation over 8 Adam steps), far below 1e-12.
    pyro.clear_param_store()
    joined = [torch.cat(pair) for pair in zip(_odd_batches(0), _odd_batches(1))]
    assert [len(b) for b in joined[:4]] == [12, 12, 12, 4]
    one = _odd_run(SVI, joined)
    assert torch.equal(ranks[0]["short"], ranks[1]["short"])
    torch.testing.assert_close(ranks[0]["short"], one, rtol=1e-12, atol=1e-12)
    assert (one[-1] - one[0]).abs().max() > 1e-2  # the run moved


def test_sharded_metrics_with_different_bins_are_refused_on_every_rank(ranks):
    # Sums of different lengths would abort a rank inside gloo (SIGABRT).
    for r in ranks:
        assert r["bins"].startswith("ValueError: the ranks' probs have different numbers")
        assert "[[3, 15], [3, 10]]" in r["bins"]
