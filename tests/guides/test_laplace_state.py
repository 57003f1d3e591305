"""The state of a fitted Laplace guide, for every Hessian structure, loads into a fresh guide of
the same settings and gives the same predictions, variances and evidence."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoLaplace, AutoSubnetLaplace
from pyro_bdl.guides.state_checks import StateDictMismatchError

F64 = torch.float64
SETTINGS = {
    "full": dict(subnetwork="all"),
    "kron": dict(subnetwork="all", hessian_structure="kron"),
    "diag": dict(subnetwork="all", hessian_structure="diag"),
    "last_layer_kron": dict(subnetwork="last_layer", hessian_structure="kron"),
}


def _regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g, dtype=F64)
    return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(40, generator=g, dtype=F64)


def _guide(**kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1), nn.Flatten(0)).double()
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(1.0)), 40, 0.3)
    guide = AutoSubnetLaplace(model, **kwargs)
    guide(*_regression())
    return guide


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_fitted_state_loads_into_a_fresh_guide_with_the_same_predictions(name):
    data = _regression()
    fitted = _guide(**SETTINGS[name])
    fitted.fit(data, check_mode=False)  # the round trip, not the MAP, is the subject
    fitted.tune_prior_precision(prior_structure="layerwise", tune_noise=True)
    fresh = _guide(**SETTINGS[name])
    fresh.load_state_dict(fitted.state_dict())
    x = data[0][:7]
    for ours, theirs in zip(fresh.predict(x), fitted.predict(x)):
        assert torch.equal(ours, theirs)
    assert torch.equal(fresh.posterior.variances(), fitted.posterior.variances())
    assert fresh.noise_scale == fitted.noise_scale
    assert fresh.marginal_likelihood() == fitted.marginal_likelihood()


def test_a_state_of_another_structure_is_refused_before_anything_loads():
    fitted = _guide(**SETTINGS["kron"])
    fitted.fit(_regression(), check_mode=False)
    fresh = _guide(**SETTINGS["diag"])
    with pytest.raises(StateDictMismatchError, match=r"holds a 'kron' posterior.*'diag'"):
        fresh.load_state_dict(fitted.state_dict())
    assert not fresh.fitted


def test_auto_laplace_state_round_trip():
    data = _regression()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1), nn.Flatten(0)).double()
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(1.0)), 40, 0.3)
    fitted, fresh = AutoLaplace(model), AutoLaplace(model)
    fitted(*data), fresh(*data)
    fitted.fit(data, check_mode=False)
    fresh.load_state_dict(fitted.state_dict())
    assert torch.equal(fresh.predict(data[0])[1], fitted.predict(data[0])[1])


def _nan_first(t: torch.Tensor) -> torch.Tensor:
    return t.flatten().index_fill(0, torch.tensor([0]), float("nan")).reshape(t.shape)


@pytest.mark.parametrize(
    ("key", "corrupt", "match"),
    [
        ("prior_precision", lambda t: -t, r"prior_precision: must be finite and > 0"),
        ("prior_precision", _nan_first, r"prior_precision: must be finite and > 0"),
        ("map_loc", _nan_first, r"'map_loc': contains NaN or inf"),
        ("ggn", _nan_first, r"'ggn': contains NaN or inf"),
        ("subnet_index", lambda t: t.flip(0), r"subnet_index: .*sorted and without duplicates"),
        ("subnet_index", lambda t: torch.zeros_like(t), r"sorted and without duplicates"),
    ],
    ids=["negative_precision", "nan_precision", "nan_map", "nan_ggn", "reversed", "repeated"],
)
def test_a_corrupt_fitted_state_is_refused_before_anything_loads(key, corrupt, match):
    """A state whose values no fit gives (a prior precision ≤ 0 or NaN, NaN weights or
    curvature, repeated or unsorted subnetwork indices) is refused, naming the key, and the
    guide stays unfitted; it would otherwise predict with a NaN or clamped posterior."""
    fitted = _guide(**SETTINGS["full"])
    fitted.fit(_regression(), check_mode=False)
    state = fitted.state_dict()
    state[key] = corrupt(state[key])
    fresh = _guide(**SETTINGS["full"])
    with pytest.raises(StateDictMismatchError, match=match):
        fresh.load_state_dict(state)
    assert not fresh.fitted


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_loaded_guide_tuned_again_saves_what_it_tuned(name):
    """λ and σ tuned after a load are what the next state holds (a loaded ``full`` guide saved
    the σ it was loaded with beside the factor of the new one)."""
    data = _regression()
    fitted = _guide(**SETTINGS[name])
    fitted.fit(data, check_mode=False)
    loaded = _guide(**SETTINGS[name])
    loaded.load_state_dict(fitted.state_dict())
    loaded.tune_prior_precision(tune_noise=True)
    assert loaded.noise_scale != fitted.noise_scale
    again = _guide(**SETTINGS[name])
    again.load_state_dict(loaded.state_dict())
    assert again.noise_scale == loaded.noise_scale
    for ours, theirs in zip(again.predict(data[0][:7]), loaded.predict(data[0][:7])):
        assert torch.equal(ours, theirs)
    assert again.marginal_likelihood() == loaded.marginal_likelihood()
