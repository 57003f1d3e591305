"""The KL estimators of ``pyro_bdl.infer.kl``: exactness against the direct estimator, agreement
with closed forms, the memory property, the Gaussian statistics, the registry and the errors."""

from __future__ import annotations

import importlib
import math
import sys

import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_bdl.distributions import Radial, ScaleMixtureNormal
from pyro_bdl.distributions.radial import radial_noise
from pyro_bdl.infer import kl as K
from tests.common import assert_close

F64 = torch.float64


def _t(x):
    return torch.tensor(x, dtype=F64)


PRIORS = {
    "normal": lambda: dist.Normal(_t(0.3), _t(0.7)),
    "laplace": lambda: dist.Laplace(_t(-0.1), _t(0.5)),
    "scale_mixture": lambda: ScaleMixtureNormal(_t(0.3), _t(1.0), _t(0.05)),
}


def _noise(noise: str, m: int, shape, event_dim: int) -> torch.Tensor:
    if noise == "normal":
        return torch.randn(m, *shape, dtype=F64)
    split = len(shape) - event_dim
    return radial_noise(shape[split:], (m, *shape[:split]), dtype=F64)


def _site(shape):
    loc = torch.randn(shape, dtype=F64).requires_grad_()
    scale = (0.05 + torch.rand(shape, dtype=F64)).requires_grad_()
    return loc, scale


def _value_and_grads(terms, params):
    kl = terms.kl
    grads = torch.autograd.grad(kl.sum(), params)
    return kl.detach(), [g.detach() for g in grads]


# --- exactness: same noise, same values and gradients ------------------------------------------


