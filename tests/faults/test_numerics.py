"""Fault class 4, numerical round-off: SWAG's diagonal variance in float32, the float32 subnetwork
Laplace with a tiny prior precision, and checkpoints of SWAG's older second-moment statistic.

Each case states what the old behaviour was and asserts on the numbers, or on the error / warning
and that nothing changed (:func:`snapshot`)."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoSubnetLaplace, AutoSWAG
from pyro_bdl.guides.laplace.posterior import MATERIAL_JITTER, RoundOffWarning
from tests.faults.common import assert_same, rng_states

F32, F64 = torch.float32, torch.float64
#: float32's unit round-off, 2⁻²⁴.
U32 = torch.finfo(F32).eps / 2


# ----------------------------------------------------------------------------- helpers


def snapshot(*objects) -> list:
    """Copies of everything a refusal must leave alone: each module's state dict (parameters
    and buffers) and ``_num_collected`` mirror, and the torch / Python / NumPy RNG states."""
    state: list = [rng_states()]
    for obj in objects:
        state.append({k: v.detach().clone() for k, v in obj.state_dict().items()})
        state.append(getattr(obj, "_num_collected", None))
    return state


def vector_model(d: int, dtype=F32):
    def model():
        pyro.sample("theta", dist.Normal(torch.zeros(d, dtype=dtype), 1.0).to_event(1))

    return model


def swag_fed(iterates: torch.Tensor, **kwargs) -> AutoSWAG:
    guide = AutoSWAG(vector_model(iterates.shape[1], iterates.dtype), **kwargs)
    guide()
    for theta in iterates:
        with torch.no_grad():
            guide.loc.copy_(theta)
        guide.collect()
    return guide


def iterates_near(magnitude: float, relative_move: float, t: int = 20, d: int = 2000, seed=0):
    """t float32 snapshots of d weights of size ~``magnitude`` that move by ~``relative_move``
    of it (drawn in float64, rounded once to float32)."""
    g = torch.Generator().manual_seed(seed)
    base = magnitude * (1 + 0.1 * torch.rand(d, generator=g, dtype=F64))
    moves = magnitude * relative_move * torch.randn(t, d, generator=g, dtype=F64)
    return (base + moves).to(F32)


def naive_variance(iterates: torch.Tensor) -> torch.Tensor:
    """The running E[θ²] − E[θ]² that SWAG used to keep, in the iterates' dtype."""
    mean, sq_mean = torch.zeros_like(iterates[0]), torch.zeros_like(iterates[0])
    for i, theta in enumerate(iterates):
        w = 1.0 / (i + 1)
        mean.lerp_(theta, w)
        sq_mean.mul_(1.0 - w).addcmul_(theta, theta, value=w)
    return sq_mean - mean * mean, mean, sq_mean


# ----------------------------------------------------------------------------- SWAG


@pytest.mark.parametrize("magnitude", [1.0, 1e3])
def test_swag_float32_variance_recovers_the_float64_reference(magnitude):
    iterates = iterates_near(magnitude, 1e-4)
    t = iterates.shape[0]
    exact = iterates.double().var(0, unbiased=False)  # the population variance, as SWAG's
    kappa = iterates.double().mean(0).abs() / exact.sqrt()  # ≈ 1e4 here
    # Chan, Golub & LeVeque (1983): Welford's update has relative error ≲ T·κ·u, the running
    # E[θ²] − E[θ]² up to T·κ²·u (here ≈ 10³, i.e. no correct digit).
    tolerance = t * kappa * U32
    assert float(tolerance.max()) < 0.05  # the bound is informative for this data
    guide = swag_fed(iterates, rank=3, scale=0.5)
    variances = guide.marginal_variances()["theta"].double() / guide.scale
    assert ((variances - exact).abs() / exact <= tolerance).all()
    # The same data through the old formula: the test can fail.
    naive, _, _ = naive_variance(iterates)
    naive_error = (naive.double() - exact).abs() / exact
    assert (naive_error > tolerance).float().mean() > 0.9
    assert (naive <= 0).float().mean() > 0.25  # what clamping to 1e-30 used to hide
    # The sampling distribution uses the same Σ_diag (SWAG-diag part of the covariance).
    posterior = guide.get_posterior()
    assert torch.equal(posterior.diag_variance, guide.marginal_variances()["theta"] / 0.5)


