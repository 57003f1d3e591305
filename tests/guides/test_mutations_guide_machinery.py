"""The guides' shared machinery checked against independent computations: local latents in a
subsampled plate, the quantile bounds, the site-set check, the flat sites' Jacobian and batch
shapes, and the whole-state check before a load."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_bdl.guides import AutoMeanField
from pyro_bdl.guides.access import SiteSetChangedError, check_same_sites
from pyro_bdl.guides.flat_sites import sample_sites, split_latent
from pyro_bdl.guides.state_checks import StateDictMismatchError, state_dict_errors
from pyro_bdl.layout import SiteLayout

FULL = 6  # the data plate's full size


def _local_model(idx: torch.Tensor) -> None:
    """Two local latents per data point: a scalar (event_dim 0) and a 2-vector (event_dim 1)."""
    zeros = torch.zeros((), dtype=torch.float64)
    with pyro.plate("data", FULL, subsample=idx):
        pyro.sample("z", dist.Normal(zeros, 1.0))
        pyro.sample("u", dist.Normal(zeros.expand(2), 1.0).to_event(1))


def _plates(idx: torch.Tensor):
    return pyro.plate("data", FULL, subsample=idx)


def test_local_latents_of_a_subsampled_plate_read_the_subsample_rows():
    # Pyro's idiom: the guide's plate subsamples the rows the model's does (create_plates).
    pyro.clear_param_store()
    guide = AutoMeanField(_local_model, create_plates=_plates)
    guide(torch.arange(FULL))
    z_loc = torch.arange(1.0, FULL + 1, dtype=torch.float64)
    u_loc = 100.0 + torch.arange(2.0 * FULL, dtype=torch.float64).view(FULL, 2)
    guide.set_loc_scale("z", loc=z_loc, scale=1e-9)
    guide.set_loc_scale("u", loc=u_loc, scale=1e-9)
    idx = torch.tensor([4, 1, 5])
    trace = poutine.trace(guide).get_trace(idx)
    # Scale 1e-9: a draw is off its location by 1e-9·|ξ|, below 1e-8 unless |ξ| > 10
    # (probability 1e-23), so 1e-7 separates the right rows (distinct integers) from any other.
    torch.testing.assert_close(trace.nodes["z"]["value"], z_loc[idx], atol=1e-7, rtol=0)
    torch.testing.assert_close(trace.nodes["u"]["value"], u_loc[idx], atol=1e-7, rtol=0)


@pytest.mark.parametrize("bad", [[0.0, 0.5], [0.5, 1.0]])
def test_quantiles_at_the_bounds_are_refused(bad):
    # The quantiles 0 and 1 of a Gaussian marginal are ∓∞.
    pyro.clear_param_store()
    guide = AutoMeanField(_local_model)
    guide(torch.arange(FULL))
    with pytest.raises(ValueError, match=r"quantiles must be a non-empty 1-d list of numbers in"):
        guide.quantiles(bad)


def test_the_same_sites_in_another_order_are_another_site_set():
    # A packed guide's slices follow the set-up order: the same names in another order would
    # read each site from another site's slice.
    with pytest.raises(SiteSetChangedError, match="the same sites in another order"):
        check_same_sites("G", set_up=["a", "b"], now=["b", "a"])
    check_same_sites("G", set_up=["a", "b"], now=["a", "b"])


def test_without_site_names_the_packed_sizes_are_compared():
    with pytest.raises(SiteSetChangedError, match="they hold 3 numbers, the model's sites"):
        check_same_sites("G", set_up=None, now=["a"], set_up_size=3, now_size=4)
    check_same_sites("G", set_up=None, now=["a"], set_up_size=4, now_size=4)


def _constrained_model() -> None:
    pyro.sample("s", dist.LogNormal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
    pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))


def _layout() -> SiteLayout:
    return SiteLayout.from_trace(poutine.trace(_constrained_model).get_trace())[0]


def test_flat_sites_carry_the_log_jacobian_of_the_inverse_transform():
    """As in Pyro's AutoContinuous, a positive site s = exp(u) scores its own draw with
    log|du/ds| = −Σ log s = −Σ u; a real site scores 0; with densities masked out, 0."""
    layout = _layout()
    latent = torch.tensor([0.3, -1.2, 2.0, 0.7, -0.4], dtype=torch.float64)
    trace = poutine.trace(lambda: sample_sites(layout, latent, {})).get_trace()
    s, w = trace.nodes["s"], trace.nodes["w"]
    torch.testing.assert_close(s["value"], latent[:3].exp())
    torch.testing.assert_close(s["fn"].log_prob(s["value"]), -latent[:3].sum())
    assert float(w["fn"].log_prob(w["value"])) == 0.0
    masked = poutine.trace(poutine.mask(lambda: sample_sites(layout, latent, {}), mask=False))
    node = masked.get_trace().nodes["s"]
    assert float(node["fn"].log_prob(node["value"])) == 0.0


def test_split_latent_keeps_leading_batch_dims_left_of_the_event_dims():
    layout = _layout()
    latent = torch.arange(20.0, dtype=torch.float64).view(4, 5)  # 4 vectorised particles
    s, w = split_latent(layout, latent)
    assert torch.equal(s, latent[:, :3]) and torch.equal(w, latent[:, 3:])


def test_a_state_of_another_shape_with_as_many_numbers_is_refused_before_loading():
    layer = nn.Linear(3, 2)
    state = {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}  # 6 numbers, transposed
    assert state_dict_errors(layer, state) == [
        "'weight': the state has shape (3, 2), this module (2, 3)"
    ]


def test_a_missing_entry_is_refused_only_when_strict():
    layer = nn.Linear(3, 2)
    state = {"weight": torch.zeros(2, 3)}
    assert state_dict_errors(layer, state) == [
        "'bias': missing from the state (this module has (2,))"
    ]
    assert state_dict_errors(layer, state, strict=False) == []


def test_a_guide_state_missing_its_parameter_is_refused_and_nothing_loads():
    pyro.clear_param_store()
    guide = AutoMeanField(_local_model)
    guide(torch.arange(FULL))
    with pytest.raises(StateDictMismatchError, match="'loc_rho': missing from the state"):
        guide.load_state_dict({})


def _positive_model() -> None:
    pyro.sample("s", dist.LogNormal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))


def _positive_guide() -> AutoMeanField:
    """σ and loc set by hand: s = exp(u) with u ~ N(loc, scale), that is LogNormal(loc, scale)."""
    pyro.clear_param_store()
    guide = AutoMeanField(_positive_model)
    guide()
    loc = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    scale = torch.tensor([0.1, 0.3, 0.2], dtype=torch.float64)
    guide.set_loc_scale("s", loc=loc, scale=scale)
    return guide


def test_locs_and_scales_are_the_unconstrained_location_and_scale():
    guide = _positive_guide()
    loc, scale = guide.locs_and_scales()["s"]
    torch.testing.assert_close(loc, torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(scale, torch.tensor([0.1, 0.3, 0.2], dtype=torch.float64))


def test_a_positive_site_has_lognormal_median_quantiles_and_posterior():
    guide = _positive_guide()
    loc, scale = guide.locs_and_scales()["s"]
    torch.testing.assert_close(guide.median()["s"], loc.exp())
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    want = (loc + scale * torch.special.ndtri(q).unsqueeze(-1)).exp()  # exp is monotone
    torch.testing.assert_close(guide.quantiles(q.tolist())["s"], want)
    posterior = guide.get_posterior("s")
    x = torch.tensor([1.5, 0.4, 7.0], dtype=torch.float64)
    # The site is a 3-vector event (to_event(1)): one log density, the sum over its entries.
    lognormal = dist.LogNormal(loc, scale).to_event(1)
    torch.testing.assert_close(posterior.log_prob(x), lognormal.log_prob(x))
    trace = poutine.trace(guide).get_trace()
    value = trace.nodes["s"]["value"]
    assert bool((value > 0).all())
    torch.testing.assert_close(trace.nodes["s"]["fn"].log_prob(value), lognormal.log_prob(value))


def test_under_an_outer_plate_every_particle_draws_its_own_sites():
    # Vectorised particles (an outer plate left of the site's dims): the flat draw of one value
    # per site would give every particle the same weights.
    guide = _positive_guide()
    with pyro.plate("particles", 5, dim=-1):
        value = poutine.trace(guide).get_trace().nodes["s"]["value"]
    assert value.shape == (5, 3)
    assert len({tuple(row.tolist()) for row in value}) == 5
