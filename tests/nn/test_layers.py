"""Lifting the layers of 2026's networks: recurrent, attention, embedding, grouped convolution,
layer norm, layers with their own metaclass; or refusing them before anything changes."""

import abc
import copy
import pickle
import warnings

import pyro
import pytest
import torch
from pyro import poutine
from pyro.nn.module import _PyroModuleMeta
from torch import nn
from torch.testing import assert_close

from pyro_bdl import bayesianize, sites
from pyro_bdl.nn import LayerNotLiftable, lora, lora_and_head


class _Head(nn.Module):
    """Calls a layer and keeps the first output of those that return a tuple."""

    def __init__(self, layer, kind=""):
        super().__init__()
        self.layer, self.kind = layer, kind

    def forward(self, x):
        if self.kind == "attention":
            return self.layer(x, x, x, need_weights=False)[0]
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


LAYERS = {
    "lstm": (lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True), (2, 5, 3)),
    "gru": (lambda: nn.GRU(3, 4, batch_first=True), (2, 5, 3)),
    "rnn": (lambda: nn.RNN(3, 4, batch_first=True), (2, 5, 3)),
    "embedding": (lambda: nn.Embedding(10, 4), None),
    "attention": (lambda: nn.MultiheadAttention(4, 2, batch_first=True), (2, 5, 4)),
    "grouped_conv": (lambda: nn.Conv2d(4, 8, 3, groups=2), (2, 4, 6, 6)),
    "depthwise_conv": (lambda: nn.Conv1d(4, 4, 3, groups=4, padding=1), (2, 4, 7)),
    "layer_norm": (lambda: nn.LayerNorm(4), (2, 5, 4)),
}
if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    LAYERS["rms_norm"] = (lambda: nn.RMSNorm(4), (2, 5, 4))


def _input(name, shape):
    return torch.randint(0, 10, (2, 5)) if shape is None else torch.randn(shape)


def _at_init(net, x):
    """The lifted network's output with every weight at its initial location."""
    data = {name: spec.init_value for name, spec in sites(net).items()}
    return poutine.condition(net, data=data)(x)


@pytest.mark.parametrize("name", LAYERS)
def test_layer_lifts_and_matches_the_network_at_its_own_weights(name):
    make, shape = LAYERS[name]
    net = _Head(make(), "attention" if name == "attention" else "").eval()
    x = _input(name, shape)
    expected = net(x)
    count = sum(1 for _ in net.parameters())
    bayesianize(net, hide=())  # LayerNorm is hidden by default: expose everything
    assert len(sites(net)) == count
    assert_close(_at_init(net, x), expected)
    # Sampled weights change the output: the layer reads its sites, not a stale copy.
    assert not torch.allclose(net(x), expected)


# Attention kernels (scaled_dot_product_attention on CPU, the fused MHA of eval mode) have no
# vmap rule: PyTorch runs them in a loop and says so (docs/methods/layers.md). Right, but slow.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("name", ["lstm", "gru", "embedding", "attention"])
def test_layer_runs_with_weights_batched_over_particles(name):
    make, shape = LAYERS[name]
    net = bayesianize(_Head(make(), "attention" if name == "attention" else "").eval())
    x = _input(name, shape)
    with pyro.plate("particles", 3, dim=-1):
        trace = poutine.trace(net).get_trace(x)
    out = trace.nodes["_RETURN"]["value"]
    assert out.shape[0] == 3
    # Each particle equals the plain forward at its own weights (recurrent layers: a loop).
    values = {n: s["value"] for n, s in trace.nodes.items() if s["type"] == "sample"}
    for k in range(3):
        one = poutine.condition(net, data={n: v[k] for n, v in values.items()})(x)
        assert_close(out[k], one)


def test_recurrent_layer_can_be_unlifted_again():
    net = _Head(nn.GRU(3, 4, batch_first=True)).eval()
    x = torch.randn(2, 5, 3)
    expected = net(x)
    bayesianize(net)
    bayesianize(net, hide=[nn.GRU], relift=True)
    assert not sites(net)
    assert_close(net(x), expected)


