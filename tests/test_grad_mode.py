"""The calls that differentiate the network internally work under ``torch.no_grad()`` and
``torch.inference_mode()``, as evaluation code calls them, and give what they give with autograd
on (pyro_bdl/_grad_mode.py)."""

from __future__ import annotations

import warnings

import pyro
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl._grad_mode import differentiates
from pyro_bdl.guides.laplace import PriorPrecisionBoundWarning

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def _data(n: int = 48):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return x, (x[:, 0] > 0).long(), x[:, 0] + 0.1 * torch.randn(n, generator=g)


def _model(regression: bool = False):
    torch.manual_seed(1)
    outputs = 1 if regression else 2
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, outputs)))
    if regression:
        return bdl.models.regressor(net, 48, noise="fixed", noise_scale=0.1)
    return bdl.models.classifier(net, 48)


def _laplace(structure: str, subnetwork: str, regression: bool = False):
    pyro.clear_param_store()
    x, y, yr = _data()
    target = yr if regression else y
    guide = bdl.guides.AutoSubnetLaplace(
        _model(regression), subnetwork=subnetwork, hessian_structure=structure, prior_precision=1.0
    )
    guide(x, target)
    return guide, x, target


def _laplace_calls():
    """(name, call(guide, x, y) -> result) of every Laplace call that differentiates."""
    return {
        "fit": lambda g, x, y: g.fit((x, y), check_mode=False).posterior.variances(),
        "predict": lambda g, x, y: g.predict(x),
        "tune_marglik": lambda g, x, y: g.tune_prior_precision(),
        "tune_val_ll": _tune_on_validation,
    }


def _tune_on_validation(guide, x, y):
    # These data favour the grid's smallest λ; its edge warning is beside the point here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PriorPrecisionBoundWarning)
        return guide.tune_prior_precision((x, y), method="val_ll")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("call", list(_laplace_calls()))
@pytest.mark.parametrize(("structure", "subnetwork"), [("kron", "all"), ("full", "last_layer")])
def test_laplace_calls_give_the_same_result_under_no_grad_and_inference_mode(
    call, mode, structure, subnetwork
):
    fn = _laplace_calls()[call]
    results = []
    for context in (torch.enable_grad, MODES[mode]):
        guide, x, y = _laplace(structure, subnetwork)
        guide.fit((x, y), check_mode=False)
        with context():
            out = fn(guide, x, y)
        results.append(torch.as_tensor(out))
        assert torch.is_grad_enabled()  # the caller's mode is back after the block
    # The same computation on the same numbers, in the same order: equal bit for bit.
    assert torch.equal(results[0], results[1])
    assert not results[1].requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_laplace_regression_predictive_distribution_under_no_grad(mode):
    guide, x, y = _laplace("kron", "all", regression=True)
    guide.fit((x, y), check_mode=False)
    expected = guide.predictive_distribution(x)
    with MODES[mode]():
        got = guide.predictive_distribution(x)
    assert torch.equal(expected.mean, got.mean) and torch.equal(expected.stddev, got.stddev)


@pytest.mark.parametrize("method", ["IVON", "VOGN"])
@pytest.mark.parametrize("mode", MODES)
def test_a_natural_gradient_step_under_no_grad_is_the_step_with_grad(method, mode):
    """IVON under no_grad used to take the step with ĝ = 0 (its momentum decayed by β₁ and
    nothing else), and VOGN said no layer was recorded."""
    x, y, _ = _data()
    states = []
    for context in (torch.enable_grad, MODES[mode]):
        pyro.clear_param_store()
        fit = getattr(bdl.infer, method)(_model(), dataset_size=48, lr=0.1)
        torch.manual_seed(3)
        fit.step(x, y)  # the first step with autograd on, so both runs share their set-up
        with context():
            fit.step(x, y)
        states.append([t.clone() for t in (fit.state.mean, fit.state.momentum)])
    for a, b in zip(*states):
        assert torch.equal(a, b)
    assert states[0][1].abs().sum() > 0


def test_a_first_step_and_a_setup_under_no_grad_work():
    x, y, _ = _data()
    for method in ("VOGN", "IVON"):
        pyro.clear_param_store()
        fit = getattr(bdl.infer, method)(_model(), dataset_size=48)
        with torch.no_grad():
            fit.setup(x, y)
            loss = fit.step(x, y)
        assert fit.step_count == 1 and torch.isfinite(torch.tensor(loss))


def test_inference_tensors_passed_directly_are_copied():
    guide, x, y = _laplace("kron", "all")
    guide.fit((x, y), check_mode=False)
    expected = guide.predict(x)
    with torch.inference_mode():
        x_inf = x.clone()
    assert x_inf.is_inference()
    assert torch.equal(guide.predict(x_inf), expected)  # called outside inference mode too
    assert torch.equal(guide.predict({"x": x_inf}["x"]), expected)
    with torch.inference_mode():
        y_inf = y.clone()
    guide.fit((x_inf, y_inf), check_mode=False)  # a tuple of inference tensors


def test_inference_tensors_from_an_iterable_get_a_clear_error():
    guide, x, y = _laplace("kron", "all")
    with torch.inference_mode():
        batches = [(x.clone(), y.clone())]

    class Loader:  # not a list: the tensors arrive only while the fit runs, as a DataLoader's
        def __iter__(self):
            return iter(batches)

    with pytest.raises(RuntimeError, match=r"fit differentiates.*inference tensors.*no_grad"):
        guide.fit(Loader(), check_mode=False)


def test_the_decorator_keeps_other_errors_and_the_callers_mode():
    @differentiates
    def boom(t):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        raise RuntimeError("something else")

    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"^something else$"):
        boom(torch.ones(1))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"^something else$"):
            boom(torch.ones(1))
        assert not torch.is_grad_enabled()
