"""Everyday PyTorch habits around a lifted network and the models built on it: evaluation under
``torch.inference_mode()`` before training."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

import pyro_bdl as bdl
from pyro_bdl import models, priors

PRIORS = [priors.Normal(), priors.ScaleMixtureNormal(), priors.Laplace(), priors.LayerwiseNormal()]


def _model(kind: str, prior) -> tuple[models.NetworkModel, torch.Tensor]:
    if kind == "classifier":
        net = bdl.bayesianize(nn.Linear(3, 2), prior)
        return models.classifier(net, dataset_size=10), torch.randint(0, 2, (10,))
    if kind == "heteroscedastic":
        net = bdl.bayesianize(nn.Linear(3, 2), prior)
        return models.heteroscedastic_regressor(net, dataset_size=10), torch.randn(10)
    scale = {"noise_scale": 0.5} if kind == "fixed" else {}
    net = bdl.bayesianize(nn.Linear(3, 1), prior)
    return models.regressor(net, dataset_size=10, noise=kind, **scale), torch.randn(10)


@pytest.mark.parametrize("prior", PRIORS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("kind", ["classifier", "fixed", "learned", "point", "heteroscedastic"])
def test_a_first_call_under_inference_mode_leaves_the_model_trainable(kind, prior):
    # The prior of each weight, a fixed σ, the prior of a learned σ and a point σ are made on
    # the first call and kept; made under inference mode, every later step raised autograd's
    # "Inference tensors cannot be saved for backward".
    model, y = _model(kind, prior)
    x = torch.randn(10, 3)
    with torch.inference_mode():
        model(x, y)
    guide = AutoNormal(poutine.block(model, hide=["y"]))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().named_parameters()}
    for _ in range(2):
        svi.step(x, y)
    # Every param trains, a point σ included (made under inference mode it stayed at 1).
    for name, value in pyro.get_param_store().named_parameters():
        assert not value.is_inference(), name
        assert not torch.equal(value, before.get(name, value + 1)), name