class _Scripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        with warnings.catch_warnings():  # TorchScript is deprecated, and still met in the wild
            warnings.simplefilter("ignore", FutureWarning)
            self.script = torch.jit.script(nn.Linear(3, 3))


def _snapshot(net):
    return type(net), {k: v.clone() for k, v in net.state_dict().items()}


def test_unliftable_layer_is_refused_before_anything_changes():
    net = _Scripted()
    before_type, before = _snapshot(net)
    with pytest.raises(LayerNotLiftable, match=r"layer 'script'.*TorchScript.*before scripting"):
        bayesianize(net)
    after_type, after = _snapshot(net)
    assert after_type is before_type and type(net.fc) is nn.Linear
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_gradient_checkpointing_is_refused_before_anything_changes():
    net = nn.Sequential(nn.Linear(3, 3))
    net[0].gradient_checkpointing = True
    with pytest.raises(
        LayerNotLiftable, match=r"layer .0.*gradient checkpointing.*checkpointing_disable"
    ):
        bayesianize(net)
    assert type(net[0]) is nn.Linear and isinstance(net[0].weight, nn.Parameter)


class _AbstractBlock(nn.Module, abc.ABC):
    """A layer class with its own metaclass (as PEFT's tuners have)."""

    @abc.abstractmethod
    def scale(self) -> float: ...


class _Block(_AbstractBlock):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def scale(self) -> float:
        return 2.0

    def forward(self, x):
        return self.scale() * self.fc(x)


def test_layer_with_its_own_metaclass_lifts_copies_and_pickles():
    net = _Block()
    x = torch.randn(4, 3)
    expected = net(x)
    bayesianize(net)
    assert isinstance(net, _Block) and set(sites(net)) == {"fc.weight", "fc.bias"}
    assert_close(_at_init(net, x), expected)
    assert_close(_at_init(copy.deepcopy(net), x), expected)
    blob = pickle.dumps(net)
    # A fresh process has no converted class yet: unpickling builds it again.
    _PyroModuleMeta._pyro_mixin_cache.pop(_Block)
    _PyroModuleMeta._pyro_mixin_cache.pop(_AbstractBlock)
    assert_close(_at_init(pickle.loads(blob), x), expected)


class _LoraLinear(nn.Module):
    """A base layer with a low-rank adapter, named as PEFT names them."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})
        self.base_layer.requires_grad_(False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def _adapted():
    net = nn.Sequential(_LoraLinear(), nn.ReLU(), nn.Linear(4, 2))
    return net


def test_lora_rule_makes_only_the_adapters_random_and_shares_the_base_weights():
    net = _adapted()
    base = {n: p.data_ptr() for n, p in net.named_parameters() if "base_layer" in n}
    stored = sum(t.numel() for t in (*net.parameters(), *net.buffers()))
    bayesianize(net, expose=lora)
    assert set(sites(net)) == {"0.lora_A.default.weight", "0.lora_B.default.weight"}
    # The frozen base is a buffer over the same storage; the trainable head stays a parameter.
    buffers = dict(net.named_buffers())
    assert {n: buffers[n].data_ptr() for n in base} == base
    assert isinstance(net[2].weight, nn.Parameter)
    # The adapters' initial locations replace the adapter parameters; nothing else is stored.
    after = sum(t.numel() for t in (*net.parameters(), *net.buffers()))
    assert after == stored


def test_lora_rule_with_a_head_glob_and_refusals():
    net = bayesianize(_adapted(), expose=[lora, "2.*"])
    assert set(sites(net)) == {
        "0.lora_A.default.weight",
        "0.lora_B.default.weight",
        "2.weight",
        "2.bias",
    }
    with pytest.raises(ValueError, match=r"no LoRA parameter.*get_peft_model"):
        bayesianize(nn.Linear(2, 2), expose=lora_and_head)
    with pytest.raises(TypeError, match="pass it as expose="):
        bayesianize(_adapted(), hide=[lora])
