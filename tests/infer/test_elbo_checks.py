"""The validation ``TraceSuffStat_ELBO`` shares with ``Trace_ELBO``: a latent site whose batch dims
no plate declares is refused (in the model and in the guide), as Pyro refuses it, rather than
summed into its KL."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Trace_ELBO

from pyro_bdl.infer import TraceSuffStat_ELBO

SHAPE_ERROR = r'at site "z", invalid log_prob shape\n  Expected \[\], actual \[3\]'


def _model(y, event=True):
    prior = dist.Normal(torch.zeros(3), 1.0)
    z = pyro.sample("z", prior.to_event(1) if event else prior)
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(z.sum(), 1.0), obs=y)


def _guide(y, event=True):
    q = dist.Normal(pyro.param("loc", torch.zeros(3)), 0.5)
    pyro.sample("z", q.to_event(1) if event else q)


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceSuffStat_ELBO])
def test_a_latent_site_with_undeclared_batch_dims_is_refused(elbo_cls):
    y = torch.randn(8)
    # Model and guide agree (so the guide-match check passes) but neither declares the 3.
    with pytest.raises(ValueError, match=SHAPE_ERROR):
        elbo_cls().loss(lambda y: _model(y, False), lambda y: _guide(y, False), y)
    loss = elbo_cls().loss(_model, _guide, y)  # declared with to_event: accepted
    assert torch.isfinite(torch.tensor(loss))


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceSuffStat_ELBO])
def test_an_auxiliary_guide_site_with_undeclared_batch_dims_is_refused(elbo_cls):
    y = torch.randn(8)

    def guide(y):
        _guide(y)
        aux = dist.Normal(torch.zeros(3), 1.0)
        pyro.sample("aux", aux, infer={"is_auxiliary": True})

    with pytest.raises(ValueError, match=r'at site "aux", invalid log_prob shape'):
        elbo_cls().loss(_model, guide, y)


def test_latent_shapes_are_not_checked_with_validation_off():
    pyro.enable_validation(False)
    y = torch.randn(8)
    loss = TraceSuffStat_ELBO().loss(lambda y: _model(y, False), lambda y: _guide(y, False), y)
    assert torch.isfinite(torch.tensor(loss))
