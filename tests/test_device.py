"""Device discipline: a batch on another device than the network is refused, naming both devices
and the fix, before anything changes; every method's state follows ``.to(device)``. No GPU is
needed: the ``meta`` device stands in for "another device"."""

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models


class _TwoInputs(nn.Module):
    """A network taking two tensors (a structured batch: a dict or a tuple)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, first, second):
        return self.norm(self.a(first) + self.b(second))


def _snapshot(net: nn.Module) -> dict:
    store = pyro.get_param_store()
    return {
        "params": {k: v.detach().clone() for k, v in store.items()},
        "rng": torch.get_rng_state(),
        "buffers": {k: b.clone() for k, b in net.named_buffers()},
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for k, v in before["params"].items():
        assert torch.equal(v, after["params"][k]), k
    assert torch.equal(before["rng"], after["rng"])
    assert before["buffers"].keys() == after["buffers"].keys()
    for k, b in before["buffers"].items():
        assert torch.equal(b, after["buffers"][k]), k


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "later-call"])
@pytest.mark.parametrize(
    "structure, expect",
    [
        ("tensor", r"x is on device meta but the network is on cpu.*x\.to\('cpu'\)"),
        ("dict", r"x\['first'\] is on device meta .* on cpu.*v\.to\('cpu'\) for k, v in x"),
        ("tuple", r"x\[1\] is on device meta .* on cpu.*t\.to\('cpu'\) for t in x"),
    ],
)
def test_batch_on_another_device_is_refused_before_anything_changes(structure, expect, warm):
    if structure == "tensor":
        net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        x = torch.randn(8, 3)
        moved = _meta(x)
    else:
        net = bayesianize(_TwoInputs())
        first, second = torch.randn(8, 3), torch.randn(8, 2)
        if structure == "dict":
            x = {"first": first, "second": second}
            moved = {"first": _meta(first), "second": second}
        else:
            x = (first, second)
            moved = (first, _meta(second))
    model = models.classifier(net, dataset_size=100)
    y = torch.randint(0, 4, (8,))
    if warm:  # after a first call: the param store and running statistics hold values
        model(x, y)
    before = _snapshot(net)
    with pytest.raises(ValueError, match=expect):
        model(moved, y)
    _assert_same(before, _snapshot(net))


def test_labels_on_another_device_are_refused():
    model = models.classifier(bayesianize(nn.Linear(3, 4)), dataset_size=100)
    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,), device="meta")
    before = _snapshot(model.net)
    with pytest.raises(ValueError, match=r"y is on device meta .* on cpu.*y\.to\('cpu'\)"):
        model(x, y)
    _assert_same(before, _snapshot(model.net))


def test_the_check_follows_the_network_moved_after_the_model_was_built():
    net = bayesianize(nn.Linear(3, 1))
    model = models.regressor(net, dataset_size=100, noise_scale=0.5)
    net.to("meta")
    with pytest.raises(ValueError, match=r"x is on device cpu but the network is on meta"):
        model(torch.randn(8, 3), torch.randn(8))
