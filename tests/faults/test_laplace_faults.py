"""Refusals of the Laplace guides: each raises its error type with a message naming the
argument and the fix, and changes nothing (the guide's state, the param store, the global
random states)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoLaplace, AutoSubnetLaplace
from pyro_bdl.guides.laplace.posterior import RoundOffWarning
from tests.faults.common import assert_same, rng_states

STRUCTURES = ["full", "kron", "diag"]


def _snapshot(guide) -> dict:
    store = pyro.get_param_store()
    return {
        "state": {k: v.clone() for k, v in guide.state_dict().items()},
        "params": {k: v.detach().clone() for k, v in store.items()},
        "rng": rng_states(),
    }


def _refuses(guide, call, error, match: str) -> None:
    before = _snapshot(guide)
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error
    assert_same(before, _snapshot(guide))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(20, 3, generator=g), torch.randint(0, 2, (20,), generator=g)


def _classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(1.0)), 20)


def _fitted(structure: str):
    pyro.clear_param_store()
    guide = AutoSubnetLaplace(_classifier(), subnetwork="all", hessian_structure=structure)
    data = _data()
    guide(*data)
    guide.fit(data, check_mode=False)
    return guide, data


@pytest.mark.parametrize("value", [torch.ones(3), torch.ones(2, 2), "1.0"], ids=str)
def test_prior_precision_must_be_one_number(value):
    pyro.clear_param_store()
    model = _classifier()
    before = rng_states()
    with pytest.raises(ValueError, match=r"prior_precision must be one number .* got .*layerwise"):
        AutoLaplace(model, prior_precision=value)
    assert_same(before, rng_states())


def test_prior_precision_one_element_tensor_is_accepted():
    guide = AutoLaplace(_classifier(), prior_precision=torch.tensor([2.0]))
    assert guide.prior_precision.shape == () and float(guide.prior_precision) == 2.0


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("grid", [[], [-1.0], [1.0, float("nan")]], ids=str)
def test_the_grid_is_validated_for_every_structure(structure, grid):
    guide, _ = _fitted(structure)
    call = lambda: guide.tune_prior_precision(grid=torch.tensor(grid))  # noqa: E731
    _refuses(guide, call, ValueError, r"grid must be .*Pass a 1-d tensor of prior precisions")


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("fitted", [False, True], ids=["unfitted", "refit"])
def test_a_non_finite_reduced_curvature_is_refused(structure, fitted):
    """A reduce_fn returning NaN: refused before anything is assigned; an unfitted guide stays
    unfitted, a fitted one keeps its previous fit."""
    if fitted:
        guide, data = _fitted(structure)
    else:
        pyro.clear_param_store()
        guide = AutoSubnetLaplace(_classifier(), subnetwork="all", hessian_structure=structure)
        data = _data()
        guide(*data)
    call = lambda: guide.fit(data, reduce_fn=lambda t: t * float("nan"))  # noqa: E731
    _refuses(guide, call, ValueError, r"reduce_fn returned a non-finite .* nothing was fitted")
    assert guide.fitted == fitted


def _switchable(with_b: list):
    """A regression on w, plus a site b while ``with_b[0]``; its guide, set up as it is now."""

    def model(x, y=None):
        f = x @ pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        if with_b[0]:
            f = f + pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Normal(f, 0.5), obs=y)

    pyro.clear_param_store()
    x, y = _data()[0], torch.randn(20)
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(x, y)
    return guide, x, y


def test_data_that_is_not_batches_is_refused_with_the_fix():
    """A Dataset (no __iter__) or inputs without labels: the message names what to pass."""
    pyro.clear_param_store()
    guide = AutoSubnetLaplace(_classifier(), subnetwork="all")
    x, y = _data()
    dataset = torch.utils.data.TensorDataset(x, y)
    _refuses(guide, lambda: guide.fit(dataset), TypeError, r"got TensorDataset\. Wrap .*DataLoader")
    _refuses(guide, lambda: guide.fit(x), TypeError, r"got Tensor\. Pass \(x, y\)")
    guide.fit(torch.utils.data.DataLoader(dataset, batch_size=8), check_mode=False)  # the fix


def test_inputs_of_the_wrong_width_are_refused_naming_the_rows_not_the_probe():
    """The fit reads the network's outputs on one row of the first batch; the refusal names the
    width and the rows' shape the user passed, not the one-row slice it ran on."""
    guide, (_, y) = _fitted("diag")
    wide = torch.randn(8, 4)
    _refuses(guide, lambda: guide.fit((wide, y[:8])), ValueError, r"rows of shape \(4,\)")
    with pytest.raises(ValueError) as info:
        guide.fit((wide, y[:8]))
    assert "(1, 4)" not in str(info.value), info.value


