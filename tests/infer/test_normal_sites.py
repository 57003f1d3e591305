"""``TraceSuffStat_ELBO``'s one-pass terms of the lifted weights (pyro_bdl.infer.normal_sites):
the same loss and gradients as the site-by-site evaluation, taken where the trace is what the lift
and the guides emit, and left to the general path under every handler or prior that changes a
site's term."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.infer.normal_sites import prior_numbers
from tests.common import assert_close

F64 = torch.float64
N = 100

GUIDES = {
    "swag": lambda model: AutoSWAG(model, rank=2),
    "laplace_map": lambda model: AutoSubnetLaplace(model, subnetwork="last_layer"),
    "meanfield": lambda model: AutoMeanField(model, init_scale=0.1),
}
PRIORS = [
    priors.Normal(scale=1.0),
    priors.Normal(loc=0.3, scale=0.5),
    priors.LayerwiseNormal(method="kaiming"),  # one group per layer fan
]


def _problem(prior, guide: str, *, dtype=F64):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)
    ).to(dtype)
    model = models.classifier(bayesianize(net, prior), N)
    x, y = torch.randn(5, 2, 6, 6, dtype=dtype), torch.randint(4, (5,))
    g = GUIDES[guide](model)
    g(x, y)  # create the parameters
    return model, g, x, y


@pytest.fixture
def evaluated_alone(monkeypatch):
    """The names of the latent sites the ELBO evaluates on their own (not in one pass)."""
    names: list[str] = []
    alone = TraceSuffStat_ELBO._site_elbo

    def spy(self, name, model_site, guide_site):
        names.append(name)
        return alone(self, name, model_site, guide_site)

    monkeypatch.setattr(TraceSuffStat_ELBO, "_site_elbo", spy)
    return names


def _loss_and_grads(model, guide, x, y, *, grouped: bool, seed: int = 3, **options):
    elbo = TraceSuffStat_ELBO(**options)
    elbo._group_normal_sites = grouped
    params = [p for p in pyro.get_param_store().values() if p.requires_grad]
    pyro.set_rng_seed(seed)
    loss = elbo.differentiable_loss(model, guide, x, y)
    return loss.detach(), torch.autograd.grad(loss, params), dict(elbo.kl_methods)


@pytest.mark.parametrize("prior", PRIORS, ids=lambda p: repr(p)[:24])
@pytest.mark.parametrize("guide", list(GUIDES))
def test_one_pass_equals_site_by_site(prior, guide, evaluated_alone):
    model, g, x, y = _problem(prior, guide)
    loss, grads, methods = _loss_and_grads(model, g, x, y, grouped=True)
    assert evaluated_alone == []  # every weight site took the one-pass path
    ref_loss, ref_grads, ref_methods = _loss_and_grads(model, g, x, y, grouped=False)
    assert evaluated_alone == ["0.weight", "0.bias", "4.weight", "4.bias"]
    # The same numbers summed in another order: float64 rounding, ~1e-16 per term.
    assert_close(loss, ref_loss, rtol=1e-12)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert methods == ref_methods
    assert set(methods.values()) <= {"delta", "exact"}


def test_one_pass_in_float32_matches_within_rounding():
    model, g, x, y = _problem(priors.Normal(scale=1.0), "meanfield", dtype=torch.float32)
    loss, grads, _ = _loss_and_grads(model, g, x, y, grouped=True)
    ref_loss, ref_grads, _ = _loss_and_grads(model, g, x, y, grouped=False)
    # float32 sums of a few hundred terms in another order: a few ulps of the total.
    assert_close(loss, ref_loss, rtol=1e-6)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_svi_step_takes_the_one_pass_path(evaluated_alone):
    model, g, x, y = _problem(priors.Normal(scale=1.0), "swag")
    elbo = TraceSuffStat_ELBO()
    pyro.infer.SVI(model, g, pyro.optim.SGD({"lr": 1e-4}), elbo).step(x, y)
    assert evaluated_alone == []
    assert elbo.kl_methods == {
        "_AutoSWAG_latent": "delta",
        **dict.fromkeys(["0.weight", "0.bias", "4.weight", "4.bias"], "delta"),
    }


def _scaled(model):
    return poutine.scale(model, scale=0.5)


def _masked(model):
    return poutine.mask(model, mask=torch.tensor(True))


@pytest.mark.parametrize("handler", [_scaled, _masked], ids=["scale", "mask"])
@pytest.mark.parametrize("guide", ["swag", "meanfield"])
def test_a_handler_on_the_model_takes_the_general_path(handler, guide, evaluated_alone):
    model, g, x, y = _problem(priors.Normal(scale=1.0), guide)
    loss, _, _ = _loss_and_grads(handler(model), g, x, y, grouped=True)
    assert evaluated_alone == ["0.weight", "0.bias", "4.weight", "4.bias"]
    ref_loss, _, _ = _loss_and_grads(handler(model), g, x, y, grouped=False)
    assert_close(loss, ref_loss, rtol=1e-14)


def test_a_scaled_guide_takes_the_general_path(evaluated_alone):
    model, g, x, y = _problem(priors.Normal(scale=1.0), "meanfield")
    _loss_and_grads(model, poutine.scale(g, scale=0.5), x, y, grouped=True)
    assert evaluated_alone == ["0.weight", "0.bias", "4.weight", "4.bias"]


def test_vectorized_particles_take_the_general_path(evaluated_alone):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    model = models.classifier(bayesianize(net, priors.Normal()), N)
    x, y = torch.randn(5, 3, dtype=F64), torch.randint(2, (5,))
    g = AutoMeanField(model)
    g(x, y)
    elbo = TraceSuffStat_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)
    assert torch.isfinite(elbo.differentiable_loss(model, g, x, y))
    assert sorted(evaluated_alone) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize(
    "prior",
    [
        priors.Laplace(scale=0.5),
        priors.ScaleMixtureNormal(),
        lambda module, name, p: dist.Normal(torch.zeros_like(p), 1.0).to_event(p.dim()),
    ],
    ids=["laplace", "scale_mixture", "user_callable"],
)
def test_other_priors_take_the_general_path(prior, evaluated_alone):
    model, g, x, y = _problem(prior, "swag")
    _loss_and_grads(model, g, x, y, grouped=True)
    assert evaluated_alone == ["0.weight", "0.bias", "4.weight", "4.bias"]


def test_monte_carlo_kl_and_radial_guides_take_the_general_path(evaluated_alone):
    model, g, x, y = _problem(priors.Normal(), "meanfield")
    _, _, methods = _loss_and_grads(model, g, x, y, grouped=True, kl="mc", num_kl_samples=5)
    assert len(evaluated_alone) == 4 and set(methods.values()) == {"suffstat_normal"}
    evaluated_alone.clear()
    pyro.clear_param_store()
    radial = AutoRadial(model)
    radial(x, y)
    _loss_and_grads(model, radial, x, y, grouped=True)
    assert len(evaluated_alone) == 4


def test_a_conditioned_weight_is_observed_and_the_rest_stay_in_one_pass(evaluated_alone):
    model, _, x, y = _problem(priors.Normal(), "meanfield")
    weight = torch.zeros(4, dtype=F64)
    conditioned = poutine.condition(model, data={"4.bias": weight})
    pyro.clear_param_store()
    guide = AutoMeanField(conditioned)
    guide(x, y)
    _, _, methods = _loss_and_grads(conditioned, guide, x, y, grouped=True)
    assert evaluated_alone == [] and "4.bias" not in methods
    assert sorted(methods) == ["0.bias", "0.weight", "4.weight"]


def test_the_lifted_priors_carry_their_numbers_and_others_none():
    like = torch.zeros(3, 2)
    assert prior_numbers(priors.Normal(loc=0.5, scale=2.0)(nn.Linear(2, 3), "weight", like)) == (
        0.5,
        2.0,
    )
    m, s = prior_numbers(priors.LayerwiseNormal(method="radford")(nn.Linear(2, 3), "weight", like))
    assert m == 0.0 and s == pytest.approx(2**-0.5)
    assert prior_numbers(priors.Laplace()(nn.Linear(2, 3), "weight", like)) is None
    # Reinterpreting fewer dims than the prior has (a plate's expansion) is not the lifted form.
    expanded = priors.Normal()(nn.Linear(2, 3), "weight", like).expand([4, 3, 2])
    assert prior_numbers(expanded) is None
    assert prior_numbers(dist.Normal(0.0, 1.0).expand([3, 2]).to_event(2)) is None


def test_a_non_finite_weight_is_refused_by_name():
    model, g, x, y = _problem(priors.Normal(), "swag")
    with torch.no_grad():
        g.loc[3] = float("nan")  # a weight of the first site, 0.weight
    # Pyro's validation off (the likelihood's check of the logits would refuse first). Site by
    # site, the prior's own support check (its validation was fixed when the lift built it)
    # refuses the NaN; in one pass, the ELBO's check of the loss names the site.
    with pyro.validation_enabled(False):
        for grouped, match in ((False, "within the support"), (True, "KL term of site '0.weight'")):
            elbo = TraceSuffStat_ELBO()
            elbo._group_normal_sites = grouped
            with pytest.raises(ValueError, match=match):
                elbo.loss(model, g, x, y)


def test_a_guide_site_of_another_shape_than_the_prior_takes_the_general_path(evaluated_alone):
    # A user's guide whose bias is one number broadcast over the layer (Pyro's validation would
    # refuse the shapes; with it off the network runs): the prior's term counts every weight the
    # value stands for, so the site is evaluated on its own, not as a site of one number.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    model = models.classifier(bayesianize(net, priors.Normal()), N)
    x, y = torch.randn(5, 3, dtype=F64), torch.randint(2, (5,))
    shapes = {"0.weight": (4, 3), "0.bias": (1,), "2.weight": (2, 4), "2.bias": (2,)}

    def guide(x, y=None):
        for name, shape in shapes.items():
            loc = pyro.param(f"{name}_loc", torch.full(shape, 0.1, dtype=F64))
            scale = pyro.param(f"{name}_scale", torch.full(shape, 0.5, dtype=F64))
            pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape)))

    guide(x)
    with pyro.validation_enabled(False):
        loss, grads, _ = _loss_and_grads(model, guide, x, y, grouped=True)
        assert evaluated_alone == ["0.bias"]
        ref_loss, ref_grads, _ = _loss_and_grads(model, guide, x, y, grouped=False)
    assert_close(loss, ref_loss, rtol=1e-12)  # float64 sums in another order
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("guide", ["swag", "meanfield"])
def test_second_derivatives_at_the_prior_mean_equal_site_by_site(guide):
    # init="prior_mean" starts every weight (a point mass) or every mean (a Normal) at m, where
    # ‖w − m‖ = 0: a Hessian-vector product of the loss must be as finite there as site by site.
    model, g, x, y = _problem(priors.Normal(loc=0.3, scale=0.5, init="prior_mean"), guide)
    params = [p for p in pyro.get_param_store().values() if p.requires_grad]
    hvps = []
    for grouped in (True, False):
        elbo = TraceSuffStat_ELBO()
        elbo._group_normal_sites = grouped
        pyro.set_rng_seed(3)
        loss = elbo.differentiable_loss(model, g, x, y)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hvps.append(torch.autograd.grad(sum(d.square().sum() for d in grads), params))
    for a, b in zip(*hvps):
        assert_close(a, b, rtol=1e-10, atol=1e-12)  # float64 sums in another order