def test_swag_checkpoint_of_the_second_moment_is_converted_exactly():
    iterates = iterates_near(1.0, 1e-2, t=6, d=50)
    guide = swag_fed(iterates, rank=3)
    old = dict(guide.state_dict())
    _, mean, sq_mean = naive_variance(iterates)
    del old["swag_m2"]
    old["swag_mean"], old["swag_sq_mean"] = mean, sq_mean  # what the older version saved
    fresh = swag_fed(iterates[:0], rank=3)
    fresh.load_state_dict(old)
    assert fresh.num_collected == 6 and "swag_sq_mean" not in fresh.state_dict()
    # M2 = T·max(θ̄₂ − θ̄², 0) in float64, rounded once to float32.
    expected = 6 * (sq_mean.double() - mean.double().square()).clamp_min(0)
    assert torch.equal(fresh.swag_m2, expected.float())
    # Collecting goes on from the converted statistics: all 12 snapshots agree with the
    # reference to the accuracy of the converted (cancelling) part, 6·κ²·u of its variance.
    more = iterates_near(1.0, 1e-2, t=6, d=50, seed=1)
    for theta in more:
        with torch.no_grad():
            fresh.loc.copy_(theta)
        fresh.collect()
    every = torch.cat([iterates, more]).double()
    exact = every.var(0, unbiased=False)
    kappa2 = every.mean(0).square() / iterates.double().var(0, unbiased=False)
    tolerance = 6 * kappa2 * U32 + 12 * kappa2.sqrt() * U32
    got = fresh.marginal_variances()["theta"].double() / fresh.scale
    assert ((got - exact).abs() / exact <= tolerance).all()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("both", r"it also has 'swag_m2'"),
        ("no_counter", r"lacks \['swag_num_collected'\]"),
        ("shape", r"'swag_sq_mean' has shape \(49,\) but 'swag_mean' has \(50,\)"),
    ],
)
def test_swag_ambiguous_old_checkpoint_is_refused_before_anything_loads(corrupt, message):
    iterates = iterates_near(1.0, 1e-2, t=4, d=50)
    source = swag_fed(iterates, rank=3)
    state = dict(source.state_dict())
    state["swag_sq_mean"] = torch.ones(50)
    if corrupt == "no_counter":
        del state["swag_m2"], state["swag_num_collected"]
    elif corrupt == "shape":
        del state["swag_m2"]
        state["swag_sq_mean"] = torch.ones(49)
    target = swag_fed(iterates_near(1.0, 1e-2, t=3, d=50, seed=5), rank=3)
    before = snapshot(target)
    given = {k: v.clone() for k, v in state.items()}
    with pytest.raises(ValueError, match=message) as info:
        target.load_state_dict(state)
    assert "Nothing was loaded" in str(info.value)
    assert_same(before, snapshot(target))
    assert all(torch.equal(given[k], state[k]) for k in given) and given.keys() == state.keys()


# ----------------------------------------------------------------------------- Laplace


def linear_laplace(prior_precision: float, accumulate_dtype=None, n=8, d=30, noise=0.1):
    """A float32 linear regressor with more weights (d + 1) than data (n): the GGN XᵀX/σ² has
    rank n, so the prior alone sets the variance of d + 1 − n directions. The Jacobian [x, 1] is
    exact in float32, so a float64 fit of the float32 network reproduces the float64 reference."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(n, d, generator=g, dtype=F64)).to(F32)
    y = torch.randn(n, generator=g, dtype=F64).to(F32)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(d, 1), nn.Flatten(0))
    model = bdl.models.regressor(bdl.bayesianize(net, bdl.priors.Normal(scale=1.0)), n, noise)
    guide = AutoSubnetLaplace(
        model, subnetwork="all", prior_precision=prior_precision, accumulate_dtype=accumulate_dtype
    )
    guide(x, y)
    jac = torch.cat([x.double(), torch.ones(n, 1, dtype=F64)], 1)
    precision = jac.T @ jac / noise**2 + prior_precision * torch.eye(d + 1, dtype=F64)
    return guide, (x, y), precision


@pytest.mark.parametrize("prior_precision", [1e-2, 1e-6])
def test_laplace_float32_network_tiny_prior_matches_float64_reference(prior_precision):
    guide, data, precision = linear_laplace(prior_precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a reliable fit warns about nothing
        guide.fit(data, check_mode=False)  # fixed weights, not a MAP: round-off is the subject
    assert guide.ggn.dtype == F64 and guide.scale_tril.dtype == F64
    exact = torch.linalg.inv(precision).diagonal()
    evals = torch.linalg.eigvalsh(precision)
    kappa = float(evals[-1] / evals[0])  # up to 3·10¹⁰ at λ = 1e-6
    # A Cholesky-based inverse is accurate to c·S·κ·u₆₄ relative (backward-stable factor of a
    # matrix with condition number κ); c = 1 with S = 31.
    tolerance = precision.shape[0] * kappa * torch.finfo(F64).eps
    assert tolerance < 1e-3
    variances = guide.covariance.diagonal()
    assert ((variances - exact).abs() / exact).max() <= tolerance
    _, scale = guide.flat_loc_scale()
    assert ((scale.double().square() - exact).abs() / exact).max() <= tolerance + 2 * U32


@pytest.mark.parametrize(
    "prior_precision, message",
    [
        # Before: silent, marginal variances off by a factor ~100 after a jitter of 7e-3.
        (1e-6, r"needed a jitter of 7\.0e-03 on the diagonal, while its smallest eigenvalue is "),
        # Before: silent, no jitter at all but variances 13% off.
        (1e-2, r"has condition number at least 6\.\de\+05 in torch\.float32"),
    ],
)
def test_laplace_float32_accumulation_warns_with_the_size_and_the_fix(prior_precision, message):
    guide, data, precision = linear_laplace(prior_precision, accumulate_dtype=F32)
    with pytest.warns(RoundOffWarning, match=message) as record:
        guide.fit(data, check_mode=False)  # fixed weights, not a MAP: round-off is the subject
    text = str(record[0].message)
    assert "Raise prior_precision" in text and "accumulate_dtype=torch.float64" in text
    # The warning is warranted: the float32 variances are indeed off by more than the threshold.
    exact = torch.linalg.inv(precision).diagonal()
    error = ((guide.covariance.double().diagonal() - exact).abs() / exact).max()
    assert error > MATERIAL_JITTER


def test_laplace_float32_accumulation_is_quiet_when_well_conditioned():
    # κ(H_S) ≈ 50 at λ = 10³: float32 is accurate to κ·u ≈ 3e-6, so there is nothing to report.
    guide, data, precision = linear_laplace(1e3, accumulate_dtype=F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guide.fit(data, check_mode=False)  # fixed weights, not a MAP: round-off is the subject
    exact = torch.linalg.inv(precision).diagonal()
    kappa = float(torch.linalg.cond(precision))
    tolerance = precision.shape[0] * kappa * U32 * 2
    assert ((guide.covariance.double().diagonal() - exact).abs() / exact).max() <= tolerance
