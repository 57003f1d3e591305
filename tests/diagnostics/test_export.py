import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.diagnostics import arviz_compat, export, loo
from pyro_bdl.diagnostics.arviz_compat import group, group_names
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.infer.natural_gradient import VOGN
from tests.scenarios import BayesianLinearRegression

N, D_IN, HIDDEN, C = 20, 4, 5, 3
SITES = {"0.weight": (HIDDEN, D_IN), "0.bias": (HIDDEN,), "2.weight": (C, HIDDEN), "2.bias": (C,)}


def tiny_classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, C)).double()
    bnn = bayesianize(net, priors.Normal(scale=1.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (N,), generator=g)
    return models.classifier(bnn, N), x, y


def _swag(model, x, y):
    guide = AutoSWAG(model, rank=2)
    svi = SVI(model, guide, pyro.optim.SGD({"lr": 1e-3}), Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
        guide.collect()
    return guide


def _vogn(model, x, y):
    vogn = VOGN(model, dataset_size=N, lr=1e-2, prior_precision=1.0)
    vogn.step(x, y)
    return vogn.guide


GUIDES = {
    "AutoNormal": lambda m, x, y: AutoNormal(m),
    "AutoDelta": lambda m, x, y: AutoDelta(m),
    "AutoDiagonalNormal": lambda m, x, y: AutoDiagonalNormal(m),  # packed auxiliary latent
    "AutoMeanField": lambda m, x, y: AutoMeanField(m),
    "AutoRadial": lambda m, x, y: AutoRadial(m),
    "AutoSWAG": _swag,
    "AutoSubnetLaplace": lambda m, x, y: AutoSubnetLaplace(m, subnetwork="last_layer").fit((x, y)),
    "VOGNGuide": _vogn,
}


def _hand_log_likelihood(post, x, y):
    """log softmax(net(x; θ_s))[y] from the exported weights, one draw at a time."""
    flat = {k: torch.as_tensor(post[k].values).reshape(-1, *SITES[k]) for k in SITES}
    out = []
    for s in range(flat["0.weight"].shape[0]):
        h = torch.tanh(x @ flat["0.weight"][s].T + flat["0.bias"][s])
        logits = h @ flat["2.weight"][s].T + flat["2.bias"][s]
        out.append(logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


@pytest.mark.parametrize("name", list(GUIDES))
def test_schema_and_pointwise_log_likelihood(name):
    model, x, y = tiny_classifier()
    guide = GUIDES[name](model, x, y)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=6, num_chains=2)
    # On ArviZ ≥ 1 az.InferenceData is a deprecated alias of DataTree: only name it on 0.x.
    assert isinstance(data, xr.DataTree if arviz_compat.arviz_major() >= 1 else az.InferenceData)
    assert set(group_names(data)) == set(export.GROUPS)
    post = data.posterior
    assert set(post.data_vars) == set(SITES)
    assert dict(post.sizes)["chain"] == 2 and dict(post.sizes)["draw"] == 6
    assert post["0.weight"].dims == ("chain", "draw", "0.weight_out", "0.weight_in")
    assert post["0.bias"].dims == ("chain", "draw", "0.bias_out")
    for site, shape in SITES.items():
        assert post[site].shape == (2, 6, *shape)
    # Log-likelihood draws match the posterior draws; predictive matches the observed data.
    ll, pp, obs = data.log_likelihood["y"], data.posterior_predictive["y"], data.observed_data["y"]
    assert ll.dims == ("chain", "draw", "data") and ll.shape == (2, 6, N)
    np.testing.assert_array_equal(ll["draw"], post["draw"])
    np.testing.assert_array_equal(ll["chain"], post["chain"])
    assert obs.dims == ("data",) and pp.dims == ("chain", "draw", *obs.dims)
    np.testing.assert_array_equal(obs.values, y.numpy())
    assert pp.values.min() >= 0 and pp.values.max() < C and pp.dtype == obs.dtype
    for g in export.GROUPS:
        assert group(data, g).attrs["inference_library"] == "pyro"
    # The pointwise log-likelihood is the categorical log density at each exported draw.
    hand = _hand_log_likelihood(post, x, y)
    np.testing.assert_allclose(ll.values.reshape(-1, N), hand.numpy(), rtol=0, atol=1e-12)
    if name != "AutoDelta":  # a point estimate repeats one draw; every posterior draws anew
        assert post["2.bias"].values.reshape(12, C).std(0).min() > 0


def test_gaussian_pointwise_log_likelihood_by_hand():
    blr = BayesianLinearRegression(n=15, d=3)
    model = blr.model()
    guide = AutoNormal(model)
    guide(blr.x, blr.y)
    data = export.to_inference_data(model, guide, blr.x, blr.y, num_samples=5)
    w = torch.as_tensor(data.posterior["weight"].values).reshape(5, 1, 3)
    mean = (blr.x @ w.transpose(-1, -2)).squeeze(-1)  # (5, n)
    hand = -0.5 * np.log(2 * np.pi * blr.noise**2) - (blr.y - mean) ** 2 / (2 * blr.noise**2)
    ll = data.log_likelihood["y"].values.reshape(5, -1)
    np.testing.assert_allclose(ll, hand.numpy(), rtol=0, atol=1e-12)
    assert data.posterior["weight"].dims == ("chain", "draw", "weight_out", "weight_in")


def _groups_equal(a, b):
    assert set(group_names(a)) == set(group_names(b))
    for g in group_names(a):
        xr.testing.assert_equal(group(a, g), group(b, g))


def test_netcdf_round_trip(tmp_path):
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=4)
    path = export.save_inference_data(data, tmp_path / "run.nc")
    _groups_equal(data, export.load_inference_data(path))


def test_datatree_path_for_arviz_1(tmp_path):
    """ArviZ ≥ 1 works on ``xarray.DataTree``: the same groups, and its own netCDF round trip."""
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=4)
    tree = arviz_compat.package({g: group(data, g) for g in group_names(data)}, major=1)
    assert isinstance(tree, xr.DataTree)
    assert {c for c in tree.children} == set(export.GROUPS)
    path = export.save_inference_data(tree, tmp_path / "tree.nc")
    back = export.load_inference_data(path, major=1)
    for g in export.GROUPS:
        xr.testing.assert_equal(group(back, g), group(data, g))


