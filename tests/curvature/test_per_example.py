"""Squared per-example gradients against the ``vmap(grad)`` oracle (relative error 1e-10 in
float64, 1e-5 in float32)."""

from __future__ import annotations

import pyro.poutine as poutine
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import BasicBlock

from pyro_bdl import bayesianize, priors
from pyro_bdl.curvature import PerExampleGradients, substitute, vmap_squared_gradients
from pyro_bdl.curvature.layer_rules import batchnorm_per_example
from pyro_bdl.curvature.memory import TensorMemoryTracker
from pyro_bdl.curvature.per_example_forms import FORMS, choose_form

B = 5


def small_resnet(width: int = 4, classes: int = 3) -> nn.Module:
    down = nn.Sequential(
        nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width)
    )
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        BasicBlock(width, width),
        BasicBlock(width, 2 * width, stride=2, downsample=down),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


class Shared(nn.Module):
    """One Linear called twice (weight sharing): per-example gradients add before squaring."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class Scaled(nn.Module):
    """A layer with no rule of its own: handled by the vmap fallback."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return x * self.scale + self.scale.square()


CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), (6,)),
    "linear-sequence": (
        lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Flatten(), nn.Linear(20, 3)),
        (4, 6),
    ),
    "shared-linear": (Shared, (4,)),
    "fallback": (lambda: nn.Sequential(nn.Linear(4, 3), Scaled(), nn.LayerNorm(3)), (4,)),
    "conv1d": (
        lambda: nn.Sequential(
            nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, padding_mode="circular"),
            nn.Flatten(),
            nn.Linear(30, 3),
        ),
        (4, 9),
    ),
    "conv2d": (
        lambda: nn.Sequential(
            nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1), groups=2),
            nn.Tanh(),
            nn.Conv2d(6, 4, 3, padding="same", padding_mode="reflect"),
            nn.Flatten(),
            nn.Linear(4 * 3 * 10, 3),
        ),
        (4, 7, 7),
    ),
    "conv3d": (
        lambda: nn.Sequential(
            nn.Conv3d(
                2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2
            ),
            nn.Flatten(),
            nn.Linear(4 * 5 * 2 * 5, 3),
        ),
        (2, 5, 6, 4),
    ),
    "batchnorm": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True),
            nn.Flatten(),
            nn.BatchNorm1d(36),
            nn.Linear(36, 3),
        ),
        (3, 5, 5),
    ),
    "residual-block": (
        lambda: nn.Sequential(BasicBlock(3, 3), nn.Flatten(), nn.Linear(3 * 16, 3)),
        (3, 4, 4),
    ),
    "resnet": (small_resnet, (3, 8, 8)),
}


def make(case: str, dtype: torch.dtype):
    build, shape = CASES[case]
    torch.manual_seed(1)
    net = build().to(dtype)
    g = torch.Generator().manual_seed(2)
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            # Non-trivial running statistics and affine parameters (eval mode uses them).
            m.running_mean.uniform_(-0.5, 0.5, generator=g)
            m.running_var.uniform_(0.5, 2.0, generator=g)
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.5, 0.5, generator=g)
    net.eval()  # eval-mode BatchNorm treats examples independently, as the oracle does
    x = torch.randn(B, *shape, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (B,), generator=g)
    return net, x, y


def oracle(net, params, x, y):
    def loss_fn(p, xi, yi):
        with substitute(net, p):
            return F.cross_entropy(net(xi[None]), yi[None])

    return vmap_squared_gradients(loss_fn, params, x, y, chunk_size=2)


