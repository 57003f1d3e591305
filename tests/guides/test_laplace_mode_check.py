"""A Laplace fit at weights far from a mode of the training loss warns that the network is not
trained to a MAP estimate; at a MAP it is silent, for every Hessian structure."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoSubnetLaplace
from pyro_bdl.guides.laplace.model import NotAtModeWarning

F64 = torch.float64
STRUCTURES = [
    {"subnetwork": "all"},
    {"subnetwork": "all", "hessian_structure": "kron"},
    {"subnetwork": "all", "hessian_structure": "diag"},
    {"subnetwork": "last_layer"},
]


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 3, generator=g, dtype=F64)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).clamp(max=2)
    return x, y


def _net(trained: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if trained:  # the MAP under the Normal(0, 1) prior, to L-BFGS's precision
        x, y = _data()
        optim = torch.optim.LBFGS(net.parameters(), max_iter=500, line_search_fn="strong_wolfe")

        def closure():
            optim.zero_grad()
            prior = sum(p.square().sum() for p in net.parameters()) / 2
            loss = nn.functional.cross_entropy(net(x), y, reduction="sum") + prior
            loss.backward()
            return loss

        optim.step(closure)
    return net


def _guide(trained: bool, **kwargs):
    x, y = _data()
    model = bdl.models.classifier(bdl.bayesianize(_net(trained), bdl.priors.Normal(1.0)), len(y))
    guide = AutoSubnetLaplace(model, **kwargs)
    guide(x, y)
    return guide, (x, y)


@pytest.mark.parametrize("kwargs", STRUCTURES, ids=lambda k: k.get("hessian_structure", "full"))
def test_an_untrained_network_warns_to_train_it_first(kwargs):
    guide, data = _guide(trained=False, **kwargs)
    with pytest.warns(NotAtModeWarning, match="not look trained to a MAP.*Train the network"):
        guide.fit(data)
    assert guide.fitted  # the warning does not stop the fit


@pytest.mark.parametrize("kwargs", STRUCTURES, ids=lambda k: k.get("hessian_structure", "full"))
def test_a_network_at_its_map_fits_silently(kwargs):
    guide, data = _guide(trained=True, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit(data)


def test_check_mode_false_fits_an_untrained_network_silently():
    guide, data = _guide(trained=False, subnetwork="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit(data, check_mode=False)
