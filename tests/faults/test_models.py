"""Fault injection against pyro_bdl.models: bad inputs, wrong network shapes, bad likelihood
arguments. Every refusal names the argument, expected vs actual and a fix, and leaves nothing
changed (parameters, buffers such as BatchNorm running statistics, the param store, RNG states).

Classes of issue 18 covered here: 5 (a batch larger than dataset_size silently unscaled) and 6
(raw torch/Pyro errors for a wrong dtype, a wrong feature width, a multi-output regressor), plus
the bad likelihood arguments of issue 16 (labels, label columns, σ priors)."""

import math
import types

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.guides import AutoMeanField, AutoSubnetLaplace
from pyro_bdl.infer import VOGN
from tests.faults.common import assert_same, rng_states

N = 50


def snapshot(*objects) -> dict:
    """Copies of everything a refusal must leave as it was: the RNG states, the param store and
    the state dicts (parameters and buffers) of the given modules."""
    state = {
        "rng": rng_states(),
        "params": {k: v.detach().clone() for k, v in pyro.get_param_store().items()},
    }
    for i, obj in enumerate(objects):
        state[f"module{i}"] = {k: v.detach().clone() for k, v in obj.state_dict().items()}
    return state


def assert_unchanged(before: dict, after: dict, *, rng: bool = True) -> None:
    keys = [k for k in before if rng or k != "rng"]
    assert_same({k: before[k] for k in keys}, {k: after[k] for k in keys})


def _bn_net(outputs=3, dtype=torch.float32):
    return bayesianize(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, outputs)).to(
            dtype
        )
    )


class _Custom(nn.Module):
    """A network whose layers' call order is not declared (no nn.Sequential): the model learns
    its output width on the first call."""

    def __init__(self, outputs):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, outputs)

    def forward(self, x):
        return self.head(self.body(x).relu())


def _refused(model, net, args, error, match):
    """``model(*args)`` raises ``error`` matching ``match`` and changes nothing."""
    before = snapshot(net)
    with pytest.raises(error, match=match):
        model(*args)
    assert_unchanged(before, snapshot(net))


# --- class 6: dtype and feature width --------------------------------------------------------

X, Y = torch.randn(10, 4), torch.randint(0, 3, (10,))


@pytest.mark.parametrize(
    "x, error, match",
    [
        (X.double(), TypeError, r"x has dtype torch.float64 .* expects torch.float32 .*x\.to"),
        (X.half(), TypeError, r"x has dtype torch.float16 .* expects torch.float32"),
        (X.long(), TypeError, r"x has dtype torch.int64 .* expects torch.float32"),
        (torch.randn(10, 5), ValueError, r"x has 5 features .*expects 4\. Pass inputs with 4"),
        (torch.randn(10, 2, 2, 3), ValueError, r"x has 3 features"),
    ],
)
def test_bad_input_dtype_or_width(x, error, match):
    net = _bn_net()
    model = models.classifier(net, N)
    model(X, Y)  # a good call first: the refusal must also hold after the first call
    _refused(model, net, (x, Y), error, match)


def test_float64_input_into_a_float32_net_under_svi():
    net = _bn_net()
    model = models.classifier(net, N)
    guide = AutoMeanField(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    svi.step(X, Y)
    before = snapshot(net)
    with pytest.raises(TypeError, match=r"x has dtype torch.float64"):
        svi.step(X.double(), Y)
    # SVI runs the guide (which draws weights) before the model refuses, so the RNG has moved;
    # parameters, optimizer-visible params and running statistics have not.
    assert_unchanged(before, snapshot(net), rng=False)


def test_dtype_follows_a_network_converted_after_the_model():
    net = _bn_net()
    model = models.classifier(net, N)
    net.double()
    model(X.double(), Y)
    _refused(model, net, (X, Y), TypeError, r"float32 but the network's weights are torch.float64")


def test_flatten_and_conv_first_layers():
    flat = bayesianize(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)))
    model = models.classifier(flat, N)
    model(torch.randn(5, 3, 4), Y[:5])
    _refused(model, flat, (torch.randn(5, 3, 5), Y[:5]), ValueError, r"x has 15 features")
    conv = bayesianize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 3)))
    model = models.classifier(conv, N)
    _refused(model, conv, (torch.randn(5, 2, 6, 6), Y[:5]), ValueError, r"x has 2 features")
    _refused(model, conv, (torch.randn(3, 6, 6), Y[:3]), ValueError, r"x must have 4 dims")


