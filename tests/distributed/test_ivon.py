"""Data-parallel IVON: two ``gloo`` ranks with shared weight noise equal one process on the
concatenated batch (docs/design/ivon.md), through test_data_parallel.py's two-rank harness."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.distributed import allreduce_mean_, shard_indices
from pyro_bdl.infer import IVON
from pyro_bdl.priors import Normal
from tests.distributed.test_data_parallel import WORLD, spawn_phases

pytestmark = pytest.mark.distributed

N = 40
B_LOCAL = 4
STEPS = 12
SEED = 321


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return x, y


def _ivon(reduce_fn=None) -> IVON:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = models.classifier(bayesianize(net, Normal(scale=1.0)), N)
    # A large step so that 12 steps move the mean visibly; h₀ = 1 keeps σ moderate.
    return IVON(model, dataset_size=N, lr=0.3, hess_init=1.0, reduce_fn=reduce_fn)


def _batch(step: int, rank: int) -> torch.Tensor:
    return shard_indices(N, rank=rank, world_size=WORLD, epoch=step, seed=0)[:B_LOCAL]


def _phase_ivon(rank: int) -> dict:
    x, y = _dataset()
    calls = []

    def reduce_fn(tensors):
        calls.append(len(tensors))
        allreduce_mean_(tensors)

    ivon = _ivon(reduce_fn)
    pyro.set_rng_seed(SEED)  # the same seed on every rank: shared weight noise
    losses, means = [], []
    for t in range(STEPS):
        idx = _batch(t, rank)
        losses.append(ivon.step(x[idx], y[idx]))
        means.append(ivon.guide.loc.clone())
    out = {"losses": losses, "means": torch.stack(means), "scale": ivon.guide.scale.clone()}
    out["calls"] = calls
    return out


def test_two_ranks_with_shared_noise_equal_one_process(tmp_path):
    ranks = [r["ivon"] for r in spawn_phases(tmp_path, {"ivon": _phase_ivon})]
    # One reduce call per step, holding ĝ and ĥ (the network has no hidden parameters).
    assert all(r["calls"] == [2] * STEPS for r in ranks)
    # Both ranks apply the same averaged estimates: bitwise identical states.
    assert torch.equal(ranks[0]["means"], ranks[1]["means"])
    assert torch.equal(ranks[0]["scale"], ranks[1]["scale"])

    x, y = _dataset()
    single = _ivon()
    pyro.set_rng_seed(SEED)
    losses, means = [], []
    for t in range(STEPS):
        idx = torch.cat([_batch(t, r) for r in range(WORLD)])
        losses.append(single.step(x[idx], y[idx]))
        means.append(single.guide.loc.clone())
    # The mean of two local batch means is the mean over the concatenated batch, and ĥ = ĝε/σ is
    # linear in ĝ for a shared ε: equal in exact arithmetic, so only the order of float64 sums
    # differs (relative 1e-16 per operation), far below 1e-12 after 12 steps.
    torch.testing.assert_close(ranks[0]["means"], torch.stack(means), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ranks[0]["scale"], single.guide.scale, rtol=1e-12, atol=1e-12)
    # Each rank reports N/B_local Σ its own ℓᵢ + KL; their average is the one-process loss.
    averaged = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    torch.testing.assert_close(
        torch.tensor(averaged, dtype=torch.float64),
        torch.tensor(losses, dtype=torch.float64),
        rtol=1e-12,
        atol=0.0,
    )
    assert float((means[-1] - means[0]).abs().max()) > 1e-2  # the run moved
