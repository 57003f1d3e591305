"""VOGN and IVON used the way a PyTorch user uses an optimizer: a non-finite gradient names the
weight site it lies in, the scheduler adapter refuses what the methods would ignore, the
hyperparameters a step accepts survive the state_dict, bad hyperparameter types are named, and a
half-precision network is refused instead of accumulating in half precision."""

from __future__ import annotations

import io

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.infer import IVON, VOGN
from tests.faults.common import assert_same
from tests.faults.test_natural_gradient_faults import assert_refused, snapshot

METHODS = [VOGN, IVON]
N = 16


class _NaNGradient(torch.autograd.Function):
    """The identity forward; NaN backward (a layer whose gradient breaks, the loss finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


class TwoHeads(nn.Module):
    """Two linear heads summed; ``broken`` makes the gradient of head ``b`` alone NaN."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)
        self.broken = False

    def forward(self, x):
        out = self.b(x)
        return self.a(x) + (_NaNGradient.apply(out) if self.broken else out)


class LateNorm(nn.Module):
    """A BatchNorm that the forward pass calls only once ``late`` is set."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.head = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)
        self.late = False

    def forward(self, x):
        z = self.a(x)
        return self.head(torch.tanh(self.norm(z) if self.late else z))


def lifted_classifier(make=TwoHeads):
    """``(lifted network, classifier, x, y)`` in float64, for the network ``make()`` (seeded)."""
    torch.manual_seed(0)
    net = bayesianize(make().double(), priors.Normal(scale=1.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    return net, models.classifier(net, N), x, (x[:, 0] > 0).long()


def stepped(cls, **kwargs):
    """``(lifted network, x, y, method)`` after one step of ``cls`` on :func:`lifted_classifier`."""
    net, model, x, y = lifted_classifier()
    method = cls(model, dataset_size=N, **kwargs)
    method.step(x, y)
    return net, x, y, method


@pytest.fixture(autouse=True)
def _clear_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


@pytest.mark.parametrize("cls", METHODS)
def test_a_non_finite_gradient_names_the_weight_site_it_lies_in(cls):
    net, x, y, method = stepped(cls)
    net.broken = True  # 'a.weight' and 'a.bias' come first in the flat vector and stay finite
    assert_refused(
        method,
        net,
        lambda: method.step(x, y),
        ValueError,
        rf"{cls.__name__} step 2: the gradient of the likelihood for weights \(ĝ\) is not "
        r"finite \(NaN or inf\); nothing was updated\. The first non-finite entry is in weight "
        r"site 'b\.weight' at index \(0, 0\)",
    )


@pytest.mark.parametrize("cls", METHODS)
def test_add_param_group_is_refused_naming_the_hyperparameters_it_would_ignore(cls):
    *_, method = stepped(cls)
    with pytest.raises(ValueError, match=r"one parameter group.*param_groups\[0\]"):
        method.optimizer.add_param_group({"params": [torch.zeros(1)], "lr": 0.5})
    assert len(method.optimizer.param_groups) == 1
    method.load_state_dict(method.state_dict())  # still loads: one group


@pytest.mark.parametrize("cls", METHODS)
def test_tensor_hyperparameters_that_a_step_accepts_survive_the_state_dict(cls):
    _, x, y, method = stepped(cls, lr=0.01)
    # torch.optim's own optimizers take tensor rates (capturable), and so does the step.
    method.optimizer.param_groups[0]["lr"] = torch.tensor(0.02)
    method.optimizer.param_groups[0]["betas"] = (torch.tensor(0.8), 0.99)
    method.step(x, y)
    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    pyro.clear_param_store()
    _, model2, _, _ = lifted_classifier()
    resumed = cls(model2, dataset_size=N, lr=0.01)
    resumed.setup(x, y)
    resumed.load_state_dict(state)
    assert resumed.lr == pytest.approx(0.02) and resumed.optimizer.betas[0] == pytest.approx(0.8)
    torch.manual_seed(3)
    method.step(x, y)
    torch.manual_seed(3)
    resumed.step(x, y)
    assert torch.equal(method.state.mean, resumed.state.mean)


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"),
    [
        (VOGN, {"lr": None}, TypeError, r"lr must be a real number; got NoneType None"),
        (VOGN, {"lr": "0.1"}, TypeError, r"lr must be a real number; got str '0.1'"),
        (IVON, {"lr": True}, TypeError, r"lr must be a real number; got bool True"),
        (IVON, {"betas": ("a", 0.9)}, TypeError, r"betas\[0\] \(beta1\) must be a real number"),
        (VOGN, {"betas": (0.9, None)}, TypeError, r"betas\[1\] \(beta2\) must be a real number"),
        (VOGN, {"damping": None}, TypeError, r"damping must be a real number; got NoneType"),
        (VOGN, {"damping": "1e-3"}, TypeError, r"damping must be a real number; got str"),
        (VOGN, {"prior_precision": "1"}, TypeError, r"prior_precision must be a real number"),
        (VOGN, {"temperature": "1"}, TypeError, r"temperature must be a real number"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_named(cls, kwargs, error, match):
    _, model, _, _ = lifted_classifier()
    with pytest.raises(error, match=match):
        cls(model, dataset_size=N, **kwargs)


@pytest.mark.parametrize("cls", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_network_is_refused_before_anything_changes(cls, dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)
    lifted = bayesianize(net, priors.Normal(scale=1.0))
    model = models.classifier(lifted, N)
    x = torch.randn(N, 3).to(dtype)
    y = (x[:, 0] > 0).long()
    method = cls(model, dataset_size=N)
    assert_refused(
        method,
        lifted,
        lambda: method.step(x, y),
        ValueError,
        rf"{cls.__name__} keeps its state .* in the dtype of the weights; weight site "
        rf"'0\.weight' is {dtype}.*net\.float\(\).*torch\.autocast",
    )
    assert method.needs_setup


@pytest.mark.parametrize("cls", METHODS)
def test_a_hidden_parameter_frozen_after_set_up_is_left_as_it_is(cls):
    # As torch.optim skips a parameter without a gradient: fine-tuning freezes layers mid-run.
    lifted, model, x, y = lifted_classifier(
        lambda: nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))
    )
    method = cls(model, dataset_size=N, lr=0.05)
    method.step(x, y)
    norm = lifted[1]
    assert [h.name for h in method._hidden] == ["1.weight", "1.bias"]
    norm.weight.requires_grad_(False)
    weight, bias = norm.weight.detach().clone(), norm.bias.detach().clone()
    momentum = [m.clone() for m in method.state.hidden_momentum]
    for _ in range(2):
        method.step(x, y)
    assert torch.equal(norm.weight, weight)
    assert torch.equal(method.state.hidden_momentum[0], momentum[0])
    assert not torch.equal(norm.bias, bias)  # the trainable one still trains
    assert not torch.equal(method.state.hidden_momentum[1], momentum[1])
    norm.weight.requires_grad_(True)  # and unfrozen it trains again
    method.step(x, y)
    assert not torch.equal(norm.weight, weight)


@pytest.mark.parametrize("cls", METHODS)
def test_a_state_loaded_before_the_first_step_is_what_state_dict_gives(cls):
    # As torch.optim: state_dict() right after load_state_dict() (a checkpoint written before
    # the resumed run's first step) gives the loaded state, not an error.
    _, x, y, method = stepped(cls)
    state = method.state_dict()
    pyro.clear_param_store()
    _, model2, _, _ = lifted_classifier()
    fresh = cls(model2, dataset_size=N)
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert again.keys() == state.keys() and again["step"] == 1
    assert torch.equal(again["mean"], state["mean"])
    assert torch.equal(again["curvature"], state["curvature"])
    torch.manual_seed(3)
    method.step(x, y)
    torch.manual_seed(3)
    fresh.step(x, y)
    assert torch.equal(fresh.state.mean, method.state.mean)


@pytest.mark.parametrize("cls", METHODS)
def test_a_layer_first_called_after_set_up_is_refused_before_it_computes(cls):
    # The first step reads which parameters are trained: a layer with parameters that only a
    # later pass calls was silently never trained (and its running statistics not put back).
    net, model, x, y = lifted_classifier(LateNorm)
    method = cls(model, dataset_size=N)
    method.step(x, y)
    net.late = True
    before = snapshot(method, net)
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__} step 2: parameter 'norm\.weight' belongs to a layer that the "
        r"first step did not call.*Call every layer at the first step",
    ):
        method.step(x, y)
    # Refused before the layer computes: its running statistics are as they were; only its
    # call counter moved (BatchNorm counts the call before it reads its parameters).
    before["net"]["norm.num_batches_tracked"] += 1
    assert_same(before, snapshot(method, net))
    net.late = False
    method.step(x, y)


@pytest.mark.parametrize("cls", METHODS)
def test_a_state_on_the_meta_device_is_named_when_loading_or_stepping(cls):
    _, x, y, method = stepped(cls)
    state = method.state_dict()
    method.to("meta")  # shapes without values, as for a model built before its weights load
    for call in (lambda: method.load_state_dict(state), lambda: method.step(x, y)):
        with pytest.raises(
            ValueError, match=rf"{cls.__name__}'s state is on the meta device.*build a new"
        ):
            call()