def assert_rel(actual: dict, expected: dict, rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(torch.finfo(expected[name].dtype).tiny)
        err = float((actual[name] - expected[name]).abs().max() / scale)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


# Relative to each tensor's largest entry. The rules and the oracle sum the same products of up
# to a few hundred O(1) terms in another order: round-off ~ √n·ε/2 to n·ε/2, i.e. 1e-15 to 3e-14
# in float64 and 1e-6 to 2e-5 in float32 (ε = 2.2e-16, 1.2e-7). Measured over every case and form:
# ≤ 1.1e-14 (float64) and ≤ 8e-7 (float32). A wrong rule is off by O(1).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_plain_matches_oracle(case, dtype):
    net, x, y = make(case, dtype)
    with PerExampleGradients(net, chunk_size=2) as tape:
        losses = F.cross_entropy(net(x), y, reduction="none")
    grads, squared = tape.squared_gradients(losses)
    params = dict(net.named_parameters())
    g0, s0 = oracle(net, params, x, y)
    assert_rel(grads, g0, TOL[dtype])
    assert_rel(squared, s0, TOL[dtype])
    # The summed gradients are also exactly what autograd gives for the summed loss.
    expected = torch.autograd.grad(
        F.cross_entropy(net(x), y, reduction="sum"), list(params.values())
    )
    assert_rel(grads, dict(zip(params, expected)), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["linear", "conv2d", "batchnorm", "resnet", "fallback"])
def test_lifted_matches_oracle(case, dtype):
    net, x, y = make(case, dtype)
    # Expose BatchNorm too, so its affine parameters are sampled sites as well.
    bnn = bayesianize(net, priors.Normal(0.0, 1.0), hide=[])
    g = torch.Generator().manual_seed(3)
    weights = {
        name: spec.init_value + 0.1 * torch.randn(spec.shape, generator=g, dtype=dtype)
        for name, spec in bnn._bdl_sites.items()
    }
    with PerExampleGradients(bnn) as tape, poutine.condition(data=weights):
        losses = F.cross_entropy(bnn(x), y, reduction="none")
    grads, squared = tape.squared_gradients(losses)
    g0, s0 = oracle(bnn, weights, x, y)
    assert set(grads) == set(weights)
    assert_rel(grads, g0, TOL[dtype])
    assert_rel(squared, s0, TOL[dtype])


# Every form of the Linear/conv rule on every layer it applies to (the cost model would pick
# only one per layer): grouped and unfold form per-example gradients, pairs expands the square.
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["linear", "linear-sequence", "shared-linear", "conv1d", "conv2d"])
@pytest.mark.parametrize("case_dtype", [torch.float64, torch.float32])
def test_every_form_matches_oracle(case, form, case_dtype):
    net, x, y = make(case, case_dtype)
    with PerExampleGradients(net, chunk_size=2, form=form) as tape:
        losses = F.cross_entropy(net(x), y, reduction="none")
    grads, squared = tape.squared_gradients(losses)
    g0, s0 = oracle(net, dict(net.named_parameters()), x, y)
    assert_rel(grads, g0, TOL[case_dtype])
    assert_rel(squared, s0, TOL[case_dtype])


@pytest.mark.parametrize("form", FORMS)
def test_every_form_on_conv3d_and_lifted_resnet(form):
    for case in ("conv3d", "resnet"):
        net, x, y = make(case, torch.float64)
        with PerExampleGradients(net, form=form) as tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        grads, squared = tape.squared_gradients(losses)
        g0, s0 = oracle(net, dict(net.named_parameters()), x, y)
        assert_rel(grads, g0, TOL[torch.float64])
        assert_rel(squared, s0, TOL[torch.float64])
    bnn = bayesianize(make("conv2d", torch.float64)[0], priors.Normal(0.0, 1.0))
    _, x, y = make("conv2d", torch.float64)
    g = torch.Generator().manual_seed(3)
    weights = {
        name: spec.init_value + 0.1 * torch.randn(spec.shape, generator=g, dtype=torch.float64)
        for name, spec in bnn._bdl_sites.items()
    }
    with PerExampleGradients(bnn, form=form) as tape, poutine.condition(data=weights):
        losses = F.cross_entropy(bnn(x), y, reduction="none")
    grads, squared = tape.squared_gradients(losses)
    g0, s0 = oracle(bnn, weights, x, y)
    assert_rel(grads, g0, TOL[torch.float64])
    assert_rel(squared, s0, TOL[torch.float64])


def test_cost_model_picks_each_form_where_it_is_cheapest():
    # ResNet-18 on 32 × 32 inputs, batch 32: the stem (256 positions) by the grouped kernel, the
    # 4 × 4 stage by unfolding, the 2 × 2 and 1 × 1 stages by position pairs (the choices that
    # per-layer timings on one CPU thread confirm; see docs/design/vogn.md).
    def pick(conv, hw):
        a = torch.zeros(32, conv.in_channels, hw, hw)
        delta = torch.zeros(32, conv.out_channels, *conv(a[:1]).shape[2:])
        return choose_form(conv, a, delta, single=True)

    assert pick(nn.Conv2d(3, 64, 7, stride=2, padding=3), 32) == "grouped"
    assert pick(nn.Conv2d(64, 64, 3, padding=1), 8) == "grouped"
    assert pick(nn.Conv2d(128, 128, 3, padding=1), 4) == "unfold"
    assert pick(nn.Conv2d(256, 256, 3, padding=1), 2) == "pairs"
    assert pick(nn.Conv2d(512, 512, 3, padding=1), 1) == "pairs"
    lin = nn.Linear(50, 10)
    assert choose_form(lin, torch.zeros(8, 50), torch.zeros(8, 10), single=True) == "pairs"
    # Weight sharing: the calls' gradients add before squaring, which pairs cannot express.
    assert choose_form(lin, torch.zeros(8, 50), torch.zeros(8, 10), single=False) == "unfold"
    with pytest.raises(ValueError, match="form must be one of"):
        PerExampleGradients(lin, form="im2col")


