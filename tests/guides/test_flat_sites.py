import pyro.distributions as dist
import pytest
import torch
from torch.testing import assert_close

from pyro_bdl.guides.flat_sites import PointMass


@pytest.mark.parametrize("event_dim", [0, 1, 2])
def test_point_mass_scores_and_expands_as_a_delta(event_dim):
    v = torch.randn(3, 4, dtype=torch.float64)
    other = v + 1.0
    point = PointMass(v, event_dim=event_dim, validate_args=False)
    delta = dist.Delta(v, event_dim=event_dim)
    assert point.zero_density and point.rsample() is v
    assert point.__dict__["_log_density"] is None  # not made until read
    assert (point.batch_shape, point.event_shape) == (delta.batch_shape, delta.event_shape)
    for x in (v, other):
        assert_close(point.log_prob(x), delta.log_prob(x))
    # The zero log-density, made when first read, in v's dtype, and kept.
    assert point.log_density is point.__dict__["_log_density"]
    assert point.log_density.dtype == torch.float64
    expanded, expected = (
        point.expand((2, *point.batch_shape)),
        delta.expand((2, *delta.batch_shape)),
    )
    assert isinstance(expanded, PointMass) and expanded.zero_density
    assert_close(expanded.log_prob(other.expand(2, 3, 4)), expected.log_prob(other.expand(2, 3, 4)))


def test_point_mass_with_a_log_density_keeps_it():
    v, ladj = torch.randn(3), torch.randn(3)
    point = PointMass(v, log_density=ladj, validate_args=False)
    assert not point.zero_density and point.log_density is ladj
    assert_close(point.log_prob(v), ladj)


def test_point_mass_refuses_more_event_dims_than_its_value_has():
    with pytest.raises(ValueError, match="event_dim"):
        PointMass(torch.randn(3), event_dim=2)