def test_a_grown_model_is_refused_naming_the_new_site():
    with_b = [False]
    guide, x, y = _switchable(with_b)
    with_b[0] = True
    match = r"model has changed .* new sites \['b'\]; the guide packs \['w'\]\. Create a new guide"
    _refuses(guide, lambda: guide.fit((x, y)), ValueError, match)
    with_b[0] = False
    guide.fit((x, y), check_mode=False)
    with_b[0] = True
    match = r"new sites \['b', 'obs'\] \(one is the target\).*Create a new guide"
    _refuses(guide, lambda: guide.predict(x), ValueError, match)


def test_a_shrunk_model_is_refused_naming_the_missing_site():
    with_b = [True]
    guide, x, y = _switchable(with_b)
    with_b[0] = False
    _refuses(guide, lambda: guide.fit((x, y)), ValueError, r"missing sites \['b'\].*new guide")


def test_a_token_language_model_is_refused():
    pyro.clear_param_store()
    net = bdl.bayesianize(nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7)))
    model = bdl.models.language_model(net, 10)
    before = rng_states()
    with pytest.raises(ValueError, match=r"likelihood='tokens'.*sequence classifier"):
        AutoLaplace(model)
    assert_same(before, rng_states())
    assert len(pyro.get_param_store()) == 0


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize(
    ("targets", "match"),
    [
        (lambda y: y.double(), "integer class labels"),
        (lambda y: y.unsqueeze(-1), r"y must have shape \(10,\)"),
        (lambda y: y + 2, r"class labels must lie in \[0, 2\)"),
    ],
    ids=["float", "column", "out_of_range"],
)
def test_val_ll_checks_the_targets_of_every_batch(structure, targets, match):
    """The validation targets of every batch, not only the first row read for the likelihood,
    are checked before λ changes, and without Pyro's validation (which would only catch an
    out-of-range label, with its own message, and let the others through)."""
    guide, (x, y) = _fitted(structure)
    batches = [(x[:10], y[:10]), (x[10:], targets(y[10:]))]
    call = lambda: guide.tune_prior_precision(method="val_ll", data=batches)  # noqa: E731
    with pyro.validation_enabled(False):
        _refuses(guide, call, ValueError, match)


def test_a_prior_the_posterior_cannot_take_changes_nothing():
    """λ = 1e-30 on a GGN of rank ≤ 6 over 14 weights: the dense factorisation of H_S needs a
    material jitter and warns; as an error (``-W error``) the refusal leaves λ and the posterior
    as they were, not the new λ beside the old factor."""
    pyro.clear_param_store()
    guide = AutoSubnetLaplace(_classifier(), subnetwork="all", hessian_structure="full")
    x, y = _data()
    guide(x, y)
    guide.fit((x[:3], y[:3]), check_mode=False)
    grid = torch.tensor([1e-30])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoundOffWarning)
        call = lambda: guide.tune_prior_precision(search="grid", grid=grid)  # noqa: E731
        _refuses(guide, call, RoundOffWarning, "jitter")
