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
from tests.common import assert_close

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
    with pytest.warns(
        NotAtModeWarning, match="not look trained to a MAP.*Train the network"
    ) as caught:
        guide.fit(data)
    assert guide.fitted  # the warning does not stop the fit
    assert caught[0].filename == __file__  # it points at the caller's line


@pytest.mark.parametrize("kwargs", STRUCTURES, ids=lambda k: k.get("hessian_structure", "full"))
def test_a_network_at_its_map_fits_silently(kwargs):
    guide, data = _guide(trained=True, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit(data)
    assert guide.fitted


def test_check_mode_false_fits_an_untrained_network_silently():
    guide, data = _guide(trained=False, subnetwork="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit(data, check_mode=False)
    assert guide.fitted


FOLDED = [
    *STRUCTURES,
    {"subnetwork": "random", "size": 20},
    {"subnetwork": "random", "size": 20, "hessian_structure": "diag"},
]


@pytest.mark.parametrize("kwargs", FOLDED, ids=str)
def test_the_check_reads_its_gradient_from_the_fit_passes(kwargs, monkeypatch):
    """The gradient comes from the fit's own passes (J^T r, or one more backward column) and
    equals the gradient of a separate pass; the posterior is the one a fit without the check
    gives. Both are float64 sums of the same terms in another order: rtol 1e-10 is round-off."""
    from pyro_bdl.guides.laplace import guide as guide_module
    from pyro_bdl.guides.laplace import model as laplace_model

    seen = []
    monkeypatch.setattr(guide_module, "warn_if_not_at_mode", lambda g, post: seen.append(g))
    calls = []
    real = laplace_model.training_loss_gradient
    spy = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(laplace_model, "training_loss_gradient", spy)
    monkeypatch.setattr(guide_module, "training_loss_gradient", spy, raising=False)
    guide, data = _guide(trained=False, **kwargs)
    guide.fit(data)
    assert calls == []  # no extra pass over the data
    checked_variances = guide.posterior.variances().clone()
    index = guide.subnet_index
    theta = guide.map_loc[index].double()
    lam = guide.posterior.lam
    obs = guide._observe(data)
    expected = real(guide._raw_model, guide.layout, guide.map_loc, data, obs, index, batch_size=64)
    assert_close(
        seen[0], expected + torch.as_tensor(lam, dtype=F64) * theta, rtol=1e-10, atol=1e-12
    )
    guide.fit(data, check_mode=False)
    assert_close(guide.posterior.variances(), checked_variances, rtol=1e-10, atol=0.0)


def test_the_residual_is_the_written_out_gradient_of_each_likelihood():
    # r = ∂(-log p(y | f))/∂f: (f - y)/σ² (Gaussian), σ(f) - y (Bernoulli), softmax(f) - onehot(y)
    # (categorical). The mode check's gradient Σ Jᵀ r and training_loss_gradient share this NLL,
    # so only a formula written out here pins its scale.
    from pyro_bdl.guides.laplace.model import Observation, residual

    g = torch.Generator().manual_seed(0)
    f = torch.randn(6, 3, generator=g, dtype=F64)
    y = torch.randn(6, 3, generator=g, dtype=F64)
    gaussian = Observation("y", "gaussian", 0.4, 3, False, None)
    assert_close(residual(f, y, gaussian), (f - y) / 0.4**2, rtol=1e-12)
    labels = (y > 0).to(F64)
    bernoulli = Observation("y", "bernoulli", None, 3, False, None)
    assert_close(residual(f, labels, bernoulli), f.sigmoid() - labels, rtol=1e-12)
    classes = torch.tensor([0, 2, 1, 1, 0, 2])
    categorical = Observation("y", "categorical", None, 3, False, None)
    onehot = nn.functional.one_hot(classes, 3).to(F64)
    assert_close(residual(f, classes, categorical), f.softmax(-1) - onehot, rtol=1e-12)