def test_batches_and_summaries_do_not_change_draws():
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    pyro.set_rng_seed(5)
    whole = export.to_inference_data(model, guide, x, y, num_samples=7, batch_size=32)
    pyro.set_rng_seed(5)
    one = export.to_inference_data(model, guide, x, y, num_samples=7, batch_size=1)
    _groups_equal(whole, one)
    # Sites larger than max_site_size keep per-draw summaries of the same draws.
    pyro.set_rng_seed(5)
    small = export.to_inference_data(model, guide, x, y, num_samples=7, max_site_size=10)
    assert set(small.posterior.data_vars) == {
        "0.weight_mean",
        "0.weight_std",
        "0.weight_norm",
        "0.bias",
        "2.weight_mean",
        "2.weight_std",
        "2.weight_norm",
        "2.bias",
    }
    w = torch.as_tensor(whole.posterior["0.weight"].values).reshape(7, -1)
    np.testing.assert_allclose(
        small.posterior["0.weight_norm"].values[0], w.norm(dim=-1), rtol=1e-12
    )
    np.testing.assert_allclose(small.posterior["0.weight_std"].values[0], w.std(dim=-1), rtol=1e-12)
    assert small.posterior["0.weight_mean"].dims == ("chain", "draw")
    # Only sites with more elements are summarised: 2.weight, of exactly 3 · 5 = 15, stays whole.
    edge = export.to_inference_data(model, guide, x, y, num_samples=2, max_site_size=15)
    assert {"2.weight", "0.weight_mean"} <= set(edge.posterior.data_vars)
    assert "2.weight_mean" not in edge.posterior.data_vars


def test_var_names_and_no_observations():
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=3, var_names=["2.bias"])
    assert list(data.posterior.data_vars) == ["2.bias"]
    # Without y the model samples y itself: a posterior predictive, no likelihood.
    free = export.to_inference_data(model, guide, x, num_samples=3)
    assert set(group_names(free)) == {"posterior", "posterior_predictive"}
    assert free.posterior_predictive["y"].dims == ("chain", "draw", "data")
    with pytest.raises(ValueError, match="no log_likelihood group"):
        loo(free)


def test_bad_arguments_raise():
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        export.to_inference_data(model, guide, x, y, num_samples=0)
    with pytest.raises(ValueError, match="num_chains must be >= 1"):
        export.to_inference_data(model, guide, x, y, num_chains=0)
    with pytest.raises(ValueError, match="batch_size"):
        export.to_inference_data(model, guide, x, y, batch_size=0)
    with pytest.raises(TypeError, match="list of site names"):
        export.to_inference_data(model, guide, x, y, var_names="0.weight")
    with pytest.raises(ValueError, match="expected some of"):
        export.to_inference_data(model, guide, x, y, num_samples=1, var_names=["weight"])
    with pytest.raises(TypeError, match=r"InferenceData or xarray\.DataTree"):
        export.save_inference_data({"posterior": 1}, "x.nc")
    with pytest.raises(FileNotFoundError, match="no netCDF file"):
        export.load_inference_data("/nonexistent/run.nc")


