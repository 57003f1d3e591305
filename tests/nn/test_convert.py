import copy
import pickle

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule
from torch import nn
from torch.testing import assert_close

from pyro_bdl import bayesianize, sites
from pyro_bdl.nn.convert import FastAccess


class _Net(nn.Module):
    """Layers read by attribute in the forward (a Sequential iterates its dict instead)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.Sequential(nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(3 * 4 * 4, 2)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))))


def _cnn() -> nn.Module:
    return _Net()


def _with_pyros_classes(net: nn.Module) -> nn.Module:
    """A copy of the lifted ``net`` whose layers have Pyro's own ``PyroModule[cls]`` classes."""
    other = copy.deepcopy(net)
    for layer in other.modules():
        if isinstance(layer, FastAccess):
            layer.__class__ = type(layer).__bases__[1]
    assert not any(isinstance(m, FastAccess) for m in other.modules())
    return other


def _trace(net: nn.Module, x: torch.Tensor) -> tuple[list, torch.Tensor]:
    pyro.clear_param_store()  # the two networks' param sites share names
    pyro.set_rng_seed(1)
    tr = poutine.trace(net).get_trace(x)
    nodes = [
        (name, site["type"], site["value"])
        for name, site in tr.nodes.items()
        if site["type"] in ("sample", "param")
    ]
    return nodes, tr.nodes["_RETURN"]["value"]


def _assert_same_pass(net: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    nodes, out = _trace(net, x)
    ref_nodes, ref_out = _trace(reference, x)
    assert [n[:2] for n in nodes] == [n[:2] for n in ref_nodes]
    for (_, _, value), (_, _, ref_value) in zip(nodes, ref_nodes):
        assert_close(value, ref_value)
    assert_close(out, ref_out)


def test_lifted_layers_read_and_call_as_pyros_classes_do():
    net = bayesianize(_cnn())
    assert all(isinstance(m, FastAccess) for m in net.modules())
    x = torch.randn(2, 1, 4, 4)
    reference = _with_pyros_classes(net)
    _assert_same_pass(net, reference, x)
    nodes, _ = _trace(net, x)
    # Weights are sample sites, BatchNorm's hidden parameters param sites, each once.
    assert [(n, t) for n, t, _ in nodes] == [
        ("conv.weight", "sample"),
        ("bn.weight", "param"),
        ("bn.bias", "param"),
        ("head.weight", "sample"),
        ("head.bias", "sample"),
    ]


def test_replaced_layers_buffers_and_dtypes_are_read_afresh():
    net = bayesianize(_cnn())
    reference = _with_pyros_classes(net)
    x = torch.randn(2, 1, 4, 4)
    head = nn.Linear(3 * 4 * 4, 2)
    for model in (net, reference):
        # A plain layer set after lifting: Pyro registers its parameters (pyro.module).
        model.act = nn.Sequential(nn.Tanh(), nn.Flatten())
        model.head = copy.deepcopy(head)
        model.bn.running_mean = torch.full((3,), 0.5)
    assert not isinstance(net.head, PyroModule)
    _assert_same_pass(net, reference, x)
    assert net.bn.running_mean is net.bn._buffers["running_mean"]
    _trace(net, x)
    assert {"head$$$weight", "head$$$bias"} <= set(pyro.get_param_store().keys())
    net.double()
    reference.double()
    assert net.bn.running_var.dtype == torch.float64
    _assert_same_pass(net, reference, x.double())


def test_inner_layer_called_alone_runs_in_its_own_pyro_context():
    net = bayesianize(_cnn())
    layer = net.head
    tr = poutine.trace(layer).get_trace(torch.randn(2, 3 * 4 * 4))
    assert {n for n, s in tr.nodes.items() if s["type"] == "sample"} == {"head.weight", "head.bias"}
    assert not layer._pyro_context.active and not layer._pyro_context.cache


def test_lifted_classes_survive_copies_and_pickles():
    net = bayesianize(_cnn())
    x = torch.randn(2, 1, 4, 4)
    assert type(net.conv).__name__ == "PyroConv2d" and isinstance(net.conv, PyroModule[nn.Conv2d])
    for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert [type(m) for m in other.modules()] == [type(m) for m in net.modules()]
        assert list(sites(other)) == list(sites(net))
        _assert_same_pass(other, net, x)


class _Forwarding(nn.Module):
    """A wrapper whose own ``__getattr__`` forwards unknown names to the wrapped layer."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, x):
        return self.inner(x) * self.out_features


def test_layer_with_its_own_attribute_lookup_keeps_pyros_class():
    net = bayesianize(nn.Sequential(_Forwarding()))
    assert not isinstance(net[0], FastAccess) and isinstance(net[0].inner, FastAccess)
    tr = poutine.trace(net).get_trace(torch.randn(4, 3))
    assert tr.nodes["_RETURN"]["value"].shape == (4, 2)
    assert set(sites(net)) == {"0.inner.weight", "0.inner.bias"}
