"""AutoSubnetLaplace: exact limits, the linearized predictive, selection, state and errors."""

from __future__ import annotations

import io
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn
from torch.func import functional_call, jacrev

import pyro_bdl as bdl
from pyro_bdl.app.compare.problem import cnn as compare_cnn
from pyro_bdl.curvature.memory import TensorMemoryTracker
from pyro_bdl.guides import AutoSubnetLaplace, NotFittedError
from pyro_bdl.guides.laplace.evidence import evidence
from pyro_bdl.guides.laplace.posterior import DiagPosterior
from tests.common import assert_close
from tests.scenarios import BayesianLinearRegression

F64 = torch.float64
#: The GGN and covariance of the float64 MLP (≤ 38 weights) against jacrev/inverse references: the
#: same sums of 40 rows' products (entries ≤ 10) in another order, then the inverse of GGN + λI
#: (λ ≥ 0.3, largest eigenvalue ≤ 38 · 10: condition number ≤ ~1e3), so round-off is ~ 40 · 1e3 ·
#: 1.1e-16 ≈ 5e-12 relative (≤ 6.2e-12 measured over every use). rtol 1e-9 leaves 150× that;
#: atol 1e-10 covers entries that cancel to ~0. A wrong curvature or λ is off by O(1).
ROUND_OFF = {"rtol": 1e-9, "atol": 1e-10}

#: These tests check the curvature and posterior algebra at fixed weights that are not trained to a
#: MAP estimate, where fit rightly warns (NotAtModeWarning); that warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore::pyro_bdl.guides.laplace.model.NotAtModeWarning")


def _data(n=40, d=3, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).clamp(max=classes - 1)
    return x, y


def _mlp(d=3, hidden=5, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, classes)).double()


def _trained(subnetwork="all", steps=150, net=None, **kwargs):
    """A MAP-trained guide (as a point estimate under SVI) on the small 3-class problem."""
    x, y = _data()
    net = net if net is not None else _mlp()
    plain = type(net)(*[m for m in net]) if isinstance(net, nn.Sequential) else None
    reference = _mlp() if plain is not None else None
    bnn = bdl.bayesianize(net, bdl.priors.Normal(scale=1.0))
    model = bdl.models.classifier(bnn, len(y))
    guide = AutoSubnetLaplace(model, subnetwork=subnetwork, **kwargs)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(steps):
        svi.step(x, y)
    return guide, model, reference, x, y