def test_an_unbatched_input_is_refused_with_its_reshape():
    """A 1-D x passes torch's Linear as one unbatched example, which the model would read as
    x.shape[0] rows and refuse later at the output's shape, without the reshape to make."""
    net = _bn_net()
    model = models.classifier(net, N)
    _refused(
        model, net, (X[0], Y[:1]), ValueError, r"shape \(4,\): one example .*x\.unsqueeze\(0\)"
    )
    _refused(model, net, (torch.randn(6),), ValueError, r"shape \(6,\) .*rows of 4 features")
    line = bayesianize(nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)))
    regressor = models.regressor(line, N, noise_scale=0.1)
    x, y = torch.linspace(-1, 1, 10), torch.zeros(10)
    _refused(regressor, line, (x, y), ValueError, r"one feature per row.*x\.unsqueeze\(-1\)")
    regressor(x.unsqueeze(-1), y)  # the reshape it names is accepted


def test_input_checks_can_be_switched_off_for_a_converting_network():
    class Converts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x.float())

    net = bayesianize(Converts())
    model = models.classifier(net, N)
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64"):
        model(X.double(), Y)
    model.check_inputs = False
    assert model(X.double(), Y).shape == (10, 3)


# --- class 6: a regressor (or classifier) over a network of the wrong output width -----------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda net: models.regressor(net, N, 0.5), r"regressor needs one output .* gives 3"),
        (lambda net: models.regressor(net, N, noise="learned"), r"gives 3 outputs"),
        (lambda net: models.heteroscedastic_regressor(net, N), r"needs 2 outputs .* gives 3"),
        (lambda net: models.binary_classifier(net, N), r"one logit per example; .* gives 3"),
    ],
)
def test_wrong_output_width_refused_at_construction(make, match):
    net = _bn_net(outputs=3)
    before = snapshot(net)
    with pytest.raises(ValueError, match=match):
        make(net)
    assert_unchanged(before, snapshot(net))


@pytest.mark.parametrize(
    "make, y, match",
    [
        (lambda n: models.regressor(n, N, 0.5), torch.randn(10, 3), r"one output .*\(10, 3\)"),
        (lambda n: models.regressor(n, N, 0.5), None, r"one output per example"),
        (lambda n: models.heteroscedastic_regressor(n, N), torch.randn(10), r"shape \(B, 2\)"),
        (lambda n: models.binary_classifier(n, N), torch.ones(10), r"one logit per label"),
    ],
)
def test_wrong_output_width_of_an_opaque_network_rolls_back(make, y, match):
    # The width is known only after the forward pass: the first call restores the RNG and the
    # BatchNorm running statistics it changed before refusing.
    net = bayesianize(_Custom(outputs=3))
    _refused(make(net), net, (X, y), ValueError, match)


def test_multilabel_columns_learnt_on_the_first_call_are_checked_before_the_forward_pass():
    net = bayesianize(_Custom(outputs=3))
    model = models.multilabel_classifier(net, N)
    _refused(model, net, (X, torch.ones(10, 2)), ValueError, r"shape \(10, 2\) but .*\(10, 3\)")
    model(X, torch.ones(10, 3))
    _refused(model, net, (X, torch.ones(10, 4)), ValueError, r"4 label column\(s\) .* 3 output")


def test_categorical_over_one_output_per_row():
    class Vector(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x).squeeze(-1)

    net = bayesianize(Vector())
    _refused(models.classifier(net, N), net, (X, Y), ValueError, r"shape \(10, C\)")


# --- class 5: a batch larger than the dataset ------------------------------------------------


@pytest.mark.parametrize(
    "make", [models.classifier, lambda n, size: models.regressor(n, size, 1.0)]
)
def test_batch_larger_than_dataset_size_refused_with_targets(make):
    outputs = 3 if make is models.classifier else 1
    net = _bn_net(outputs=outputs)
    model = make(net, 8)
    y = Y if outputs == 3 else torch.randn(10)
    _refused(model, net, (X, y), ValueError, r"batch has 10 rows but dataset_size is 8:.*B <= N")
    # Predicting on more rows than the dataset stays allowed and unscaled.
    tr = pyro.poutine.trace(model).get_trace(X)
    assert tr.nodes["y"]["scale"] == 1.0


# --- likelihood arguments and labels ----------------------------------------------------------


