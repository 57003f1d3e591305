"""The Laplace guide family's Hessian structures (full, kron, diag) and subnetworks: exact limits
in float64, agreement with laplace-torch, and bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoLaplace, AutoSubnetLaplace, NotFittedError
from pyro_bdl.guides.laplace.posterior import StructuredNormal, check_blockwise
from tests.common import assert_close

F64 = torch.float64

#: These tests check the curvature and posterior algebra at fixed weights that are not trained to a
#: MAP estimate, where fit rightly warns (NotAtModeWarning); that warning has its own test.
pytestmark = pytest.mark.filterwarnings("ignore::pyro_bdl.guides.laplace.model.NotAtModeWarning")


def _classification(n=40, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()).clamp(max=2)
    return x, y


def _regression(n=30, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    return x, y


def _mlp(d=3, out=3, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d, 5, bias=bias), nn.Tanh(), nn.Linear(5, out, bias=bias)
    ).double()


def _guide(model, data, **kwargs):
    guide = AutoSubnetLaplace(model, **kwargs)
    guide(*data)
    return guide.fit(data)


def _classifier(net=None, prior_scale=1.0):
    x, y = _classification()
    net = net if net is not None else _mlp()
    return bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(prior_scale)), 40), (x, y)


def _single_linear_regressor(conv=False, noise=0.3):
    """One layer with one output under a Gaussian likelihood: every example has the same output
    gradient g = 1/σ, so KFAC is exact."""
    x, y = _regression()
    if conv:  # a 1×1 convolution on 1×1 images is the same map as a Linear layer
        x = x.reshape(len(x), 4, 1, 1)
        net = nn.Sequential(nn.Conv2d(4, 1, 1), nn.Flatten(0)).double()
    else:
        net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)).double()
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(1.0)), len(y), noise)
    return model, (x, y)


@pytest.mark.parametrize("conv", [False, True])
def test_kron_equals_full_on_one_linear_layer_with_one_output(conv):
    model, data = _single_linear_regressor(conv)
    full = _guide(model, data, subnetwork="all", prior_precision=0.7)
    kron = _guide(model, data, subnetwork="all", prior_precision=0.7, hessian_structure="kron")
    ((a, g),) = kron.posterior.factors()
    pos = kron.posterior.blocks[0].positions.reshape(-1)
    assert_close(torch.kron(g, a), full.ggn[pos][:, pos], rtol=1e-10, atol=1e-10)
    assert_close(kron.posterior.variances(), full.covariance.diagonal(), rtol=1e-10)
    assert_close(kron.marginal_likelihood(), full.marginal_likelihood(), rtol=1e-10)
    for a_out, b_out in zip(kron.predict(data[0][:7]), full.predict(data[0][:7])):
        assert_close(a_out, b_out, rtol=1e-10)


def test_diag_equals_the_diagonal_of_the_full_ggn():
    model, data = _classifier()
    full = _guide(model, data, subnetwork="all")
    diag = _guide(model, data, subnetwork="all", hessian_structure="diag")
    assert_close(diag.posterior.diag, full.ggn.diagonal(), rtol=1e-10, atol=1e-12)
    assert_close(diag.posterior.variances(), 1 / (full.ggn.diagonal() + 1.0), rtol=1e-10)
    # The diagonal of a last-layer fit is the full network's diagonal restricted to it.
    last = _guide(model, data, subnetwork="last_layer", hessian_structure="diag")
    assert_close(last.posterior.diag, full.ggn.diagonal()[last.subnet_index], rtol=1e-10)


def test_last_layer_structures_restrict_the_full_ggn():
    model, data = _classifier()
    full = _guide(model, data, subnetwork="all")
    last = _guide(model, data, subnetwork="last_layer")
    index = last.subnet_index
    assert_close(last.ggn, full.ggn[index][:, index], rtol=1e-10, atol=1e-12)
    # The head's GGN block is Σ_n Λ_n ⊗ a_n a_nᵀ (a = [features, 1]); KFAC's factorisation
    # (Σ Λ_n / N) ⊗ Σ a aᵀ is exact for one example.
    one = tuple(t[:1] for t in data)
    kron = _guide(model, one, subnetwork="last_layer", hessian_structure="kron")
    assert torch.equal(kron.subnet_index, index)
    ((a, g),) = kron.posterior.factors()
    exact = _guide(model, one, subnetwork="last_layer").ggn
    pos = kron.posterior.blocks[0].positions.reshape(-1)  # row-major [W, b] in packed order
    assert_close(torch.kron(g, a), exact[pos][:, pos], rtol=1e-10, atol=1e-12)


def test_structures_predict_sample_and_tune():
    model, data = _classifier()
    x, _ = data
    for structure in ("full", "kron", "diag"):
        guide = _guide(model, data, subnetwork="all", hessian_structure=structure)
        probs = guide.predict(x[:5])
        assert probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5, dtype=F64))
        draws = guide.get_posterior().rsample((4000,))
        # 4000 draws: the sample variance has relative s.e. √(2/4000) ≈ 0.022; 0.15 is > 6 s.e.
        assert_close(draws.var(0)[guide.subnet_index], guide.posterior.variances(), rtol=0.15)
        before = guide.marginal_likelihood()
        lam = guide.tune_prior_precision()
        assert isinstance(lam, float) and guide.marginal_likelihood() >= before - 1e-9
        layerwise = guide.tune_prior_precision(prior_structure="layerwise")
        assert layerwise.shape == guide.subnet_index.shape
        assert guide.marginal_likelihood() >= guide.marginal_likelihood() - 1e-9


def test_auto_laplace_defaults_are_laplace_torch_s():
    model, _ = _classifier()
    guide = AutoLaplace(model)
    assert guide.hessian_structure == "kron" and guide.rule.kind == "all"


def test_kron_refuses_unsupported_layers_and_partial_layers():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, 4), nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 1, 1), nn.Flatten(), nn.Linear(4, 3)
    ).double()
    model, data = _classifier(net)
    guide = AutoSubnetLaplace(model, subnetwork="all", hessian_structure="kron")
    guide(*data)
    with pytest.raises(ValueError, match=r"'2\.weight'.*Conv1d.*hessian_structure='diag'"):
        guide.fit(data)
    assert not guide.fitted
    # The same network under diag works, and a subnetwork of the Linear layers works with kron.
    _guide(model, data, subnetwork="all", hessian_structure="diag")
    _guide(model, data, subnetwork=["0.*", "4.*"], hessian_structure="kron")
    with pytest.raises(ValueError, match="needs whole layers"):
        AutoSubnetLaplace(model, subnetwork="random", size=5, hessian_structure="kron")
    with pytest.raises(ValueError, match="partly in the subnetwork"):
        _guide(model, data, subnetwork=[0, 1], hessian_structure="kron")


def test_bad_structure_arguments():
    model, data = _classifier()
    with pytest.raises(ValueError, match="hessian_structure"):
        AutoSubnetLaplace(model, subnetwork="all", hessian_structure="block")
    kron = _guide(model, data, subnetwork="all", hessian_structure="kron")
    with pytest.raises(ValueError, match="never forms"):
        kron.covariance  # noqa: B018
    with pytest.raises(ValueError, match="prior_structure='diagonal' cannot"):
        kron.tune_prior_precision(prior_structure="diagonal")
    with pytest.raises(ValueError, match="tune_noise=True needs a Gaussian"):
        kron.tune_prior_precision(tune_noise=True)
    with pytest.raises(ValueError, match="search='grid' tunes one"):
        kron.tune_prior_precision(search="grid", prior_structure="layerwise")
    with pytest.raises(ValueError, match="prior_structure"):
        kron.tune_prior_precision(prior_structure="blockwise")
    fresh = AutoSubnetLaplace(model, subnetwork="all", hessian_structure="diag")
    with pytest.raises(NotFittedError):
        fresh.predict(data[0])


def test_kron_refuses_a_prior_precision_that_varies_within_a_layer():
    model, data = _classifier()
    guide = _guide(model, data, subnetwork="all", hessian_structure="kron")
    blocks = guide.posterior.blocks
    prior = torch.ones(guide.subnet_index.numel(), dtype=F64)
    check_blockwise(prior, blocks)  # one value per layer passes
    prior[blocks[1].positions[0, 0]] = 2.0
    with pytest.raises(ValueError, match=r"varies within it.*prior_precision="):
        check_blockwise(prior, blocks)


def test_kron_refuses_a_non_gaussian_prior():
    torch.manual_seed(0)
    model = bdl.models.classifier(bdl.bayesianize(_mlp(), bdl.priors.Laplace(scale=1.0)), 40)
    data = _classification()
    guide = AutoSubnetLaplace(model, subnetwork="all", hessian_structure="kron")
    guide(*data)
    with pytest.raises(bdl.priors.NonGaussianPriorError):
        guide.fit(data)


def test_structured_log_prob_is_the_gaussian_density():
    model, data = _classifier()
    full = _guide(model, data, subnetwork="all")
    kron = _guide(model, data, subnetwork="all", hessian_structure="kron")
    value = full.get_posterior().sample((3,))
    # The full structure through the generic density equals the dense Gaussian's.
    generic = StructuredNormal(full.map_loc, full.subnet_index, full.posterior)
    assert_close(generic.log_prob(value), full.get_posterior().log_prob(value), rtol=1e-10)
    # Kron: the density of the dense block-diagonal precision G ⊗ A + λI of its layers.
    post = kron.posterior
    d = (value - kron.map_loc)[..., kron.subnet_index]
    dense = torch.zeros(d.shape[-1], d.shape[-1], dtype=F64)
    for block, (a, g) in zip(post.blocks, post.factors()):
        pos = block.positions.reshape(-1)
        dense[pos[:, None], pos] = torch.kron(g, a) + torch.eye(len(pos), dtype=F64)
    expected = torch.distributions.MultivariateNormal(
        torch.zeros(d.shape[-1], dtype=F64), precision_matrix=dense
    ).log_prob(d)
    assert_close(kron.get_posterior().log_prob(value), expected, rtol=1e-10)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_draws_and_densities_are_in_the_weights_dtype(structure):
    # The posterior is held in float64 (the accumulation dtype); a float32 network's guide gives
    # float32 draws and densities, so that an ELBO (TraceEnum_ELBO contracts all its terms in one
    # dtype) never mixes dtypes.
    net = _mlp().float()
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(1.0)), 40)
    x, y = _classification()
    guide = _guide(model, (x.float(), y), subnetwork="all", hessian_structure=structure)
    posterior = guide.get_posterior()
    value = posterior.sample((3,))
    log_prob = posterior.log_prob(value)
    assert value.dtype == log_prob.dtype == torch.float32
    # The same density in float64 throughout: the float32 result is that value rounded once,
    # after the float32 difference value − loc (about 1e-7 relative per coordinate, summed over
    # 38 coordinates in a quadratic form of a few tens): 1e-5 relative is ample.
    exact = type(posterior)(guide.map_loc.double(), guide.subnet_index, *_posterior_args(posterior))
    assert_close(log_prob.double(), exact.log_prob(value.double()), rtol=1e-5)


def _posterior_args(posterior):
    """The arguments after ``(loc, index)`` that rebuild ``posterior``."""
    if isinstance(posterior, StructuredNormal):
        return (posterior.structure,)
    return (posterior.scale_tril,)
