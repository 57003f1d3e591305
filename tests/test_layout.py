"""The one site layout: construction from a trace and from lifted weights, flat <-> per site."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.layout import Site, SiteLayout
from pyro_bdl.priors import NonGaussianPriorError


def _lifted(prior=None):
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return bdl.bayesianize(net, prior=prior)


def _trace(model, *args):
    return poutine.trace(model).get_trace(*args)


def test_from_trace_knows_every_site_and_its_layer():
    net = _lifted()
    model = bdl.models.classifier(net, dataset_size=10)
    trace = _trace(model, torch.randn(5, 3), torch.zeros(5).long())
    layout, flat = SiteLayout.from_trace(trace)
    assert layout.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert layout.size == flat.numel() == 4 * 3 + 4 + 2 * 4 + 2
    assert [s.start for s in layout] == [0, 12, 16, 24]
    site = layout["2.weight"]
    assert site.module is net[2] and site.param_name == "weight"
    assert site.shape == (2, 4) and site.whole and site.transform is None
    assert layout.modules == [net[0], net[2]]
    # The packed vector holds the trace's values, site by site.
    assert torch.equal(layout.unpack(flat)["0.weight"], trace.nodes["0.weight"]["value"])


def test_split_unpack_pack_round_trip_with_batch_dims():
    layout = SiteLayout.from_specs(list(bdl.sites(_lifted()).values()))
    flat = torch.randn(7, layout.size)
    values = layout.unpack(flat)
    assert values["0.weight"].shape == (7, 4, 3)
    assert torch.equal(layout.pack(values), flat)
    # One autograd node for every site, not one slice per site.
    leaf = torch.randn(layout.size, requires_grad=True)
    parts = layout.split(leaf)
    assert len({p.grad_fn.next_functions[0][0] for p in parts}) == 1


def test_constrained_site_keeps_its_transform():
    def model():
        pyro.sample("s", dist.LogNormal(0.0, 1.0))
        pyro.sample("z", dist.Normal(torch.zeros(3), 1.0).to_event(1))

    trace = _trace(model)
    layout, flat = SiteLayout.from_trace(trace)
    s = layout["s"]
    assert s.transform is not None and s.spec is None and s.module is None
    # The flat vector holds the unconstrained (log) value; constrain maps it back.
    assert torch.allclose(s.constrain(flat[s.slice].view(s.shape)), trace.nodes["s"]["value"])
    assert layout["z"].transform is None


def test_errors_name_the_problem():
    layout = SiteLayout.from_specs(list(bdl.sites(_lifted()).values()))
    with pytest.raises(ValueError, match=r"unknown site 'nope'.*'0\.weight'"):
        layout["nope"]
    with pytest.raises(ValueError, match="length 26"):
        layout.split(torch.zeros(25))
    with pytest.raises(ValueError, match="missing"):
        layout.pack({"0.weight": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="no latent sites"):
        SiteLayout([])


def test_mixed_dtypes_are_refused():
    def model():
        pyro.sample("a", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("b", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))

    with pytest.raises(ValueError, match="share a dtype"):
        SiteLayout.from_trace(_trace(model))


def test_gaussian_prior_is_read_from_the_lifted_prior():
    layout = SiteLayout.from_specs(list(bdl.sites(_lifted(bdl.priors.Normal(1.5, 0.5))).values()))
    mean, precision = layout.gaussian_prior()
    assert mean.shape == precision.shape == (layout.size,)
    assert torch.equal(mean.unique(), torch.tensor([1.5]))
    assert torch.equal(precision.unique(), torch.tensor([4.0]))


def test_layerwise_prior_gives_a_precision_per_layer():
    prior = bdl.priors.LayerwiseNormal("radford")
    layout = SiteLayout.from_specs(list(bdl.sites(_lifted(prior)).values()))
    _, precision = layout.gaussian_prior()
    # Radford: scale 1/sqrt(fan_in), so precision = fan_in: 3 for the first layer, 4 for the second.
    first, second = layout["0.weight"], layout["2.bias"]
    assert torch.allclose(precision[first.slice], torch.tensor(3.0))
    assert torch.allclose(precision[second.slice], torch.tensor(4.0))


@pytest.mark.parametrize(
    "prior", [bdl.priors.Laplace(1.0), bdl.priors.ScaleMixtureNormal()], ids=["laplace", "mix"]
)
def test_non_gaussian_prior_is_refused_with_the_way_out(prior):
    layout = SiteLayout.from_specs(list(bdl.sites(_lifted(prior)).values()))
    with pytest.raises(NonGaussianPriorError, match=r"'0\.weight'.*prior_precision="):
        layout.gaussian_prior()


def test_a_site_that_is_not_a_lifted_weight_has_no_known_prior():
    def model():
        pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    layout, _ = SiteLayout.from_trace(_trace(model))
    with pytest.raises(NonGaussianPriorError, match="'z' is not a weight lifted"):
        layout.gaussian_prior()


def test_a_site_whose_unconstrained_value_has_fewer_dims_counts_its_event_dims_there():
    # A 3×3 correlation Cholesky factor is 3 unconstrained numbers: one event dim, not two.
    def model():
        pyro.sample("L", dist.LKJCholesky(3, 1.0))

    trace = _trace(model)
    layout, flat = SiteLayout.from_trace(trace)
    site = layout["L"]
    assert site.shape == (3,) and site.event_dim == 1 and site.whole
    # float32 round trip through the LKJ transform and back, entries ≤ 1: a few ulps (6e-8 each).
    assert torch.allclose(site.constrain(flat[site.slice]), trace.nodes["L"]["value"], atol=1e-6)


def test_a_subsampled_local_site_is_repeated_along_its_plate_dim_not_its_event_dim():
    def model():
        with pyro.plate("data", 6, subsample=torch.tensor([3, 4, 5])):
            pyro.sample("z", dist.Normal(torch.zeros(3, 2), 1.0).to_event(1))

    trace = _trace(model)
    z = trace.nodes["z"]["value"]  # (3, 2): 3 of the 6 rows, 2 numbers each
    layout, flat = SiteLayout.from_trace(trace)
    site = layout["z"]
    assert site.shape == (6, 2) and site.event_dim == 1 and site.frames == (("data", -1),)
    # Periodically repeated along the plate to the full size, as Pyro's autoguides do.
    assert torch.equal(flat[site.slice].view(6, 2), torch.cat([z, z]))
    local, values = SiteLayout.from_trace(trace, full_plates=False)
    assert local["z"].shape == (3, 2) and torch.equal(values, z.reshape(-1))


def test_sites_that_do_not_tile_the_flat_vector_are_refused():
    a = Site("a", 0, 4, torch.Size([2, 2]), 2)
    SiteLayout([a, Site("b", 4, 7, torch.Size([3]), 1)])
    with pytest.raises(
        ValueError, match=r"site 'b' must take the flat indices \[4, 7\).*got \[5, 8\)"
    ):
        SiteLayout([a, Site("b", 5, 8, torch.Size([3]), 1)])  # a gap at index 4
    with pytest.raises(
        ValueError, match=r"site 'b' must take the flat indices \[4, 7\).*got \[4, 6\)"
    ):
        SiteLayout([a, Site("b", 4, 6, torch.Size([3]), 1)])  # 2 indices for 3 numbers
