"""The one-Linear-layer path of the full GGN (:func:`pyro_bdl.curvature.ggn.linear_layer_ggn`):
the same posterior as the general Jacobian path, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.curvature import ggn as ggn_module
from pyro_bdl.guides import AutoSubnetLaplace
from pyro_bdl.guides.laplace import model as laplace_model
from tests.common import assert_close

#: These tests check the curvature and posterior algebra at fixed weights that are not trained to a
#: MAP estimate, where fit rightly warns (NotAtModeWarning); that warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore::pyro_bdl.guides.laplace.model.NotAtModeWarning")

F64 = torch.float64


def _data(n=37, d=3, regression=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=F64)
    if regression:
        return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    return x, ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).clamp(max=2)


def _model(regression=False, bias=True):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, 5, bias=bias), nn.Tanh(), nn.Linear(5, 1 if regression else 3, bias=bias)
    ).double()
    if regression:
        net = nn.Sequential(*net, nn.Flatten(0))
    net = bdl.bayesianize(net, bdl.priors.Normal(1.0))
    if regression:
        return bdl.models.regressor(net, 37, noise_scale=0.3)
    return bdl.models.classifier(net, 37)


def _fit(model, data, subnetwork, batch_size=8):
    guide = AutoSubnetLaplace(model, subnetwork=subnetwork, batch_size=batch_size)
    guide(*data)
    return guide.fit(data)


@pytest.mark.parametrize(
    ("regression", "bias", "subnetwork"),
    [
        (False, True, "last_layer"),
        (True, True, "last_layer"),
        (False, False, "last_layer"),
        (False, True, ["0.weight", "0.bias"]),
    ],
)
def test_one_linear_layer_matches_the_general_path(monkeypatch, regression, bias, subnetwork):
    model, data = _model(regression, bias), _data(regression=regression)
    if not isinstance(subnetwork, str):  # a hidden layer: G_n = ∂f/∂z is not the identity
        sites = [s.name for s in _fit(model, data, "all").layout]
        subnetwork = [s for s in sites if s.endswith(("0.weight", "0.bias"))]
    calls = []
    real = ggn_module.linear_layer_ggn
    monkeypatch.setattr(
        laplace_model, "linear_layer_ggn", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    fast = _fit(model, data, subnetwork)
    assert calls, "the one-layer path was not taken"
    monkeypatch.setattr(laplace_model, "single_linear", lambda layout, index: None)
    calls.clear()
    general = _fit(model, data, subnetwork)
    assert not calls
    assert torch.equal(fast.subnet_index, general.subnet_index)
    assert_close(fast.ggn, general.ggn, rtol=1e-10, atol=1e-12)
    assert_close(fast.scale_tril, general.scale_tril, rtol=1e-10, atol=1e-12)
    assert_close(fast.marginal_likelihood(), general.marginal_likelihood(), rtol=1e-10)
    x = data[0][:6]
    if regression:  # the predictive mean and variance
        for a, b in zip(fast.predict(x), general.predict(x)):
            assert_close(a, b, rtol=1e-10, atol=1e-12)
    else:
        assert_close(fast.predict(x), general.predict(x), rtol=1e-10, atol=1e-12)
        obs = fast._observe((x,), without_targets=True)
        for (_, jf, _), (_, jg, _) in zip(
            fast._jacobians((x,), obs), general._jacobians((x,), obs)
        ):
            var_f = fast.posterior.apply_scale(jf).square().sum(-1)
            var_g = general.posterior.apply_scale(jg).square().sum(-1)
            assert_close(var_f, var_g, rtol=1e-10, atol=1e-12)


def test_a_layer_called_twice_takes_the_general_path(monkeypatch):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.head(torch.tanh(self.body(x)))))

    torch.manual_seed(0)
    model = bdl.models.classifier(bdl.bayesianize(Twice().double(), bdl.priors.Normal(1.0)), 37)
    data = _data()
    fast = _fit(model, data, "last_layer")
    monkeypatch.setattr(laplace_model, "single_linear", lambda layout, index: None)
    general = _fit(model, data, "last_layer")
    assert_close(fast.ggn, general.ggn, rtol=1e-10, atol=1e-12)


def test_rows_follow_the_memory_budget(monkeypatch):
    seen = []
    real = ggn_module.linear_layer_ggn

    def spy(forward, *rest, **kw):
        def wrapped():
            out = forward()
            seen.append(len(out))
            return out

        return real(wrapped, *rest, **kw)

    monkeypatch.setattr(laplace_model, "linear_layer_ggn", spy)
    model, data = _model(), _data()
    guide = AutoSubnetLaplace(model, subnetwork="last_layer", batch_size=16, chunk_memory=1)
    guide(*data)
    guide.fit(data)
    assert max(seen) == 1 and len(seen) == len(data[0])


@pytest.mark.parametrize("block", [1, 2, 3, 7, 512])
def test_subnet_ggn_blocks_give_the_whole_product(block):
    g = torch.Generator().manual_seed(1)
    jac = torch.randn(5, 3, 7, generator=g, dtype=F64)
    factor = torch.randn(5, 3, 2, generator=g, dtype=F64)
    m = torch.einsum("bck,bcs->bks", factor, jac).reshape(-1, 7)
    start = torch.randn(7, 7, generator=g, dtype=F64)
    out = ggn_module.subnet_ggn(jac, factor, out=start.clone(), block=block)
    assert_close(out, start + m.T @ m, rtol=1e-12, atol=1e-12)
    assert_close(ggn_module.subnet_ggn(jac, factor, block=block), m.T @ m, rtol=1e-12, atol=1e-12)


def test_kfac_sums_give_the_same_factors_whatever_the_columns_per_pass():
    from pyro_bdl.curvature.ggn import output_hessian_factor
    from pyro_bdl.curvature.kfac import KronLayer, kfac_sums

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 4)).double()
    x = torch.randn(6, 2, 4, 4, dtype=F64)
    layers = [KronLayer(net[0], "conv", True), KronLayer(net[3], "linear", True)]
    sums = []
    for grad_bytes in (1, 1 << 30):  # one column of L per pass, then all four at once
        a = [torch.zeros(19, 19, dtype=F64), torch.zeros(13, 13, dtype=F64)]
        g = [torch.zeros(3, 3, dtype=F64), torch.zeros(4, 4, dtype=F64)]
        factor = lambda f: output_hessian_factor(f, "categorical")  # noqa: E731
        kfac_sums(lambda: net(x), layers, factor, a, g, grad_bytes=grad_bytes)
        sums.append(a + g)
    for one, many in zip(*sums):
        assert_close(one, many, rtol=1e-12, atol=1e-14)