def _brute_ggn(guide, plain, x, likelihood="categorical", noise=None):
    """Full GGN over all weights with torch.func.jacrev on an equivalent plain network."""

    def f(theta):
        return functional_call(plain, guide.layout.unpack(theta), (x,))

    theta = guide.loc.detach()
    jac = jacrev(f)(theta)
    out = f(theta)
    if likelihood == "categorical":
        p = out.softmax(-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        return torch.einsum("bcd,bce,bef->df", jac, lam, jac)
    jac = jac.reshape(len(x), -1, theta.numel())
    return jac.transpose(1, 2) @ jac / noise**2


def test_all_weights_equals_full_network_ggn_laplace():
    guide, _, plain, x, y = _trained("all", prior_precision=2.0)
    assert not guide.fitted
    guide.fit((x, y))
    ggn = _brute_ggn(guide, plain, x)
    d = ggn.shape[0]
    assert_close(guide.ggn, ggn, **ROUND_OFF)
    expected = torch.linalg.inv(ggn + 2.0 * torch.eye(d, dtype=F64))  # λ_S = λ·D/D
    assert_close(guide.covariance, expected, **ROUND_OFF)
    assert_close(guide.map_loc, guide.loc.detach())


def test_float64_accumulation_of_a_float32_network():
    guide, _, plain, x, y = _trained("all", steps=30)
    exact = torch.linalg.inv(_brute_ggn(guide, plain, x) + torch.eye(38, dtype=F64))
    pyro.clear_param_store()
    net32 = _mlp().float()
    guide32, *_ = _trained("all", steps=0, net=net32, accumulate_dtype=F64)
    guide32(x.float(), y)
    guide32.loc.data = guide.loc.detach().float()
    guide32.fit((x.float(), y))
    assert guide32.ggn.dtype == F64 and guide32.scale_tril.dtype == F64
    # The float32 Jacobian carries relative errors of about 1e-7; H_S is well conditioned here.
    assert_close(guide32.covariance, exact, rtol=1e-4, atol=1e-6)
    assert guide32.predict(x.float()).dtype == F64


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_a_float32_network_accumulates_its_posterior_in_float64_by_default(structure):
    # Without accumulate_dtype the curvature and its factorisation are float64 (the robustness
    # that accumulation_dtype documents); a full posterior takes accumulate_dtype=torch.float32
    # (kron and diag keep their small factors in float64 always).
    x, y = _data()
    model = bdl.models.classifier(bdl.bayesianize(_mlp().float(), bdl.priors.Normal(1.0)), 40)
    requests = [(None, F64)] + ([(torch.float32, torch.float32)] if structure == "full" else [])
    for requested, expected in requests:
        guide = AutoSubnetLaplace(
            model, subnetwork="all", hessian_structure=structure, accumulate_dtype=requested
        )
        guide(x.float(), y)
        guide.fit((x.float(), y))
        assert guide.posterior.variances().dtype == expected
        if structure == "full":
            assert guide.ggn.dtype == guide.scale_tril.dtype == expected


@pytest.mark.parametrize("scaling", ["per_weight", "subnetwork_fraction", None])
def test_last_layer_equals_last_layer_laplace(scaling):
    kwargs = {} if scaling is None else {"prior_scaling": scaling}
    guide, _, plain, x, y = _trained("last_layer", **kwargs)
    guide.fit((x, y))
    d = guide.loc.numel()
    last = torch.arange(d - 18, d)  # Linear(5, 3): 15 weights then 3 biases, packed last
    assert torch.equal(guide.subnet_index, last)
    # Last-layer Laplace by brute force: the features are fixed, only the head's Jacobian counts.
    ggn = _brute_ggn(guide, plain, x)[last][:, last]
    # The default is laplace-torch's meaning: λ is each included weight's prior precision.
    lam = 18 / d if scaling == "subnetwork_fraction" else 1.0
    expected = torch.linalg.inv(ggn + lam * torch.eye(18, dtype=F64))
    assert_close(guide.covariance, expected, **ROUND_OFF)


def test_bayesian_linear_regression_is_exact():
    blr = BayesianLinearRegression()
    model = blr.model()
    lam = 1 / blr.prior_scale**2
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=lam)
    guide(blr.x, blr.y)
    # The MAP of a linear-Gaussian model is the exact posterior mean; put it there (training is
    # tested elsewhere) and check that fit keeps it and finds the exact covariance.
    guide.loc.data = blr.mean.clone()
    guide.fit((blr.x, blr.y))
    assert_close(guide.map_loc, blr.mean, rtol=1e-8, atol=1e-12)
    assert_close(guide.covariance, blr.covariance, rtol=1e-8, atol=1e-12)
    mean, var = guide.predict(blr.x[:7])
    assert_close(mean, blr.x[:7] @ blr.mean, rtol=1e-8)
    exact_var = (blr.x[:7] @ blr.covariance * blr.x[:7]).sum(-1) + blr.noise**2
    assert_close(var, exact_var, rtol=1e-8)


def test_map_training_phase_is_a_point_estimate():
    guide, model, _, x, y = _trained("all", steps=0)
    values = guide(x, y)
    assert_close(values["0.weight"], guide.loc[:15].reshape(5, 3).detach())
    loss0 = Trace_ELBO().loss(model, guide, x, y)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(50):
        svi.step(x, y)
    assert Trace_ELBO().loss(model, guide, x, y) < loss0 - 1.0  # a deterministic objective


def _logistic(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=F64)
    y = (x[:, 0] - x[:, 1] + 0.5 * torch.randn(n, generator=g, dtype=F64) > 0).to(F64)
    torch.manual_seed(seed)
    net = bdl.bayesianize(nn.Linear(2, 1).double(), bdl.priors.Normal(scale=1.0))

    def model(x, y=None):
        logits = net(x).squeeze(-1)
        with pyro.plate("data", n, subsample_size=x.shape[0]):
            pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)
        return logits

    return model, x, y