def test_psis_loo_matches_exact_leave_one_out():
    """PSIS-LOO through ArviZ on draws from the exact posterior of Bayesian linear regression
    against the closed-form leave-one-out predictive densities."""
    blr = BayesianLinearRegression(n=30, d=2)
    model = blr.model()
    mean, cov = blr.mean, blr.covariance

    def guide(x, y):
        pyro.sample("weight", dist.MultivariateNormal(mean, cov).expand([1]).to_event(1))

    draws = 500
    data = export.to_inference_data(model, guide, blr.x, blr.y, num_samples=draws)
    result = arviz_compat.loo_summary(loo(data))
    exact = []
    for i in range(blr.n):
        xi, yi = blr.x[i], blr.y[i]
        prec = blr.precision - torch.outer(xi, xi) / blr.noise**2
        m = torch.linalg.solve(prec, blr.x.T @ blr.y / blr.noise**2 - xi * yi / blr.noise**2)
        var = blr.noise**2 + xi @ torch.linalg.solve(prec, xi)
        exact.append(float(dist.Normal(xi @ m, var.sqrt()).log_prob(yi)))
    # Each point's estimate is the log of an importance-sampling mean of w = 1/p(y_i|θ) over S
    # draws; its MC standard error is about CV(w)/√S. Measured with 10⁵ exact draws, CV(w) is
    # at most 0.53 (median 0.11) here, so SE ≤ 0.53/√500 = 0.024 and 0.12 is 5 SE. The total
    # sums 30 such errors: 5·√(Σ SE²) ≈ 0.2 if independent, Σ SE ≈ 0.2 even if fully
    # correlated; 0.3 covers both. k̂ stays below 0.7 (the draws are exact).
    assert (result.pareto_k.values < 0.7).all()
    np.testing.assert_allclose(result.elpd_i.values, exact, atol=0.12)
    assert result.elpd == pytest.approx(sum(exact), abs=0.3)


def test_scalar_latent_deterministic_and_multivariate_observation():
    """A scalar latent, a deterministic site and a vector observation per data point."""

    def model(x, y=None):
        noise = pyro.sample("noise", dist.LogNormal(torch.tensor(0.0, dtype=x.dtype), 1.0))
        w = pyro.sample("w", dist.Normal(torch.zeros(2, 3, dtype=x.dtype), 1.0).to_event(2))
        pyro.deterministic("w_norm", w.norm())
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal(x @ w, noise).to_event(1), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, generator=g, dtype=torch.float64)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64)
    guide = AutoNormal(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=4)
    post = data.posterior
    assert post["noise"].dims == ("chain", "draw")
    assert post["w"].dims == ("chain", "draw", "w_dim_0", "w_dim_1")
    w = torch.as_tensor(post["w"].values[0])
    np.testing.assert_allclose(post["w_norm"].values[0], w.flatten(1).norm(dim=-1), rtol=1e-12)
    assert data.posterior_predictive["y"].dims == ("chain", "draw", "data", "y_dim_1")
    assert data.log_likelihood["y"].dims == ("chain", "draw", "data")
    noise = torch.as_tensor(post["noise"].values[0]).reshape(4, 1, 1)
    hand = dist.Normal(x @ w, noise).log_prob(y).sum(-1)  # (draws, n): Σ over the 3 outputs
    np.testing.assert_allclose(data.log_likelihood["y"].values[0], hand.numpy(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sites_export_and_round_trip(tmp_path, dtype):
    """NumPy has no bfloat16 (torch's .numpy() raised TypeError): such sites are stored as
    float32, which holds every bfloat16 exactly; float16 stays float16."""

    def model(y=None):
        loc = pyro.sample("loc", dist.Normal(torch.zeros(2, dtype=dtype), 1.0).to_event(1))
        with pyro.plate("data", 5):
            pyro.sample("y", dist.Normal(loc, torch.tensor(1.0, dtype=dtype)).to_event(1), obs=y)

    def guide(y=None):
        pyro.sample("loc", dist.Normal(torch.full((2,), 0.5, dtype=dtype), 0.25).to_event(1))

    y = torch.randn(5, 2, generator=torch.Generator().manual_seed(0)).to(dtype)
    pyro.set_rng_seed(0)
    data = export.to_inference_data(model, guide, y, num_samples=3)
    stored = np.float32 if dtype == torch.bfloat16 else np.float16
    assert data.posterior["loc"].dtype == stored and data.observed_data["y"].dtype == stored
    np.testing.assert_array_equal(data.observed_data["y"].values, y.float().numpy())
    path = export.save_inference_data(data, tmp_path / "half.nc")
    loaded = export.load_inference_data(path)
    for name in export.GROUPS:
        xr.testing.assert_identical(group(loaded, name), group(data, name))


@pytest.mark.parametrize("mask", ["tensor", "false"])
def test_masked_observations_add_nothing_to_the_pointwise_log_likelihood(mask):
    """A masked-out observation has log-likelihood 0 (the site's mask applies); the others are
    log N(y_i | loc, 1) at the exported draw of loc."""
    keep = torch.tensor([True, False, True, True, False]) if mask == "tensor" else False

    def model(y):
        loc = pyro.sample("loc", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
        with pyro.plate("data", len(y)), poutine.mask(mask=keep):
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    y = torch.randn(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    guide = AutoNormal(model)
    guide(y)
    data = export.to_inference_data(model, guide, y, num_samples=3)
    loc = torch.as_tensor(data.posterior["loc"].values[0]).unsqueeze(-1)  # (draws, 1)
    hand = dist.Normal(loc, 1.0).log_prob(y) * torch.as_tensor(keep, dtype=torch.float64)
    ll = data.log_likelihood["y"].values[0]
    np.testing.assert_allclose(ll, hand.numpy(), rtol=0, atol=1e-12)
    assert (ll != 0).sum() == (3 * 3 if mask == "tensor" else 0)
