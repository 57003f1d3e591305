"""``predict`` reads a NetworkModel's observation once (a one-row pass through the network) and
keeps it, σ aside, which it reads afresh every call; every pass still checks the model's sites."""

from __future__ import annotations

import copy

import pyro
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoSubnetLaplace


class Rows(nn.Module):
    """Records the rows of every input it sees, in a list its copies share (a class attribute)."""

    seen: list[int] = []

    def forward(self, x):
        Rows.seen.append(x.shape[0])
        return x


def _fitted(noise: str = "fixed"):
    pyro.clear_param_store()
    torch.manual_seed(0)
    x = torch.randn(32, 3)
    y = x[:, :1].sum(1) + 0.1 * torch.randn(32)
    net = bdl.bayesianize(nn.Sequential(Rows(), nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)))
    model = bdl.models.regressor(net, 32, noise=noise, noise_scale=0.5)
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(x, y)
    guide.fit((x, y), check_mode=False)
    return guide, x


def _rows_seen(call) -> list[int]:
    Rows.seen.clear()
    call()
    return list(Rows.seen)


def test_the_observation_is_read_once_then_kept():
    guide, x = _fitted()
    first: list = []
    # The first call reads the observation on one row, then runs the batch; later calls only the
    # batch.
    assert _rows_seen(lambda: first.extend(guide.predict(x))) == [1, 32]
    assert _rows_seen(lambda: guide.predict(x)) == [32]
    copied = copy.deepcopy(guide)  # a copy reads its own model once
    assert _rows_seen(lambda: copied.predict(x)) == [1, 32]
    for a, b in zip(first, guide.predict(x)):
        assert torch.equal(a, b)


def test_a_point_sigma_trained_after_the_first_call_is_read_afresh():
    guide, x = _fitted(noise="point")
    before = guide.predict(x)[1]
    name = next(n for n in pyro.get_param_store() if n.endswith("sigma"))
    with torch.no_grad():
        pyro.param(name).unconstrained().add_(1.0)  # σ grows by e, as training would move it
    after = guide.predict(x)[1]
    sigma = float(pyro.param(name).detach())
    # The predictive variance is the linearized output variance plus σ²; only σ² changed. The
    # two float32 variances (about 0.3) each carry a rounding error near 1e-7 relative, far
    # inside rtol=1e-4.
    assert torch.allclose(
        after - before,
        torch.full_like(before, sigma**2 - (sigma / 2.718281828459045) ** 2),
        rtol=1e-4,
    )