def test_binary_mc_converges_to_quadrature_and_probit_is_close():
    model, x, y = _logistic()
    guide = AutoSubnetLaplace(model, subnetwork="all")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())
    for _ in range(200):
        svi.step(x, y)
    guide.fit((x, y))
    x_test = torch.linspace(-3, 3, 13, dtype=F64).unsqueeze(-1) * torch.tensor([[1.0, -0.3]])
    obs = guide._observe((x_test,), without_targets=True)
    out, jac, _ = next(guide._jacobians((x_test,), obs))
    mu = out.squeeze(-1)
    var = torch.einsum("bcs,st,bct->b", jac, guide.covariance, jac)
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)  # ∫ σ(μ + √v t) φ(t) dt
    nodes_t = torch.as_tensor(nodes, dtype=F64)
    weights_t = torch.as_tensor(weights / weights.sum(), dtype=F64)
    exact = (mu[:, None] + var.sqrt()[:, None] * nodes_t).sigmoid() @ weights_t
    pyro.set_rng_seed(1)
    n = 40_000
    mc = guide.predict(x_test, link="mc", num_samples=n)
    # σ(f) ∈ [0, 1] has variance ≤ 1/4: 5 standard errors of the n-sample mean are 5·0.5/√n.
    assert (mc - exact).abs().max() < 5 * 0.5 / math.sqrt(n)
    probit = guide.predict(x_test, link="probit")
    assert (probit - exact).abs().max() < 0.02  # the probit approximation's known accuracy
    assert torch.equal(probit > 0.5, mu > 0)


def test_linearized_argmax_equals_map_argmax():
    guide, model, _, x, y = _trained("largest_variance", size=0.5, prior_precision=0.1)
    guide.fit((x, y))
    x_test = 3 * torch.randn(200, 3, dtype=F64)
    probs = guide.predict(x_test, link="probit")
    with torch.no_grad():
        map_logits = poutine_map_logits(model, guide, x_test)
    assert torch.equal(probs.argmax(-1), map_logits.argmax(-1))
    assert_close(probs.sum(-1), torch.ones(200, dtype=F64))


def poutine_map_logits(model, guide, x):
    values = guide.layout.unpack(guide.map_loc)
    return pyro.poutine.condition(model, data=values)(x)


def test_predictive_samples_the_subnetwork_only():
    guide, model, _, x, y = _trained("random", size=10, seed=3)
    guide.fit((x, y))
    samples = Predictive(model, guide=guide, num_samples=4, return_sites=["_RETURN"])(x)
    assert samples["_RETURN"].shape == (4, 40, 3)
    draws = guide.get_posterior().rsample((4000,))
    moved = (draws != guide.map_loc).any(0).nonzero().squeeze(-1)
    assert torch.equal(moved, guide.subnet_index)
    cov = torch.cov(draws[:, guide.subnet_index].T)
    # Sample covariance of n = 4000 draws: entry error sd ≈ sqrt((Σii Σjj + Σij²)/n) ≤ 0.023·max
    # Σii; 6 such errors bound every one of the 100 entries.
    tol = 6 * math.sqrt(2 / 4000) * float(guide.covariance.diagonal().max())
    assert (cov - guide.covariance).abs().max() < tol