def test_train_mode_batchnorm_sums_to_total_gradient():
    # In training mode examples interact through the batch statistics; the per-example shares
    # must still add up to autograd's gradient of the summed loss.
    net, x, y = make("resnet", torch.float64)
    net.train()
    with PerExampleGradients(net) as tape:
        losses = F.cross_entropy(net(x), y, reduction="none")
    grads, squared = tape.squared_gradients(losses, retain_graph=True)
    params = dict(net.named_parameters())
    expected = torch.autograd.grad(losses.sum(), list(params.values()))
    assert_rel(grads, dict(zip(params, expected)), 1e-10)
    assert all(bool((s >= 0).all()) for s in squared.values())


def test_chunking_bounds_memory_and_keeps_values():
    net, x, y = make("conv2d", torch.float64)
    results = []
    for kwargs in ({"chunk_size": 1}, {"max_chunk_elements": 1}, {}):
        with PerExampleGradients(net, **kwargs) as tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        results.append(tape.squared_gradients(losses))
    for grads, squared in results[1:]:
        assert_rel(grads, results[0][0], 1e-12)
        assert_rel(squared, results[0][1], 1e-12)


def test_never_holds_batch_by_parameters():
    # Saved-for-backward and chunk tensors stay far below B × D when the chunk is one example.
    net = nn.Sequential(nn.Linear(50, 200), nn.ReLU(), nn.Linear(200, 10)).double()
    x, y = torch.randn(64, 50, dtype=torch.float64), torch.randint(0, 10, (64,))
    biggest = []
    original = torch.Tensor.square

    def spy(t):
        biggest.append(t.numel())
        return original(t)

    with PerExampleGradients(net, chunk_size=1) as tape:
        losses = F.cross_entropy(net(x), y, reduction="none")
    torch.Tensor.square = spy  # type: ignore[method-assign]
    try:
        tape.squared_gradients(losses)
    finally:
        torch.Tensor.square = original  # type: ignore[method-assign]
    num_params = sum(p.numel() for p in net.parameters())
    assert max(biggest) < 64 * num_params / 10


def test_default_forms_allocate_far_less_than_batch_by_parameters():
    # A net whose weights dwarf its activations (a 1 × 1 last stage, as ResNet-18's on CIFAR):
    # with the cost model's forms the squared gradients need O(D) memory, not B × D, even with a
    # chunk budget that would let a per-example form hold the whole batch.
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(8, 64, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).double()
    x, y = torch.randn(64, 8, 3, 3, dtype=torch.float64), torch.randint(0, 10, (64,))
    with PerExampleGradients(net, max_chunk_elements=2**26) as tape:
        losses = F.cross_entropy(net(x), y, reduction="none")
    num_params = sum(p.numel() for p in net.parameters())
    with TensorMemoryTracker(exclude=list(net.parameters())) as mem:
        tape.squared_gradients(losses)
    # Measured about B·D/12 here (the outputs, 2·D, and the recorded activations); a
    # per-example form (forced) allocates about B·D/2.
    assert mem.peak < 64 * num_params * 8 / 8


def test_errors():
    net, x, y = make("linear", torch.float64)
    with pytest.raises(ValueError, match="chunk_size"):
        PerExampleGradients(net, chunk_size=0)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        PerExampleGradients("net")  # type: ignore[arg-type]
    with PerExampleGradients(net) as tape:
        out = net(x)
    with pytest.raises(ValueError, match="1-d tensor"):
        tape.squared_gradients(F.cross_entropy(out, y))
    with pytest.raises(ValueError, match="dim 0"):
        tape.squared_gradients(F.cross_entropy(out, y, reduction="none")[:3])
    with pytest.raises(RuntimeError, match="no layer was recorded"):
        PerExampleGradients(net).squared_gradients(torch.ones(3))
    with pytest.raises(ValueError, match="valid names"):
        with substitute(net, {"0.nope": torch.zeros(1)}):
            pass


