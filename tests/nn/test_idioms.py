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


# -- loading a pretrained state_dict into a lifted network ---------------------------------------


def _pretrained_pair():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))  # noqa: E731
    return bdl.bayesianize(make()), make()


def test_a_pretrained_state_dict_loads_into_the_lifted_sites_initial_locations():
    lifted, pretrained = _pretrained_pair()
    result = lifted.load_state_dict(pretrained.state_dict())  # strict: no key left over
    assert not result.missing_keys and not result.unexpected_keys
    pyro.clear_param_store()
    model = models.classifier(lifted, dataset_size=8)
    guide = bdl.guides.AutoMeanField(model)
    guide(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    median = guide.median()
    for name, value in pretrained.named_parameters():
        if name.startswith("1."):  # the LayerNorm stays a parameter of the network
            assert torch.equal(dict(lifted.named_parameters())[name], value)
        else:  # the guide starts at the pretrained weights (init_to_network)
            assert torch.equal(median[name], value.detach())


def test_a_pretrained_weight_of_another_shape_is_a_load_error_naming_it():
    lifted, pretrained = _pretrained_pair()
    state = pretrained.state_dict()
    state["0.weight"] = torch.zeros(5, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight: .*\(5, 3\).*\(4, 3\)"):
        lifted.load_state_dict(state)


def test_a_tied_weight_loads_once_under_either_name():
    from tests.common import TiedLinear

    torch.manual_seed(0)
    pretrained = TiedLinear()
    lifted = bdl.bayesianize(TiedLinear())
    result = lifted.load_state_dict(pretrained.state_dict())
    assert not result.unexpected_keys
    assert torch.equal(bdl.sites(lifted)["a.weight"].init_value, pretrained.a.weight.detach())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_lifted_network_still_loads_pretrained_weights(how):
    import copy
    import pickle

    lifted, pretrained = _pretrained_pair()
    copied = copy.deepcopy(lifted) if how == "deepcopy" else pickle.loads(pickle.dumps(lifted))
    assert not copied.load_state_dict(pretrained.state_dict()).unexpected_keys
    target = pretrained[2].weight.detach()
    assert torch.equal(bdl.sites(copied)["2.weight"].init_value, target)
    assert not torch.equal(bdl.sites(lifted)["2.weight"].init_value, target)  # the original's