def test_state_dict_round_trip_gives_identical_samples():
    guide, model, _, x, y = _trained("random", size=12, steps=20)
    guide.fit((x, y))
    buffer = io.BytesIO()
    torch.save(guide.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    pyro.clear_param_store()  # otherwise the fresh guide would pick up loc from the store
    fresh = AutoSubnetLaplace(model, subnetwork="random", size=12)
    fresh(x, y)  # Pyro guides create their parameters on the first call
    fresh.load_state_dict(state)
    assert fresh.fitted and torch.equal(fresh.subnet_index, guide.subnet_index)
    pyro.set_rng_seed(7)
    a = guide(x, y)
    pyro.set_rng_seed(7)
    b = fresh(x, y)
    for name in a:
        assert torch.equal(a[name], b[name])
    assert_close(fresh.predict(x), guide.predict(x))


def test_selection_rules():
    guide, model, _, x, y = _trained("all", steps=30)
    d = guide.loc.numel()  # 3·5 + 5 + 5·3 + 3 = 38
    names = AutoSubnetLaplace(model, subnetwork=["2.*"])
    names(x, y)
    names.loc.data = guide.loc.data
    assert torch.equal(names.fit((x, y)).subnet_index, torch.arange(20, 38))
    picked = AutoSubnetLaplace(model, subnetwork=[30, 2, 7])
    picked(x, y)
    assert torch.equal(picked.fit((x, y)).subnet_index, torch.tensor([2, 7, 30]))
    rand = [AutoSubnetLaplace(model, subnetwork="random", size=0.25, seed=s) for s in (1, 1, 2)]
    for g in rand:
        g(x, y)
        g.fit((x, y))
    assert rand[0].subnet_index.numel() == round(0.25 * d)
    assert torch.equal(rand[0].subnet_index, rand[1].subnet_index)
    assert not torch.equal(rand[0].subnet_index, rand[2].subnet_index)
    variances = {"0.weight": torch.zeros(5, 3), "0.bias": torch.arange(5.0) + 10}
    variances |= {"2.weight": torch.zeros(3, 5), "2.bias": torch.tensor([0.0, 20.0, 0.0])}
    top = AutoSubnetLaplace(model, subnetwork="largest_variance", size=3, variances=variances)
    top(x, y)
    assert torch.equal(top.fit((x, y)).subnet_index, torch.tensor([18, 19, 36]))


def test_diagonal_laplace_selection_matches_brute_force():
    guide, _, plain, x, y = _trained("largest_variance", size=6, prior_precision=0.5)
    guide.fit((x, y))
    variance = 1 / (_brute_ggn(guide, plain, x).diagonal() + 0.5)
    assert torch.equal(guide.subnet_index, variance.topk(6).indices.sort().values)


def test_swag_variances_select_the_subnetwork():
    x, y = _data()
    bnn = bdl.bayesianize(_mlp(), bdl.priors.Normal(scale=1.0))
    model = bdl.models.classifier(bnn, len(y))
    swag = bdl.guides.AutoSWAG(model, diag_only=True)
    svi = SVI(model, swag, pyro.optim.SGD({"lr": 0.01}), Trace_ELBO())
    for step in range(40):
        svi.step(x, y)
        if step >= 30:
            swag.collect()
    variances = swag.marginal_variances()
    guide = AutoSubnetLaplace(model, subnetwork="largest_variance", size=5, variances=swag)
    guide(x, y)
    guide.fit((x, y))
    flat = guide.layout.pack(variances)
    assert torch.equal(guide.subnet_index, flat.topk(5).indices.sort().values)


def _lifted(prior, **kwargs):
    """A guide at fixed (untrained) weights of the small MLP lifted with ``prior``."""
    x, y = _data()
    model = bdl.models.classifier(bdl.bayesianize(_mlp(), prior), len(y))
    guide = AutoSubnetLaplace(model, **kwargs)
    guide(x, y)
    return guide, x, y


def test_prior_precision_is_read_from_the_lifted_prior():
    guide, x, y = _lifted(bdl.priors.Normal(scale=0.5), subnetwork="all")
    assert guide.prior_precision.numel() == 0  # nothing read before fit
    guide.fit((x, y))
    assert_close(guide.prior_precision, torch.full((38,), 4.0, dtype=F64))  # 1 / 0.5²
    expected = torch.linalg.inv(guide.ggn + 4.0 * torch.eye(38, dtype=F64))
    assert_close(guide.covariance, expected, **ROUND_OFF)


def test_layerwise_prior_gives_one_precision_per_weight():
    prior = bdl.priors.LayerwiseNormal(method="radford")  # s² = 1 / fan-in: 3 then 5
    guide, x, y = _lifted(prior, subnetwork=[0, 19, 20, 37])
    guide.fit((x, y))
    lam = torch.tensor([3.0, 3.0, 5.0, 5.0], dtype=F64)
    assert_close(guide.prior_precision, lam)
    expected = torch.linalg.inv(guide.ggn + torch.diag(lam))  # each weight's own precision
    assert_close(guide.covariance, expected, **ROUND_OFF)


def test_explicit_prior_precision_overrides_the_lifted_prior():
    guide, x, y = _lifted(bdl.priors.Normal(scale=0.5), subnetwork="all", prior_precision=2.0)
    guide.fit((x, y))
    assert guide.prior_precision.dim() == 0 and float(guide.prior_precision) == 2.0
    expected = torch.linalg.inv(guide.ggn + 2.0 * torch.eye(38, dtype=F64))
    assert_close(guide.covariance, expected, **ROUND_OFF)
    # A tuned λ is one value too, and a later fit keeps it.
    guide.tune_prior_precision(method="marglik", grid=[0.3], refine=False)
    expected = torch.linalg.inv(guide.ggn + 0.3 * torch.eye(38, dtype=F64))
    assert_close(guide.fit((x, y)).covariance, expected, **ROUND_OFF)


def test_a_later_fit_keeps_a_tuned_per_layer_precision_and_never_loses_the_given_one():
    # A λ tuned per layer holds for the same subnetwork at a later fit, as one tuned value does.
    variances = {"0.weight": torch.ones(15), "0.bias": torch.ones(5), "2.weight": torch.ones(15)}
    variances["2.bias"] = torch.ones(3)
    variances["2.weight"][:5] = 2.0  # the subnetwork: these 5 weights and...
    variances["0.bias"][:2] = 2.0  # ...these 2, in two layers
    kwargs = dict(subnetwork="largest_variance", size=7, variances=variances, prior_precision=2.0)
    guide, x, y = _lifted(bdl.priors.Normal(scale=0.5), **kwargs)
    guide.fit((x, y))
    tuned = guide.tune_prior_precision(prior_structure="layerwise").clone()
    assert len(set(tuned.tolist())) == 2
    expected = torch.linalg.inv(guide.ggn + torch.diag(tuned))
    assert_close(guide.fit((x, y)).covariance, expected, **ROUND_OFF)
    # On another subnetwork the per-weight values mean nothing: the given λ, not the lifted prior.
    variances["2.weight"][:5] = 1.0
    variances["2.weight"][5:12] = 2.0
    guide.fit((x, y))
    assert guide.prior_precision.dim() == 0 and float(guide.prior_precision) == 2.0
    expected = torch.linalg.inv(guide.ggn + 2.0 * torch.eye(7, dtype=F64))
    assert_close(guide.covariance, expected, **ROUND_OFF)


def test_non_gaussian_lifted_prior_is_refused_before_fit_changes_anything():
    guide, x, y = _lifted(bdl.priors.Laplace(scale=1.0), subnetwork="all")
    loc = guide.loc.detach().clone()
    with pytest.raises(bdl.priors.NonGaussianPriorError, match=r"'0\.weight'.*prior_precision="):
        guide.fit((x, y))
    assert not guide.fitted and guide.prior_precision.numel() == 0
    assert torch.equal(guide.loc.detach(), loc)
    pyro.clear_param_store()
    guide, x, y = _lifted(bdl.priors.Laplace(scale=1.0), subnetwork="all", prior_precision=1.0)
    assert guide.fit((x, y)).fitted  # the way out the message names


def test_hand_written_weight_sites_need_an_explicit_precision():
    # Their prior is not one declared in bayesianize: no silent default λ.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -1.0], dtype=F64)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=F64), 1.0).to_event(1))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)
        return x @ w

    guide = AutoSubnetLaplace(model, subnetwork="all")
    guide(x, y)
    with pytest.raises(bdl.priors.NonGaussianPriorError, match="'w' is not a weight lifted"):
        guide.fit((x, y))
    assert not guide.fitted
    pyro.clear_param_store()
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(x, y)
    # Linear-Gaussian: the GGN is XᵀX/σ², whatever the weights.
    expected = torch.linalg.inv(x.T @ x / 0.25 + torch.eye(2, dtype=F64))
    assert_close(guide.fit((x, y)).covariance, expected, rtol=1e-8)


def test_network_model_is_evaluated_in_eval_mode_and_restored():
    guide, x, y = _lifted(bdl.priors.Normal(), subnetwork="last_layer")
    net = guide._raw_model.net
    modes = []
    net[0].register_forward_hook(lambda m, i, o: modes.append(m.training))
    net.train()
    modes.clear()
    guide.fit((x, y)).predict(x)
    assert modes and not any(modes)
    assert net.training


def test_tune_prior_precision():
    guide, _, _, x, y = _trained("all", steps=60)
    guide.fit((x, y))
    theta = guide.map_loc.double()
    evals = torch.linalg.eigvalsh(guide.ggn)
    best = guide.tune_prior_precision(method="marglik")
    grid = torch.logspace(-4, 4, 401, dtype=F64)
    scores = [evidence(DiagPosterior(evals, v), theta, v) for v in grid]
    dense = float(grid[int(torch.stack(scores).argmax())])
    assert abs(math.log(best) - math.log(dense)) < 0.12  # refinement spacing 0.115 in log λ
    assert float(guide.prior_precision) == best
    expected = torch.linalg.inv(guide.ggn + best * torch.eye(len(theta), dtype=F64))
    assert_close(guide.covariance, expected, **ROUND_OFF)
    x_val, y_val = _data(n=30, seed=5)
    lam = guide.tune_prior_precision((x_val, y_val), method="val_ll", grid=[0.01, 0.1, 1, 10, 100])
    assert 0.01 <= lam <= 100
    with pytest.warns(UserWarning, match="edge of the grid"):
        guide.tune_prior_precision(method="marglik", grid=[1e3, 1e4])
    # A one-value grid sets λ without an edge warning (warnings are errors in the suite).
    assert guide.tune_prior_precision(method="marglik", grid=[2.0], refine=False) == 2.0
    with pytest.raises(ValueError, match="unknown method 'bic'"):
        guide.tune_prior_precision(method="bic")
    with pytest.raises(ValueError, match="needs validation data"):
        guide.tune_prior_precision(method="val_ll")


@pytest.mark.parametrize("search", ["gradient", "grid"])
def test_a_tuned_prior_under_subnetwork_fraction_scaling_is_lambda_not_lambda_s(search):
    # prior_scaling="subnetwork_fraction" puts λ_S = λ·S/D on the S = 18 head weights of D = 38:
    # the tuned value returned and held is λ, the posterior uses λ·S/D, and a later fit keeps it.
    guide, x, y = _lifted(
        bdl.priors.Normal(scale=1.0), subnetwork="last_layer", prior_scaling="subnetwork_fraction"
    )
    guide.fit((x, y), check_mode=False)
    lam = guide.tune_prior_precision(search=search)
    assert float(guide.prior_precision) == pytest.approx(lam, rel=1e-12)
    expected = torch.linalg.inv(guide.ggn + lam * 18 / 38 * torch.eye(18, dtype=F64))
    assert_close(guide.covariance, expected, rtol=1e-8, atol=1e-12)
    assert_close(guide.fit((x, y), check_mode=False).covariance, expected, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    ("subnetwork", "kwargs", "error", "match"),
    [
        ([-1, 2], {}, ValueError, "must be >= 0"),
        ([1, 1, 2], {}, ValueError, "duplicates"),
        ([], {}, ValueError, "empty"),
        ([1.0, 2.0], {}, TypeError, "must be integers"),
        (torch.tensor([True, False]), {}, TypeError, "must be integers"),
        ([True, 3], {}, TypeError, "must be integers"),
        (torch.tensor(3), {}, ValueError, r"a 1-d list or tensor; got shape \(\)"),
        (torch.tensor([[0, 1], [2, 3]]), {}, ValueError, r"1-d .* got shape \(2, 2\)"),
        ("biggest", {}, ValueError, "unknown subnetwork rule 'biggest'"),
        ("random", {}, ValueError, "needs size="),
        ("random", {"size": 0}, ValueError, "size must be >= 1"),
        ("random", {"size": 1.5}, ValueError, r"lie in \(0, 1\]"),
        ("random", {"size": "10"}, TypeError, "size must be an int"),
        ("largest_variance", {"size": 3, "variances": "hessian"}, ValueError, "unknown variances"),
        ("all", {"size": 3}, ValueError, "size is only used"),
        ("all", {"prior_precision": 0.0}, ValueError, "prior_precision must be finite and > 0"),
        ("all", {"prior_precision": math.nan}, ValueError, "prior_precision"),
        ("all", {"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ("all", {"prior_scaling": "fraction"}, ValueError, "prior_scaling"),
        (3.5, {}, TypeError, "subnetwork must be one of"),
    ],
)
def test_bad_arguments_raise_at_construction(subnetwork, kwargs, error, match):
    _, y = _data()
    model = bdl.models.classifier(bdl.bayesianize(_mlp()), len(y))
    with pytest.raises(error, match=match):
        AutoSubnetLaplace(model, subnetwork=subnetwork, **kwargs)


@pytest.mark.parametrize(
    ("subnetwork", "kwargs", "match"),
    [
        ([3, 38], {}, r"must be < the number of weights \(38\); got max 38"),
        (["fc.weight"], {}, "matches no weight site; valid names: 0.weight, 0.bias, 2.weight"),
        ("random", {"size": 39}, r"at most the number of weights \(38\)"),
        ("largest_variance", {"size": 3, "variances": {"0.weight": torch.ones(15)}}, "lacks"),
        ("all", {"max_memory": 1000}, r"needs about [\d,]+ bytes"),
    ],
)
def test_bad_subnetworks_raise_before_fit_changes_anything(subnetwork, kwargs, match):
    guide, _, _, x, y = _trained(subnetwork, steps=1, **kwargs)
    loc = guide.loc.detach().clone()
    with pytest.raises(ValueError, match=match):
        guide.fit((x, y))
    assert not guide.fitted and torch.equal(guide.loc.detach(), loc)


def test_predict_before_fit_and_bad_data():
    guide, _, _, x, y = _trained("all", steps=1)
    with pytest.raises(NotFittedError, match=r"call guide.fit\(data\) first"):
        guide.predict(x)
    with pytest.raises(NotFittedError):
        guide.covariance  # noqa: B018
    with pytest.raises(TypeError, match="tuple of tensors"):
        guide.fit(x.numpy())
    with pytest.raises(ValueError, match="same, non-zero number of rows"):
        guide.fit((x, y[:-1]))
    with pytest.raises(ValueError, match="data is empty"):
        guide.fit([])
    bad = x.clone()
    bad[3, 1] = math.nan
    with pytest.raises(ValueError, match=r"data tensor 0 \(0: x, 1: y\) contains 1 non-finite"):
        guide.fit((bad, y))
    assert not guide.fitted
    guide.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16))
    with pytest.raises(ValueError, match="unknown link 'logit'"):
        guide.predict(x, link="logit")
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        guide.predict(x, link="mc", num_samples=0)


def test_predict_does_not_call_init_loc_fn_on_the_target_site():
    # A user's init_loc_fn need only know the weight sites; predicting leaves "y" unobserved.
    x, y = _data()
    bnn = bdl.bayesianize(_mlp(), bdl.priors.Normal(scale=1.0))
    model = bdl.models.classifier(bnn, len(y))
    start = {name: torch.zeros(spec.shape, dtype=F64) for name, spec in bdl.sites(bnn).items()}
    guide = AutoSubnetLaplace(model, subnetwork="all", init_loc_fn=lambda site: start[site["name"]])
    guide(x, y)
    probs = guide.fit((x, y)).predict(x)
    # All-zero weights give equal logits, so the probit predictive is uniform.
    assert_close(probs, torch.full_like(probs, 1 / 3), atol=1e-12)


def test_dataloader_and_tuple_give_the_same_posterior():
    guide, _, _, x, y = _trained("all", steps=20, batch_size=7)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    first = guide.fit(loader).covariance.clone()
    assert_close(guide.fit((x, y)).covariance, first, rtol=1e-10)


def test_row_chunks_sized_by_chunk_memory_give_the_same_posterior():
    """``chunk_memory=1`` forces one example per Jacobian chunk and the smallest temporaries."""
    guide, _, _, x, y = _trained("all", steps=20)
    first = guide.fit((x, y)).covariance.clone()
    guide.chunk_memory = 1
    assert_close(guide.fit((x, y)).covariance, first, rtol=1e-10)


def _peak_fit_bytes_of(net, x, y, size: int, **kwargs) -> tuple[int, int]:
    """(peak tensor bytes of ``fit`` with a random subnetwork of ``size`` weights, D): the
    parameters and the data are excluded, everything ``fit`` allocates is counted."""
    bnn = bdl.bayesianize(net, bdl.priors.Normal(scale=1.0))
    model = bdl.models.classifier(bnn, len(y))
    guide = AutoSubnetLaplace(model, subnetwork="random", size=size, batch_size=32, **kwargs)
    guide(x, y)
    exclude = [guide.loc, x, y, *[s.init_value for s in bdl.sites(bnn).values()]]
    with TensorMemoryTracker(exclude=exclude) as mem:
        guide.fit((x, y))
    return mem.peak, guide.loc.numel()


def _peak_fit_bytes(hidden: int, size: int) -> tuple[int, int]:
    pyro.clear_param_store()  # guides of different sizes share the name "AutoSubnetLaplace"
    x, y = _data(n=64, d=20)
    net = _mlp(d=20, hidden=hidden)
    return _peak_fit_bytes_of(net, x, y, size)


def test_fit_memory_does_not_grow_with_the_network():
    """At fixed S, a network with 10× more weights raises fit's peak tensor memory ≤ 1.2×.

    What is counted: every storage an operator allocates during ``fit`` (the forward graph, the
    per-layer output gradients, J_S chunks, the S × S matrices, copies of the packed weights),
    not the parameters or the data. The S × S matrices and the B × C × S Jacobian dominate; the
    part that grows with D is a few copies of the weights and of the activations. A B × C × D
    Jacobian alone would be 32·3·D·8 bytes, 10× more for the larger net.
    """
    small, d_small = _peak_fit_bytes(hidden=16, size=300)
    large, d_large = _peak_fit_bytes(hidden=162, size=300)
    assert d_large >= 10 * d_small
    assert large <= 1.2 * small, (small, large)


def _peak_cnn_fit_bytes(width: int, size: int, **kwargs) -> tuple[int, int]:
    """Peak tensor bytes of ``fit`` on the compare CNN (two 3×3 convolutions with BatchNorm) of
    ``width`` channels, float64, 32 random 12×12 images (one chunk of 32 rows when unbounded)."""
    pyro.clear_param_store()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 12, 12, generator=g, dtype=F64)
    y = torch.randint(0, 3, (32,), generator=g)
    torch.manual_seed(0)
    return _peak_fit_bytes_of(compare_cnn((1,), 3, width).double(), x, y, size, **kwargs)