def test_a_tape_over_given_layers_hooks_only_those_and_can_be_reused():
    net, x, y = make("linear", torch.float64)
    first, last = net[0], net[2]
    tape = PerExampleGradients(layers=[last])
    for _ in range(2):  # kept across passes, as VOGN keeps its tape across steps
        with tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        assert list(tape.calls) == [last]
        raw = tape.compute(losses)
        tape.clear()
        assert tape.calls == {}
    with PerExampleGradients(net) as whole:
        losses = F.cross_entropy(net(x), y, reduction="none")
    expected = whole.compute(losses)
    assert set(raw) == {(last, "weight"), (last, "bias")}
    for key in raw:
        assert torch.equal(raw[key][0], expected[key][0])
        assert torch.equal(raw[key][1], expected[key][1])
    assert (first, "weight") in expected
    with pytest.raises(TypeError, match="layers must be a list"):
        PerExampleGradients(net, layers=[last])


def test_train_mode_batchnorm_reads_the_saved_batch_statistics():
    # The rule takes the batch mean and 1/std that the forward pass saved for its backward; the
    # same rule recomputing them from the saved input must give the same per-example gradients.
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3).double().train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    with PerExampleGradients(bn) as tape:
        out = bn(x)
        losses = out.pow(3).sum((1, 2, 3))
    assert tape.calls[bn][0].stats is not None
    grads, squared = tape.squared_gradients(losses)
    delta = 3 * bn(x).detach().square()  # ∂Σℓ/∂out, the same in every example's share
    pe = batchnorm_per_example(bn, x, delta, x)  # stats recomputed from the whole batch
    assert_rel(grads, {k: v.sum(0) for k, v in pe.items()}, 1e-12)
    assert_rel(squared, {k: v.square().sum(0) for k, v in pe.items()}, 1e-12)


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.proj(x)
        return self.head(self.attn(h, h, h)[0][:, -1])


@pytest.mark.parametrize(
    "make, layer",
    [
        (lambda: _Recurrent(nn.LSTM), "LSTM 'rnn' returns a tuple"),
        (lambda: _Recurrent(nn.GRU), "GRU 'rnn' returns a tuple"),
        (lambda: _Recurrent(nn.RNN), "RNN 'rnn' returns a tuple"),
        (_Attention, "MultiheadAttention 'attn' returns a tuple"),
    ],
)
def test_vogn_refuses_layers_without_a_per_example_form_and_changes_nothing(make, layer):
    import pyro

    from pyro_bdl import infer, models

    pyro.clear_param_store()
    torch.manual_seed(0)
    net = bayesianize(make())
    model = models.classifier(net, 10)
    x, y = torch.randn(5, 6, 3), torch.randint(0, 2, (5,))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    store = dict(pyro.get_param_store().items())
    vogn = infer.VOGN(model, dataset_size=10)
    with pytest.raises(ValueError, match=layer) as info:
        vogn.step(x, y)
    message = str(info.value)
    assert "Use IVON" in message and "requires_grad_(False)" in message
    if isinstance(net, _Attention):
        assert "'attn.out_proj' was not called" in message  # its weights are read by attn
    after = net.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert dict(pyro.get_param_store().items()) == store
    assert vogn.needs_setup  # nothing was set up: a later step would try afresh
    # IVON, from ordinary gradients, takes the same network.
    ivon = infer.IVON(model, dataset_size=10)
    assert torch.isfinite(torch.as_tensor(ivon.step(x, y)))


def test_vogn_takes_the_layers_once_they_are_frozen():
    import pyro

    from pyro_bdl import infer, models

    pyro.clear_param_store()
    torch.manual_seed(0)
    net = _Recurrent(nn.LSTM)
    net.rnn.requires_grad_(False)
    model = models.classifier(bayesianize(net), 10)
    x, y = torch.randn(5, 6, 3), torch.randint(0, 2, (5,))
    vogn = infer.VOGN(model, dataset_size=10)
    assert torch.isfinite(torch.as_tensor(vogn.step(x, y)))
    assert set(vogn.layout.names) == {"head.weight", "head.bias"}
