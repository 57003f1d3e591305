import math

import pytest
import torch
from torch import nn

from pyro_bdl import priors
from pyro_bdl.distributions import ScaleMixtureNormal
from tests.common import assert_close


def test_normal_prior_shape_and_log_prob():
    lin = nn.Linear(3, 2)
    d = priors.Normal(0.5, 2.0)(lin, "weight", lin.weight)
    assert d.event_shape == (2, 3) and d.batch_shape == ()
    w = torch.randn(2, 3)
    expected = torch.distributions.Normal(0.5, 2.0).log_prob(w).sum()
    assert_close(d.log_prob(w), expected)


@pytest.mark.parametrize(
    "method, expected",
    [("kaiming", math.sqrt(2 / 12)), ("xavier", math.sqrt(2 / (12 + 20))), ("radford", 12**-0.5)],
)
def test_layerwise_normal_uses_fan_in(method, expected):
    conv = nn.Conv2d(3, 5, kernel_size=2)  # fan_in = 3*2*2 = 12, fan_out = 5*2*2 = 20
    prior = priors.LayerwiseNormal(method)
    for name in ("weight", "bias"):
        d = prior(conv, name, getattr(conv, name))
        assert_close(d.base_dist.scale.unique(), [expected])
    # The fan is read from the layer's attributes, so it agrees with torch's own computation.
    fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(conv.weight)
    assert priors.fan_in_out(conv, conv.weight) == (fan_in, fan_out)


def test_laplace_and_scale_mixture_log_prob():
    lin = nn.Linear(2, 2)
    w = torch.randn(2, 2, dtype=torch.float64)
    lap = priors.Laplace(0.3)(lin, "weight", w)
    zero = torch.zeros((), dtype=torch.float64)  # a float64 reference: 0.3 as float32 errs 4e-8
    assert_close(lap.log_prob(w), torch.distributions.Laplace(zero, 0.3).log_prob(w).sum())
    mix = priors.ScaleMixtureNormal(0.25, 1.0, 0.1)(lin, "weight", w)
    one = torch.ones((), dtype=torch.float64)
    n1 = torch.distributions.Normal(0 * one, one).log_prob(w).exp()
    n2 = torch.distributions.Normal(0 * one, 0.1 * one).log_prob(w).exp()
    assert_close(mix.log_prob(w), (0.25 * n1 + 0.75 * n2).log().sum(), rtol=1e-12)


def test_scale_mixture_distribution_moments():
    d = ScaleMixtureNormal(torch.tensor(0.3), torch.tensor(2.0), torch.tensor(0.5))
    x = d.sample((200_000,))
    # 4 standard errors of the sample variance: sd(x²)/√n with E[x⁴] = 3Σπₖsₖ⁴.
    fourth = 3 * (0.3 * 2.0**4 + 0.7 * 0.5**4)
    se = math.sqrt((fourth - float(d.variance) ** 2) / 200_000)
    assert abs(float((x**2).mean()) - float(d.variance)) < 4 * se
    assert d.expand((3,)).log_prob(torch.zeros(3)).shape == (3,)


def test_init_options():
    lin = nn.Linear(3, 2)
    assert torch.equal(priors.Normal().init_loc(lin, "weight", lin.weight), lin.weight.detach())
    mean = priors.Normal(0.7, 1.0, init="prior_mean").init_loc(lin, "weight", lin.weight)
    assert torch.equal(mean, torch.full((2, 3), 0.7))
    drawn = priors.Laplace(1.0, init="sample").init_loc(lin, "weight", lin.weight)
    assert drawn.shape == (2, 3) and not torch.equal(drawn, lin.weight.detach())


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scales_raise(scale):
    for build in (
        lambda: priors.Normal(scale=scale),
        lambda: priors.Laplace(scale),
        lambda: priors.ScaleMixtureNormal(0.5, scale, 1.0),
        lambda: priors.ScaleMixtureNormal(0.5, 1.0, scale),
        lambda: priors.LayerwiseNormal(gain=scale),
    ):
        with pytest.raises(ValueError, match=r"scale|gain"):
            build()


@pytest.mark.parametrize("pi", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_bad_mixture_probability_raises(pi):
    with pytest.raises(ValueError, match="pi"):
        priors.ScaleMixtureNormal(pi, 1.0, 0.1)


def test_unknown_options_list_the_choices():
    with pytest.raises(ValueError, match="'kaiming', 'xavier', 'radford'"):
        priors.LayerwiseNormal("he")
    with pytest.raises(ValueError, match="init"):
        priors.Normal(init="zeros")
    with pytest.raises(ValueError, match="loc"):
        priors.Normal(loc=float("nan"))


def test_gaussian_prior_reads_any_prior_that_builds_a_normal():
    from pyro_bdl.nn import SiteSpec

    lin = nn.Linear(3, 2)

    def custom(module, name, param):  # a user callable, not a priors.Prior
        return torch.distributions.Independent(
            torch.distributions.Normal(torch.full_like(param, 0.25), torch.full_like(param, 2.0)),
            param.dim(),
        )

    lin.register_buffer("_bdl_init_weight", lin.weight.detach().clone())
    mean, precision = priors.gaussian_prior(SiteSpec("weight", lin, "weight", custom))
    assert mean.shape == precision.shape == (2, 3)
    assert_close(mean, torch.full((2, 3), 0.25))
    assert_close(precision, torch.full((2, 3), 0.25))  # 1 / 2²


@pytest.mark.parametrize(
    "build",
    [
        lambda t: priors.Normal(scale=t),
        lambda t: priors.Normal(loc=t),
        lambda t: priors.Laplace(scale=t),
        lambda t: priors.LayerwiseNormal(gain=t),
        lambda t: priors.ScaleMixtureNormal(scale1=t),
    ],
)
def test_a_hyperparameter_that_requires_grad_is_refused_not_cut_from_the_graph(build):
    # float() would turn it into a constant: a prior scale meant to be learned would stay fixed.
    with pytest.raises(TypeError, match=r"fixed number.*callable prior"):
        build(torch.tensor(1.0, requires_grad=True))
    with pytest.raises(ValueError, match=r"one number; got a tensor of shape \(2,\)"):
        build(torch.ones(2))
    build(torch.tensor(0.5))  # a plain one-number tensor is a number


@pytest.mark.parametrize(
    "layer",
    [
        nn.Conv2d(4, 6, kernel_size=3, groups=2),  # each output channel sees 4/2 input channels
        nn.Linear(3, 5),  # fan_in 3, fan_out 5: not to be swapped
        nn.Embedding(10, 4),  # no fan attributes: read from the weight's shape, as torch does
        nn.Bilinear(2, 3, 4),  # in1_features, no in_features: the weight (4, 2, 3)
    ],
    ids=["grouped-conv", "linear", "embedding", "bilinear"],
)
def test_fan_in_and_out_agree_with_torch_for_every_layer_kind(layer):
    weight = layer.weight
    expected = torch.nn.init._calculate_fan_in_and_fan_out(weight)
    assert priors.fan_in_out(layer, weight) == expected
    # And the Kaiming scale follows the fan-in: s = sqrt(2 / fan_in).
    d = priors.LayerwiseNormal("kaiming")(layer, "weight", weight)
    assert_close(d.base_dist.scale.unique(), [math.sqrt(2 / expected[0])])