def test_fit_memory_does_not_grow_with_the_cnn():
    """The same property on a CNN, whose activations (not only its weights) grow with width:
    ``fit`` sizes its row chunks so that the forward graph, the layer-output gradients and the
    unfolded inputs stay within two S × S matrices (S = 600 in float64: 5.8 MB, above the 4 MiB
    floor). With unbounded chunks (32 rows) the same pair grows 1.29×, so the assertion can
    fail."""
    small, d_small = _peak_cnn_fit_bytes(7, 600)
    large, d_large = _peak_cnn_fit_bytes(24, 600)
    assert d_large >= 10 * d_small
    assert large <= 1.2 * small, (small, large)
    small, _ = _peak_cnn_fit_bytes(7, 600, chunk_memory=1 << 40)
    large, _ = _peak_cnn_fit_bytes(24, 600, chunk_memory=1 << 40)
    assert large > 1.2 * small, (small, large)


@pytest.mark.gpu
def test_fit_on_cuda_matches_cpu():
    guide, model, _, x, y = _trained("random", size=20, steps=20)
    cpu = guide.fit((x, y)).covariance.clone()
    model.net.to("cuda")  # the lifted network's initial values and the priors follow it
    guide.to("cuda")
    guide.fit((x.cuda(), y.cuda()))
    assert_close(guide.covariance.cpu(), cpu, rtol=1e-8, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_val_ll_grid_on_cuda_matches_cpu(structure):
    """The validation grid search builds its trial priors on the posterior's device (a host
    prior beside device curvature would fail), and picks the same λ as on the CPU."""
    guide, model, _, x, y = _trained("all", steps=20, hessian_structure=structure)
    grid = torch.tensor([0.1, 1.0, 10.0])
    guide.fit((x, y))
    # Scored on the training rows, the MAP limit (the grid's top) wins on either device; the
    # edge warning says so and is not what this test checks.
    with pytest.warns(UserWarning, match="edge of the grid"):
        cpu = guide.tune_prior_precision((x, y), method="val_ll", grid=grid, refine=False)
    model.net.to("cuda")
    guide.to("cuda")
    guide.fit((x.cuda(), y.cuda()))
    with pytest.warns(UserWarning, match="edge of the grid"):
        lam = guide.tune_prior_precision(
            (x.cuda(), y.cuda()), method="val_ll", grid=grid, refine=False
        )
    assert lam == cpu
    assert guide.predict(x.cuda()).device.type == "cuda"


@pytest.mark.slow
def test_digits_under_rotation_subnetwork_beats_map_diagonal_and_random():
    """The issue's quality check under the protocol of ``benchmarks/laplace_quality.py`` (one λ
    for every method, by diagonal Laplace's validation log-likelihood; λ_S = λ·S/D): on digits
    rotated 0°–180°, subnetwork Laplace with the largest SWAG-diag variances has a lower mean NLL
    and ECE than MAP, than diagonal Laplace, and than random subnetworks of the same size."""
    from benchmarks.laplace_quality import run
    from pyro_bdl.app.data import load_digits

    # The benchmark's settings (the fixture restores both): one thread, as on the shared CI
    # cores, and no argument validation, which the tests above cover.
    torch.set_num_threads(1)
    pyro.enable_validation(False)
    r = run(load_digits(), settings=("shared_val_ll",))["shared_val_ll"]
    assert all(r["claims"].values()), r["claims"]
    # Random selection is a distribution over subnetworks: beyond the 2-SE claim, ask for a gap
    # of two standard deviations of a single random subnetwork (SD = SE·√seeds), about a 5%
    # one-sided chance for a selection no better than random. Measured (seed 0): NLL 5.15 vs
    # 5.79 ± 0.04 SD, ECE 0.514 vs 0.531 ± 0.0007 SD, gaps of 16 and 24 SD.
    for metric in ("mean_nll", "mean_ece"):
        sel = r["selection"][metric]
        sd = sel["random_se"] * sel["seeds"] ** 0.5
        assert sel["subnet_swag_sgd"] < sel["random_mean"] - 2 * sd, (metric, sel)
