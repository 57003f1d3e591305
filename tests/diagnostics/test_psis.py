import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

from pyro_bdl.diagnostics import psis
from tests.scenarios import NormalNormal


def standard_normal_2d():
    pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))


def normal_guide_2d(scale):
    def guide():
        pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), scale).to_event(1))

    return guide


@pytest.mark.parametrize("scale, band", [(0.5, (0.7, 0.9)), (0.95, (0.05, 0.2))])
def test_khat_of_narrow_normal_guides(scale, band):
    """Pyro's own PSIS check: a guide N(0, s²) for a posterior N(0, 1) in every coordinate.

    The ratio w = p/q = s·exp(x²(1/s² − 1)/2) with x ~ N(0, s²) has a Pareto tail with shape
    k = 1 − s² (0.75 and 0.0975). In one dimension that tail carries a slowly varying 1/√log t
    factor that biases k̂ low at any practical S (measured with ArviZ: 0.705 at S = 5·10⁵ and
    0.71 at 4·10⁶), so we use two coordinates: Σx²/s² ~ χ²₂ is exactly exponential, the tail
    is exactly Pareto and k̂ is unbiased (measured mean 0.752 at S = 3·10⁵). PSIS fits the top
    M = 3√S ratios and sd(k̂) ≈ (1 + k)/√M; with S = 4·10⁶, M = 6000: sd 0.023 at k = 0.75
    (the band edges are 2.2 and 6.6 sd away) and 0.014 at k = 0.0975 (3.3 and 7.3 sd).
    """
    result = psis.psis_khat(
        standard_normal_2d,
        normal_guide_2d(scale),
        num_samples=4_000_000,
        vectorize=True,
        max_plate_nesting=0,
        batch_size=1_000_000,
    )
    assert band[0] < result.khat < band[1]
    assert result.band == ("bad" if scale == 0.5 else "good")
    assert result.log_weights.shape == (4_000_000,)


def test_exact_guide_on_conjugate_scenario():
    """The exact posterior as guide: log p(θ, y) − log q(θ) = log p(y) for every draw."""
    nn_ = NormalNormal()
    loc, scale = nn_.posterior_loc, nn_.posterior_scale

    def guide(y=None):
        pyro.sample("mu", dist.Normal(torch.tensor(loc, dtype=torch.float64), scale))

    result = psis.psis_khat(nn_.model, guide, num_samples=100)  # one draw at a time
    assert result.khat < 0.5 and result.band == "good" and result.ok
    assert result.ess == 100
    torch.testing.assert_close(
        result.log_weights, torch.full((100,), nn_.log_evidence, dtype=torch.float64)
    )


def test_nearly_exact_guide_on_conjugate_scenario():
    """A guide 5% narrower than the exact posterior: k = 1 − 0.95² ≈ 0.1 (see above); with
    S = 20,000 draws sd(k̂) ≈ 1.1/√(3√S) = 0.05, so 0.5 is 8 sd away."""
    nn_ = NormalNormal()
    loc, scale = nn_.posterior_loc, 0.95 * nn_.posterior_scale

    def guide(y=None):
        pyro.sample("mu", dist.Normal(torch.tensor(loc, dtype=torch.float64), scale))

    result = psis.psis_khat(
        nn_.model, guide, num_samples=20_000, vectorize=True, max_plate_nesting=1
    )
    assert result.khat < 0.5 and result.band == "good"
    assert 0.5 * 20_000 < result.ess < 20_000


def test_bands():
    assert psis.khat_band(0.49)[0] == "good"
    assert psis.khat_band(0.5)[0] == "questionable"
    assert psis.khat_band(0.69)[0] == "questionable"
    assert psis.khat_band(0.7)[0] == "bad"
    assert psis.khat_band(math.nan)[0] == "bad"
    assert psis.khat_band(-math.inf)[0] == "good"
    r = psis.PsisResult(0.8, *psis.khat_band(0.8), torch.zeros(3), 1.0)
    assert not r.ok and "not a trustworthy" in str(r)


