"""A guide whose first call is ``Predictive(model, guide)(x)`` (no labels): the ready-made
model's likelihood site is left out of the guide's prototype as when it is observed, so the guide
sets up over the weights alone. Pyro's own autoguides take such an unobserved site for a latent
(refused as discrete for a classifier, fitted as a latent for a regressor)."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import Predictive
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSWAG
from tests.guides import test_ensemble

GUIDES = {
    "meanfield": lambda m: AutoMeanField(m, init_scale=0.05),
    "radial": AutoRadial,
    "swag": lambda m: AutoSWAG(m, rank=2),
}


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def _classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return models.classifier(bayesianize(net), 32)


@pytest.mark.parametrize("name", sorted(GUIDES))
def test_a_guide_first_called_by_predictive_sets_up_over_the_weights(name):
    x, y = _data()
    pyro.clear_param_store()
    model = _classifier()
    guide = GUIDES[name](model)
    draws = Predictive(model, guide=guide, num_samples=3)(x)
    assert draws["y"].shape == (3, 6)
    # The same sites as a guide set up by a training call.
    pyro.clear_param_store()
    trained = GUIDES[name](_classifier())
    trained(x, y)
    assert guide.layout.names == trained.layout.names
    assert "y" not in guide.prototype_trace.nodes


def test_a_regressor_guide_first_called_by_predictive_does_not_fit_the_targets():
    # Unobserved, a Gaussian likelihood is a continuous site: without the mark it became a
    # latent of the guide, with a location per row of this batch.
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = models.regressor(bayesianize(nn.Linear(4, 1)), 32, noise="learned")
    guide = AutoMeanField(model)
    draws = Predictive(model, guide=guide, num_samples=2)(_data()[0])
    assert draws["y"].shape == (2, 6)
    assert guide.layout.names == ["weight", "bias", "sigma"]


def test_an_ensemble_built_from_trained_members_predicts_without_a_training_call():
    pyro.set_rng_seed(0)
    model, guide = test_ensemble.make_ensemble(2)
    x, _ = test_ensemble.contract.data()
    draws = Predictive(model, guide=guide, num_samples=4)(x[:5])
    assert draws["y"].shape == (4, 5)