@pytest.mark.parametrize(
    "y, match",
    [
        (torch.tensor([0, 1, 2, 1]), r"0 or 1 .* got 2 at index \(2,\)"),
        (torch.tensor([0, -1, 1, 1]), r"0 or 1 .* got -1"),
        (torch.tensor([0.0, 0.5, 1.0, 1.0]), r"0 or 1 .* got 0.5"),
        (torch.tensor([0.0, math.nan, 1.0, 1.0]), r"y contains 1 non-finite"),
        (torch.zeros(4, 1), r"shape \(4,\) of 0/1 labels .*multilabel_classifier"),
    ],
)
def test_binary_labels_outside_zero_one(y, match):
    net = bayesianize(nn.Sequential(nn.Linear(4, 1)))
    _refused(models.binary_classifier(net, N), net, (X[:4], y), ValueError, match)


@pytest.mark.parametrize(
    "y, match",
    [
        (torch.ones(4, 2), r"2 label column\(s\) but the network has 3 output"),
        (torch.ones(4), r"shape \(4, K\) of 0/1 labels"),
        (torch.full((4, 3), 2.0), r"0 or 1 .* got 2.0"),
    ],
)
def test_multilabel_wrong_label_columns(y, match):
    net = bayesianize(nn.Sequential(nn.Linear(4, 3)))
    _refused(models.multilabel_classifier(net, N), net, (X[:4], y), ValueError, match)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"noise_prior": lambda: dist.LogNormal(0.0, -1.0)}, ValueError, r"scale"),
        ({"noise_prior": lambda: dist.LogNormal(math.nan, 1.0)}, ValueError, "loc"),
        ({"noise_prior": lambda: dist.HalfNormal(math.inf)}, ValueError, "finite"),
        ({"noise_prior": dist.Normal(0.0, 1.0)}, ValueError, r"mass on σ > 0"),
        ({"noise_prior": dist.LogNormal(torch.zeros(2), 1.0)}, ValueError, "one scalar σ"),
        ({"noise_prior": 1.0}, TypeError, "distribution over σ > 0"),
        (
            {"noise_prior": dist.HalfNormal(1.0), "noise": "fixed", "noise_scale": 1.0},
            ValueError,
            "noise='learned'",
        ),
        ({"noise_scale": 0.5}, ValueError, "drop noise_scale"),
        (
            {"noise": "point", "noise_scale": -1.0},
            ValueError,
            r"noise_scale must be finite and > 0",
        ),
        ({"noise": "point", "noise_scale": math.nan}, ValueError, "noise_scale must be finite"),
        ({"noise": "fixed"}, ValueError, "needs noise_scale"),
        ({"noise": "hetero"}, ValueError, r"unknown noise 'hetero'"),
    ],
)
def test_bad_noise_arguments(kwargs, error, match):
    kwargs = {"noise": "learned", **kwargs}
    if isinstance(kwargs.get("noise_prior"), types.FunctionType):
        # Built with validation off, so that the prior reaches the model's own check.
        with pyro.validation_enabled(False):
            kwargs["noise_prior"] = kwargs["noise_prior"]()
    net = bayesianize(nn.Linear(4, 1))
    before = snapshot(net)
    with pytest.raises(error, match=match):
        models.regressor(net, N, **kwargs)
    assert_unchanged(before, snapshot(net))


def test_negative_prior_parameter_with_validation_is_refused_by_the_distribution():
    with pytest.raises(ValueError, match="scale"):
        dist.LogNormal(0.0, -1.0)


# --- methods that refuse a likelihood ---------------------------------------------------------


def test_laplace_refuses_a_learned_sigma_before_the_map_phase():
    net = bayesianize(nn.Sequential(nn.Linear(4, 1)))
    model = models.regressor(net, N, noise="learned")
    before = snapshot(net)
    # Refused when the guide is built, so no MAP training is spent on a model fit cannot take.
    with pytest.raises(
        ValueError, match=r"noise='learned'.*Use regressor\(\.\.\., noise='point'\)"
    ):
        AutoSubnetLaplace(model, subnetwork="all")
    assert_unchanged(before, snapshot(net))


@pytest.mark.parametrize("noise", ["learned", "point"])
def test_vogn_refuses_a_learned_sigma(noise):
    net = bayesianize(nn.Sequential(nn.Linear(4, 1)))
    model = models.regressor(net, N, noise=noise)
    vogn = VOGN(model, dataset_size=N, lr=1e-3)
    before = snapshot(net)
    with pytest.raises(ValueError, match="sigma'"):
        vogn.step(X, torch.randn(10))
    after = snapshot(net)
    # VOGN refuses after tracing the model once: the trace draws from the prior (RNG) and
    # registers the point σ's param; the network's weights and buffers are untouched.
    for name in model.param_names:
        after["params"].pop(name, None)
    assert_unchanged(before, after, rng=False)