def test_pareto_khat_core():
    g = torch.Generator().manual_seed(0)
    # Log-ratios of N(0,1) target vs N(0,1.5²) proposal: bounded weights, k̂ well below 0.5.
    x = 1.5 * torch.randn(5000, generator=g, dtype=torch.float64)
    lw = dist.Normal(0.0, 1.0).log_prob(x) - dist.Normal(0.0, 1.5).log_prob(x)
    khat, ess = psis.pareto_khat(lw)
    assert khat < 0.3 and 0 < ess < 5000
    assert psis.pareto_khat(torch.full((10,), 3.0)) == (-math.inf, 10.0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="at least one draw"):
        psis.pareto_khat(torch.zeros(0))
    with pytest.raises(ValueError, match=r"shape \(num_samples,\)"):
        psis.pareto_khat(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        psis.pareto_khat(torch.tensor([0.0, math.nan, 1.0]))
    with pytest.raises(TypeError, match="floating point"):
        psis.pareto_khat(torch.arange(5))
    guide = normal_guide_2d(0.5)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        psis.psis_khat(standard_normal_2d, guide, num_samples=0)
    with pytest.raises(ValueError, match="max_plate_nesting"):
        psis.psis_khat(standard_normal_2d, guide, vectorize=True)


def test_one_draw_is_too_few_not_a_perfect_guide():
    # A single ratio is "constant" but says nothing about the tail: k̂ = inf as for any sample
    # too short to fit (it read -inf, "good").
    khat, ess = psis.pareto_khat(torch.tensor([0.3], dtype=torch.float64))
    assert khat == math.inf and ess == 1.0
    assert psis.khat_band(khat)[0] == "bad"


def test_equal_ratios_beside_zero_weights_are_a_bounded_tail():
    # Draws of zero weight (log ratio -inf) leave the others' weights equal and bounded: k̂ is
    # -inf and the ESS counts the draws of positive weight, as without the zero weights (ArviZ
    # gives inf here, as for exactly equal ratios).
    ratios = torch.cat([torch.full((10,), -math.inf), torch.full((490,), 2.0)]).double()
    assert psis.pareto_khat(ratios) == (-math.inf, 490.0)
    assert psis.pareto_khat(torch.full((490,), 2.0, dtype=torch.float64)) == (-math.inf, 490.0)


def point_guide_2d():
    pyro.sample("z", dist.Delta(torch.full((2,), 0.3, dtype=torch.float64)).to_event(1))


def test_a_guide_with_a_spread_drawn_one_particle_a_pass_is_not_a_point_mass():
    # Every vectorized pass holds one particle: the draws differ across passes only.
    result = psis.psis_khat(
        standard_normal_2d,
        normal_guide_2d(0.9),
        num_samples=50,
        vectorize=True,
        max_plate_nesting=0,
        batch_size=1,
    )
    assert result.log_weights.shape == (50,)
    # The draws differ across passes: log p(θ) − log q(θ) = |θ|²(1/0.81 − 1)/2 + c varies with θ
    # for q = N(0, 0.9²I) against p = N(0, I), so equal log weights would mean one θ copied into
    # every pass (smoothing may tie a few tail weights, never all of them).
    assert torch.isfinite(result.log_weights).all()
    assert result.log_weights.unique().numel() > 1


@pytest.mark.parametrize("vectorize", [False, True])
def test_point_mass_guide_is_refused_not_called_good(vectorize):
    # Every draw is the same θ, so every ratio is the same and k̂ read -inf, "good: the guide is
    # close to the posterior", for a MAP (AutoDelta, or AutoSWAG outside its sampling mode).
    with pytest.raises(ValueError, match=r"all 20 guide draws are the same.*point mass"):
        psis.psis_khat(
            standard_normal_2d,
            point_guide_2d,
            num_samples=20,
            vectorize=vectorize,
            max_plate_nesting=0,
        )


def test_a_subsampled_likelihood_warns_naming_the_fix():
    """A model whose plate scales the likelihood by N/B (a minibatch of the training data, the
    usual mistake) makes p(θ, y) an estimate; psis_khat says so instead of a k̂ without meaning."""
    from pyro_bdl import bayesianize, models
    from pyro_bdl.guides import AutoMeanField

    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    model = models.classifier(bayesianize(torch.nn.Linear(3, 2)), 100)
    guide = AutoMeanField(model)
    with pytest.warns(UserWarning, match=r"scales observed site 'y' by 5.*full training data"):
        psis.psis_khat(model, guide, x, y, num_samples=20)
    pyro.clear_param_store()
    full = models.classifier(bayesianize(torch.nn.Linear(3, 2)), 20)
    psis.psis_khat(full, AutoMeanField(full), x, y, num_samples=20)  # no warning: the full data
    # A scale below 1 (poutine.scale) makes p(θ, y) no less an estimate.
    pyro.clear_param_store()
    with pytest.warns(UserWarning, match=r"scales observed site 'y' by 0.5"):
        psis.psis_khat(poutine.scale(full, scale=0.5), AutoMeanField(full), x, y, num_samples=20)


def test_ok_is_strictly_below_the_bad_threshold():
    # The "bad" band starts at k̂ = 0.7 (khat_band), so a k̂ of exactly 0.7 is not ok.
    assert not psis.PsisResult(0.7, *psis.khat_band(0.7), torch.zeros(3), 1.0).ok
    assert psis.PsisResult(0.69, *psis.khat_band(0.69), torch.zeros(3), 1.0).ok


def test_constant_ratio_tolerance_is_relative_to_the_dtype():
    # rtol = 0 still reads exactly equal ratios as a bounded tail (spread 0 ≤ 0).
    assert psis.pareto_khat(torch.full((10,), 3.0), rtol=0.0) == (-math.inf, 10.0)
    # The default tolerance is 1000 float64 epsilons (2.2e-13) relative: a spread of 1e-15
    # is rounding, a spread of 1e-8 is a (tiny) real difference whose tail ArviZ fits.
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(500, generator=g, dtype=torch.float64)
    assert psis.pareto_khat(2.0 + 1e-15 * noise)[0] == -math.inf
    khat, ess = psis.pareto_khat(2.0 + 1e-8 * noise)
    assert math.isfinite(khat) and 0 < ess <= 500