@pytest.mark.parametrize("noise", ["normal", "radial"])
@pytest.mark.parametrize("prior_name", sorted(PRIORS))
@pytest.mark.parametrize("which", ["registered", "streaming"])
@pytest.mark.parametrize("shape,event_dim", [((6, 5), 2), ((3, 4, 2), 2)])
def test_equals_direct_given_the_same_noise(noise, prior_name, which, shape, event_dim):
    prior = PRIORS[prior_name]()
    loc, scale = _site(shape)
    xi = _noise(noise, 23, shape, event_dim)  # 23 with chunks of 5: a partial last chunk
    ref = K.kl_direct(loc, scale, prior, noise=noise, xi=xi, event_dim=event_dim)
    ref_kl, ref_grads = _value_and_grads(ref, [loc, scale])
    fn = K.find_kl_estimator(noise, type(prior)) if which == "registered" else K.kl_streaming
    assert fn is not None
    terms = fn(loc, scale, prior, noise=noise, xi=xi, event_dim=event_dim, chunk_size=5)
    kl, grads = _value_and_grads(terms, [loc, scale])
    assert kl.shape == shape[: len(shape) - event_dim]
    # The same float64 sums in another order (chunks of 5 against one pass): each KL sums 23
    # draws × ≤ 30 coordinates of log-density terms up to (4/0.05)²/2 ≈ 3e3 (the scale mixture's
    # narrow component), so round-off is ~ 700 · 3e3 · 1.1e-16 ≈ 2e-10 absolute against KLs of
    # ~1e2: ~1e-11 relative (seeds 0–4: ≤ 2.6e-11). rtol 1e-9 is ~40× that, and still catches
    # a wrong term of relative size 1e-7.
    assert_close(kl, ref_kl, rtol=1e-9)
    assert_close(terms.log_q.detach(), ref.log_q.detach(), rtol=1e-9)
    assert_close(terms.log_p.detach(), ref.log_p.detach(), rtol=1e-9)
    for g, r in zip(grads, ref_grads):
        # atol guards gradient entries that cancel to ~0 (rounding of O(1) terms in float64);
        # the gradients are O(10) sums of the same terms: ≤ 2.4e-12 relative measured.
        assert_close(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("noise", ["normal", "radial"])
def test_sufficient_statistics_carry_prior_gradients(noise):
    loc, scale = _site((4, 3))
    m = torch.tensor(0.2, dtype=F64, requires_grad=True)
    s = torch.tensor(0.9, dtype=F64, requires_grad=True)
    xi = _noise(noise, 17, (4, 3), 2)
    params = [loc, scale, m, s]
    ref = _value_and_grads(K.kl_direct(loc, scale, dist.Normal(m, s), noise=noise, xi=xi), params)
    est = K.kl_sufficient_statistics(loc, scale, dist.Normal(m, s), noise=noise, xi=xi)
    kl, grads = _value_and_grads(est, params)
    # Float64 round-off of the same sums regrouped (17 draws, 12 coordinates, a Normal prior:
    # terms ≤ 1e2): ≤ 2.5e-13 relative measured (seeds 0–4); rtol 1e-10 leaves room for the
    # order of summation, not for a wrong term.
    assert_close(kl, ref[0], rtol=1e-10)
    for g, r in zip(grads, ref[1]):
        assert_close(g, r, rtol=1e-10)


def test_streaming_with_autograd_score_for_an_unregistered_elementwise_prior():
    prior = dist.StudentT(_t(4.0), _t(0.1), _t(0.8))
    loc, scale = _site((5, 2))
    xi = torch.randn(11, 5, 2, dtype=F64)
    assert K.find_kl_estimator("normal", type(prior)) is K.streaming_elementwise
    ref = _value_and_grads(K.kl_direct(loc, scale, prior, xi=xi), [loc, scale])
    kl, grads = _value_and_grads(K.streaming_elementwise(loc, scale, prior, xi=xi), [loc, scale])
    # Float64 round-off as above (11 draws, 10 coordinates; ≤ 1e-14 relative measured); the
    # autograd score of log p is the same derivative as the reference's backward pass.
    assert_close(kl, ref[0], rtol=1e-10)
    for g, r in zip(grads, ref[1]):
        assert_close(g, r, rtol=1e-10, atol=1e-10)


# --- agreement with closed forms ---------------------------------------------------------------

EXACT = {
    ("normal", "normal"): lambda loc, scale, p: kl_divergence(
        dist.Normal(loc, scale).to_event(1),
        dist.Normal(p.loc, p.scale).expand(loc.shape).to_event(1),
    ),
    ("radial", "normal"): lambda loc, scale, p: kl_divergence(
        Radial(loc, scale, event_dim=1), dist.Normal(p.loc, p.scale).expand(loc.shape).to_event(1)
    ),
    ("normal", "laplace"): lambda loc, scale, p: kl_divergence(
        dist.Normal(loc, scale).to_event(1),
        dist.Laplace(p.loc, p.scale).expand(loc.shape).to_event(1),
    ),
}


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("noise,prior_name", sorted(EXACT))
def test_monte_carlo_agrees_with_exact_kl_and_its_error_shrinks_as_one_over_sqrt_m(
    noise, prior_name, seed
):
    # R independent M-sample estimates at once: a batch dim of R replicas of one random site.
    reps, d = 400, 12
    g = torch.Generator().manual_seed(seed)  # random (μ, σ, prior) per seed
    loc1 = torch.randn(d, dtype=F64, generator=g)
    scale1 = 0.2 + torch.rand(d, dtype=F64, generator=g)
    prior_loc = 0.5 * torch.randn((), dtype=F64, generator=g)
    prior_scale = 0.5 + torch.rand((), dtype=F64, generator=g)
    family = dist.Normal if prior_name == "normal" else dist.Laplace
    prior = family(prior_loc, prior_scale)
    loc, scale = loc1.expand(reps, d), scale1.expand(reps, d)
    exact = EXACT[(noise, prior_name)](loc1, scale1, prior)
    estimator = K.find_kl_estimator(noise, type(prior))
    assert estimator is not None
    sds = {}
    for m in (10, 1000):
        est = estimator(loc, scale, prior, noise=noise, num_samples=m, event_dim=1).kl
        assert est.shape == (reps,)
        mean, sd = est.mean(), est.std()
        # The mean of R = 400 replicas has standard error sd/√R; 4 of them fail with p ≈ 6e-5.
        assert abs(mean - exact) < 4 * sd / math.sqrt(reps), (m, float(mean), float(exact))
        sds[m] = sd
    # sd ∝ 1/√M: the ratio is √(10/1000) = 0.1. A sample sd from R = 400 replicas has relative
    # error ≈ 1/√(2R) ≈ 3.5% (more with heavy tails), the ratio of two ≈ 5%; ±35% is > 6 of those.
    ratio = float(sds[1000] / sds[10])
    assert 0.065 < ratio < 0.135, ratio


def test_gaussian_statistics_have_the_right_distribution():
    # T1 = Σ ξ ~ N(0, M); T2 = Σ ξ² ~ χ²_M: mean M, variance 2M; T2 − T1²/M ~ χ²_{M−1} is
    # independent of T1. n = 20000 elements: each mean has standard error √(var/n).
    m, n = 50, 20_000
    t1, t2 = K.sample_gaussian_statistics(m, (n,), dtype=F64)
    assert abs(t1.mean()) < 4 * math.sqrt(m / n)
    assert abs(t1.var() / m - 1) < 4 * math.sqrt(2 / n)  # sd of a sample variance ≈ σ²√(2/n)
    assert abs(t2.mean() - m) < 4 * math.sqrt(2 * m / n)
    assert abs(t2.var() / (2 * m) - 1) < 4 * math.sqrt((2 + 12 / m) / n)  # χ² excess kurtosis 12/M
    resid = t2 - t1 * t1 / m
    corr = torch.corrcoef(torch.stack([t1 * t1, resid]))[0, 1]
    assert abs(corr) < 4 / math.sqrt(n)  # independent: correlation has sd ≈ 1/√n
    t1, t2 = K.sample_gaussian_statistics(1, (5,), dtype=F64)
    assert_close(t2, t1 * t1)


# --- memory: the graph does not grow with M ----------------------------------------------------


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().kl.sum().backward()
    return total


@pytest.mark.parametrize(
    "noise,prior_name",
    [
        ("normal", "normal"),
        ("radial", "normal"),
        ("normal", "laplace"),
        ("radial", "scale_mixture"),
    ],
)
def test_saved_bytes_do_not_grow_with_m_but_the_direct_estimators_do(noise, prior_name):
    loc = torch.zeros(64, 32, requires_grad=True)
    scale = torch.full((64, 32), 0.1, requires_grad=True)
    prior = PRIORS[prior_name]()
    prior = type(prior)(*(getattr(prior, k).float() for k in prior.arg_constraints))
    estimator = K.find_kl_estimator(noise, type(prior))
    assert estimator is not None

    def ours(m):
        return _saved_bytes(lambda: estimator(loc, scale, prior, noise=noise, num_samples=m))

    def direct(m):
        return _saved_bytes(lambda: K.kl_direct(loc, scale, prior, noise=noise, num_samples=m))

    assert ours(1000) <= 1.05 * ours(1)
    assert ours(1) <= 10 * loc.numel() * 4  # a handful of D-sized tensors (μ, σ, T₁, G_μ, ...)
    # The direct graph keeps several M × D tensors: linear growth in M.
    d1, d10, d1000 = direct(1), direct(10), direct(1000)
    assert d10 >= 5 * d1 and d1000 >= 50 * d10
    assert d1000 >= 100 * ours(1000)


# --- registry and errors -------------------------------------------------------------------


def test_registry_is_keyed_by_noise_and_prior_family_along_the_mro():
    assert K.find_kl_estimator("normal", dist.Normal) is K.suffstat_normal
    assert K.find_kl_estimator("radial", dist.Normal) is K.suffstat_normal
    assert K.find_kl_estimator("radial", dist.Laplace) is K.streaming_laplace
    assert K.find_kl_estimator("normal", ScaleMixtureNormal) is K.streaming_scale_mixture
    assert K.find_kl_estimator("student", dist.Normal) is None

    class MyNormal(dist.Normal):
        pass

    assert K.find_kl_estimator("normal", MyNormal) is K.suffstat_normal
    calls = []

    def mine(loc, scale, prior, **kwargs):
        calls.append(kwargs["num_samples"])
        return K.kl_direct(loc, scale, prior, **kwargs)

    K.register_kl_estimator("normal", MyNormal)(mine)
    try:
        assert K.find_kl_estimator("normal", MyNormal) is mine
        assert K.find_kl_estimator("normal", dist.Normal) is K.suffstat_normal
    finally:
        del K.KL_ESTIMATORS[("normal", MyNormal)]
    with pytest.raises(TypeError, match="noise name"):
        K.register_kl_estimator(dist.Normal, "normal")  # type: ignore[arg-type]


def test_bad_arguments_raise_clear_errors():
    loc, scale = torch.zeros(3, 2), torch.ones(3, 2)
    prior = dist.Normal(0.0, 1.0)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        K.kl_sufficient_statistics(loc, scale, prior, num_samples=0)
    with pytest.raises(TypeError, match="num_samples must be an int"):
        K.kl_streaming(loc, scale, prior, num_samples=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"xi must have shape \(M, \*\(3, 2\)\)"):
        K.kl_direct(loc, scale, prior, xi=torch.zeros(4, 2, 3))
    with pytest.raises(ValueError, match="event_dim must lie in"):
        K.kl_streaming(loc, scale, prior, event_dim=3)
    with pytest.raises(ValueError, match="unknown noise family 'student'"):
        K.kl_direct(loc, scale, prior, noise="student")
    with pytest.raises(NotImplementedError, match="need a Normal prior"):
        K.kl_sufficient_statistics(loc, scale, dist.Laplace(0.0, 1.0))
    mvn = dist.MultivariateNormal(torch.zeros(2), torch.eye(2))
    with pytest.raises(NotImplementedError, match="element-wise prior"):
        K.kl_streaming(loc, scale, mvn)
    learnable = dist.Laplace(0.0, torch.tensor(1.0, requires_grad=True))
    with pytest.raises(NotImplementedError, match="'scale' requires grad"):
        K.kl_streaming(loc, scale, learnable)


@pytest.mark.parametrize(
    "old, names",
    [
        ("pyro_bdl.infer.kl_noise", ["KLTerms", "NoiseFamily", "noise_family", "RADIAL_NOISE"]),
        ("pyro_bdl.infer.kl_streaming", ["kl_streaming", "autograd_score", "laplace_chunk_sums"]),
    ],
)
def test_old_module_paths_warn_and_give_the_same_objects(old, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="moved to pyro_bdl.infer.kl"):
        module = importlib.import_module(old)
    for name in names:
        assert getattr(module, name) is getattr(K, name)
