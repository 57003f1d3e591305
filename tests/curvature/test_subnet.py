"""The subnetwork Jacobian, GGN and diagonal GGN against ``torch.func`` brute force."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from pyro_bdl.curvature.ggn import diagonal_ggn, output_hessian_factor, subnet_ggn
from pyro_bdl.curvature.jacobian import ParamSlot, subnet_jacobian
from pyro_bdl.curvature.memory import TensorMemoryTracker, jacobian_row_bytes
from pyro_bdl.guides.laplace.evidence import evidence, tune_grid
from pyro_bdl.guides.laplace.posterior import DiagPosterior, RoundOffWarning, cholesky_jitter
from pyro_bdl.guides.laplace.predictive import linearized_predictive
from tests.common import assert_close


class Net(nn.Module):
    """Conv (stride, padding, dilation), a Linear on a sequence dim, a shared Linear called twice,
    and a LayerNorm (generic fallback)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=2, stride=2, dilation=2)
        self.seq = nn.Linear(3, 4)
        self.shared = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))  # (B, 3, 3, 3)
        h = torch.tanh(self.seq(h.flatten(2).transpose(1, 2)))  # (B, 9, 4): Linear over a sequence
        h = h.mean(1)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.head(self.norm(h))


def _setup(seed=0):
    torch.manual_seed(seed)
    net = Net().double()
    x = torch.randn(5, 2, 5, 5, dtype=torch.float64)
    modules = dict(net.named_modules())
    slots, names = [], []
    for name, p in net.named_parameters():
        owner, pname = name.rsplit(".", 1)
        slots.append(ParamSlot(p, modules[owner], pname))
        names.append(name)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def f(theta):
        params, offset = {}, 0
        for name, p in zip(names, net.parameters()):
            params[name] = theta[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return functional_call(net, params, (x,))

    return net, x, slots, flat, f


def test_subnet_jacobian_equals_jacrev_slice():
    net, x, slots, flat, f = _setup()
    full = jacrev(f)(flat)  # (B, C, D): fine for a 200-weight oracle
    index = torch.randperm(flat.numel())[:60]
    jac = subnet_jacobian(lambda: net(x), slots, index)
    assert jac.shape == (5, 3, 60)
    assert_close(jac, full[:, :, index], rtol=1e-10, atol=1e-12)
    everything = subnet_jacobian(lambda: net(x), slots, torch.arange(flat.numel()))
    assert_close(everything, full, rtol=1e-10, atol=1e-12)


def test_subnet_jacobian_is_the_same_with_the_smallest_temporaries():
    net, x, slots, _, _ = _setup()
    index = torch.randperm(200)[:60]
    jac = subnet_jacobian(lambda: net(x), slots, index)
    assert_close(subnet_jacobian(lambda: net(x), slots, index, select_numbers=1), jac, rtol=1e-14)


def test_jacobian_row_bytes_grows_linearly_with_the_rows():
    """The bytes of a chunk are a fixed part plus rows × a per-row part: the step from 2 to 4
    rows is twice the step from 1 to 2 (10% for allocation granularity), and the per-row part
    holds at least the row of J_S (C × S float64)."""
    net, x, slots, _, _ = _setup()
    x = torch.cat([x, x])  # 10 rows
    index = torch.arange(60)
    peak = {n: jacobian_row_bytes(lambda n=n: net(x[:n]), slots, index) for n in (1, 2, 4)}
    step = peak[2] - peak[1]
    assert step >= 3 * 60 * 8
    assert abs((peak[4] - peak[2]) - 2 * step) <= 0.1 * 2 * step, peak


def test_output_hessian_factor_matches_nll_hessian():
    torch.manual_seed(0)
    f = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1])
    for n in range(4):
        h = torch.autograd.functional.hessian(lambda z, n=n: -z.log_softmax(-1)[y[n]], f[n])
        factor = output_hessian_factor(f, "categorical")[n]
        assert_close(factor @ factor.T, h, rtol=1e-10, atol=1e-12)
    g = torch.randn(4, dtype=torch.float64)
    factor = output_hessian_factor(g, "bernoulli")
    assert_close(factor.squeeze(), (g.sigmoid() * (1 - g.sigmoid())).sqrt())
    factor = output_hessian_factor(g, "gaussian", noise_scale=0.5)
    assert_close(factor.squeeze(), torch.full((4,), 2.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown likelihood 'poisson'"):
        output_hessian_factor(g, "poisson")
    with pytest.raises(ValueError, match="noise_scale"):
        output_hessian_factor(g, "gaussian")


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
def test_subnet_ggn_and_diagonal_ggn_equal_brute_force(likelihood):
    net, x, slots, flat, f = _setup(1)
    full = jacrev(f)(flat)
    factor = output_hessian_factor(net(x), likelihood, noise_scale=0.3)
    lam = factor @ factor.transpose(1, 2)
    ggn = torch.einsum("bcd,bce,bef->df", full, lam, full)
    index = torch.randperm(flat.numel())[:40]
    jac = subnet_jacobian(lambda: net(x), slots, index)
    assert_close(subnet_ggn(jac, factor), ggn[index][:, index], rtol=1e-10, atol=1e-12)
    diag = diagonal_ggn(
        lambda: net(x),
        slots,
        lambda out: output_hessian_factor(out, likelihood, noise_scale=0.3),
        batch_chunk=2,
    )
    assert_close(diag, ggn.diagonal(), rtol=1e-10, atol=1e-12)


def test_subnet_ggn_accumulates_in_float64():
    jac = torch.randn(3, 2, 4)
    factor = torch.randn(3, 2, 2)
    assert subnet_ggn(jac, factor, dtype=torch.float64).dtype == torch.float64


def test_cholesky_jitter_retries_then_names_smallest_eigenvalue():
    singular = torch.ones(3, 3, dtype=torch.float64)  # PSD, rank 1: plain Cholesky fails
    with pytest.warns(RoundOffWarning, match=r"needed a jitter of 1\.0e-10.*≤ 0"):
        factor = cholesky_jitter(singular)
    assert_close(factor @ factor.T, singular, atol=1e-4)
    indefinite = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"smallest eigenvalue -2\.000e\+00"):
        cholesky_jitter(indefinite, what="H_S")


def test_linearized_predictive_closed_forms():
    torch.manual_seed(0)
    f = torch.randn(6, 1, dtype=torch.float64)
    jl = torch.randn(6, 1, 4, dtype=torch.float64)
    mean, var = linearized_predictive(f.squeeze(-1), jl, "gaussian", noise=0.5)
    assert_close(mean, f.squeeze(-1))
    assert_close(var, jl.square().sum((1, 2)) + 0.25)
    p = linearized_predictive(f, jl, "bernoulli")
    v = jl.square().sum((1, 2))
    assert_close(p, (f.squeeze(-1) / (1 + math.pi * v / 8).sqrt()).sigmoid())
    # Categorical with C = 2 reduces to the binary probit on the logit difference.
    f2 = torch.cat([f, torch.zeros_like(f)], 1)
    jl2 = torch.cat([jl, torch.zeros_like(jl)], 1)
    p2 = linearized_predictive(f2, jl2, "categorical")
    assert_close(p2[:, 0], p)
    # C classes: each logit scaled by its own variance.
    f3 = torch.randn(6, 4, dtype=torch.float64)
    jl3 = torch.randn(6, 4, 5, dtype=torch.float64)
    p3 = linearized_predictive(f3, jl3, "categorical")
    v3 = jl3.square().sum(-1)
    assert_close(p3, (f3 / (1 + math.pi * v3 / 8).sqrt()).softmax(-1))


def test_evidence_in_the_eigenbasis_and_grid_search():
    torch.manual_seed(0)
    a = torch.randn(5, 5, dtype=torch.float64)
    ggn = a @ a.T
    theta = torch.randn(5, dtype=torch.float64)
    lam = torch.tensor(0.7, dtype=torch.float64)
    direct = (
        -0.5 * lam * theta.square().sum()
        + 2.5 * lam.log()
        - 0.5 * torch.logdet(ggn + lam * torch.eye(5, dtype=torch.float64))
    )
    eigen = DiagPosterior(torch.linalg.eigvalsh(ggn), lam)  # the GGN in its eigenbasis
    assert_close(evidence(eigen, theta, lam), direct)
    grid = torch.logspace(-2, 2, 9, dtype=torch.float64)
    best = tune_grid(lambda v: -((v.log() - math.log(0.3)) ** 2), grid)
    # The refined grid spans two coarse steps (2 × ln(10)/2) in 20 steps: its spacing is 0.115 in
    # log λ, so the optimum is found to half of it.
    assert abs(math.log(best) - math.log(0.3)) < 0.058
    with pytest.warns(UserWarning, match="edge of the grid.*widest posterior"):
        tune_grid(lambda v: -v, grid)
    with pytest.warns(UserWarning, match="edge of the grid.*MAP limit"):
        tune_grid(lambda v: v, grid)


def test_memory_tracker_counts_allocations():
    keep = torch.zeros(10)
    with TensorMemoryTracker(exclude=[keep]) as mem:
        a = torch.ones(1000, dtype=torch.float64)
        b = a * 2
        del a, b
        view = keep[:5]  # a view of an excluded storage is not counted
    assert mem.peak == 16000
    assert mem.current == 0
    assert view.numel() == 5


def test_two_class_categorical_factor_is_one_column():
    f = torch.tensor([[0.3, -1.2], [40.0, -40.0], [2.0, 2.0]], dtype=torch.float64)
    factor = output_hessian_factor(f, "categorical")
    assert factor.shape == (3, 2, 1)
    for n in range(3):
        h = torch.autograd.functional.hessian(lambda z, n=n: -z.log_softmax(-1)[0], f[n])
        assert_close(factor[n] @ factor[n].T, h, rtol=1e-10, atol=1e-30)


def _mlp(classes: int):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, classes)).double()
    return net, torch.randn(7, 3, dtype=torch.float64)


def _residual(likelihood, y, shift=0.0):
    def fn(out):
        leaf = out.detach().requires_grad_(True)
        if likelihood == "categorical":
            nll = nn.functional.cross_entropy(leaf, y, reduction="sum")
        else:
            nll = 0.5 * (leaf - 1.0).square().sum() / 0.3**2
        # ``shift`` moves r out of the span of a categorical L (the unfolded path).
        return torch.autograd.grad(nll, leaf)[0] + shift

    return fn


CASES_FOLD = [("categorical", 2, 0.0), ("categorical", 3, 0.0), ("gaussian", 2, 0.0)]
CASES_FOLD += [("categorical", 2, 0.1)]


@pytest.mark.parametrize("likelihood, classes, shift", CASES_FOLD)
def test_gradient_from_the_curvature_passes_with_one_pass_per_column(likelihood, classes, shift):
    from pyro_bdl.curvature.ggn import residual_coefficients
    from pyro_bdl.curvature.kfac import KronLayer, kfac_sums

    net, x = _mlp(classes)
    y = torch.arange(7) % classes
    residual_fn = _residual(likelihood, y, shift)
    factor_fn = lambda out: output_hessian_factor(out, likelihood, noise_scale=0.3)  # noqa: E731
    out = net(x)
    folded = residual_coefficients(factor_fn(out), residual_fn(out)) is not None
    assert folded == (shift == 0.0)
    params = list(net.parameters())
    expected = torch.autograd.grad((out * residual_fn(out)).sum(), params)
    passes = []

    def forward():
        o = net(x)
        o.register_hook(lambda g: passes.append(1))
        return o

    columns = factor_fn(out).shape[-1]
    slots = [
        ParamSlot(p, net[int(n.split(".")[0])], n.split(".")[1]) for n, p in net.named_parameters()
    ]
    grad = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    plain = diagonal_ggn(forward, slots, factor_fn)
    passes.clear()
    diag = diagonal_ggn(forward, slots, factor_fn, residual_fn=residual_fn, grad=grad)
    assert len(passes) == columns + (not folded)  # no pass of its own when folded
    assert_close(diag, plain, rtol=1e-12, atol=1e-30)
    assert_close(grad, torch.cat([g.reshape(-1) for g in expected]), rtol=1e-10, atol=1e-12)

    layers = [KronLayer(net[0], "linear", True), KronLayer(net[2], "linear", True)]

    def sums(with_grad):
        a = [torch.zeros(4, 4, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)]
        g = [
            torch.zeros(5, 5, dtype=torch.float64),
            torch.zeros(classes, classes, dtype=torch.float64),
        ]
        gs = [torch.zeros(5, 4, dtype=torch.float64), torch.zeros(classes, 6, dtype=torch.float64)]
        kw = dict(residual_fn=residual_fn, grad_sums=gs) if with_grad else {}
        kfac_sums(forward, layers, factor_fn, a, g, **kw)
        return a, g, gs

    a0, g0, _ = sums(False)
    passes.clear()
    a1, g1, gs = sums(True)
    if folded and columns == 1:  # two classes: one plain backward pass for everything
        assert len(passes) == 1
    for u, v in zip(a0 + g0, a1 + g1):
        assert_close(u, v, rtol=1e-12, atol=1e-30)
    for part, (w, b) in zip(gs, [expected[:2], expected[2:]]):
        assert_close(part, torch.cat([w, b[:, None]], 1), rtol=1e-10, atol=1e-12)


def test_kfac_input_factor_of_layers_sharing_one_input():
    from pyro_bdl.curvature.kfac import KronLayer, kfac_sums

    torch.manual_seed(0)
    q, v, w = nn.Linear(3, 2), nn.Linear(3, 2, bias=False), nn.Linear(3, 2)
    q, v, w = q.double(), v.double(), w.double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)  # a sequence: 5 positions
    # q and w read x with a bias (one shared product), v without one (another product).
    layers = [KronLayer(q, "linear", True), KronLayer(v, "linear", False)]
    layers.append(KronLayer(w, "linear", True))
    a = [torch.zeros(4, 4, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)]
    a.append(torch.zeros(4, 4, dtype=torch.float64))
    g = [torch.zeros(2, 2, dtype=torch.float64) for _ in range(3)]
    factor = lambda o: output_hessian_factor(o, "categorical")  # noqa: E731
    # One output row per position (a token-level model): the expand form, A = Σ_t a aᵀ / T.
    kfac_sums(lambda: (q(x) + v(x) + w(x)).reshape(20, 2), layers, factor, a, g)
    with_ones = torch.cat([x, torch.ones(4, 5, 1, dtype=torch.float64)], -1)
    for got, inp in zip(a, [with_ones, x, with_ones]):
        flat = inp.reshape(-1, inp.shape[-1])
        assert_close(got, flat.T @ flat / 5, rtol=1e-12, atol=1e-30)


def test_kfac_reduce_form_of_a_pooled_sequence():
    """One output row per sequence (positions summed): the reduce form of Eschenhagen et al.
    Every position gets the same output gradient L_n, so each position's weight is 1/T: A is
    Σ_n ā āᵀ of the positions' mean input and G is Σ_n (T L_n)(T L_n)ᵀ."""
    from pyro_bdl.curvature.kfac import KronLayer, kfac_sums

    torch.manual_seed(0)
    q = nn.Linear(3, 2).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    a = [torch.zeros(4, 4, dtype=torch.float64)]
    g = [torch.zeros(2, 2, dtype=torch.float64)]
    factor = lambda o: output_hessian_factor(o, "categorical")  # noqa: E731
    out = kfac_sums(lambda: q(x).sum(1), [KronLayer(q, "linear", True)], factor, a, g)
    mean = torch.cat([x, torch.ones(4, 5, 1, dtype=torch.float64)], -1).mean(1)
    assert_close(a[0], mean.T @ mean, rtol=1e-12, atol=1e-14)
    root = 5 * factor(out)[..., 0]
    assert_close(g[0], root.T @ root, rtol=1e-12, atol=1e-14)
    # Read at the first position only (a [CLS] pooler): the weights pick that position's input,
    # where the paper's plain mean over positions would average in four inputs of no influence.
    a[0].zero_(), g[0].zero_()
    out = kfac_sums(lambda: q(x)[:, 0], [KronLayer(q, "linear", True)], factor, a, g)
    first = torch.cat([x[:, 0], torch.ones(4, 1, dtype=torch.float64)], -1)
    assert_close(a[0], first.T @ first, rtol=1e-12, atol=1e-14)
    root = factor(out)[..., 0]
    assert_close(g[0], root.T @ root, rtol=1e-12, atol=1e-14)


def test_kfac_reduce_form_gives_an_example_without_curvature_its_mean_input():
    """An example whose output does not depend on the layer (masked out) has no gradient at the
    layer output (m = 0): it keeps one unit of weight in A with the positions' mean input, as
    under the expand form, and adds nothing to G."""
    from pyro_bdl.curvature.kfac import KronLayer, kfac_sums

    torch.manual_seed(0)
    q = nn.Linear(3, 2).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    a = [torch.zeros(4, 4, dtype=torch.float64)]
    g = [torch.zeros(2, 2, dtype=torch.float64)]
    factor = lambda o: output_hessian_factor(o, "categorical")  # noqa: E731
    forward = lambda: q(x).sum(1) * mask[:, None]  # noqa: E731
    out = kfac_sums(forward, [KronLayer(q, "linear", True)], factor, a, g)
    mean = torch.cat([x, torch.ones(4, 5, 1, dtype=torch.float64)], -1).mean(1)
    assert_close(a[0], mean.T @ mean, rtol=1e-12, atol=1e-14)
    root = 5 * factor(out)[..., 0] * mask[:, None]
    assert_close(g[0], root.T @ root, rtol=1e-12, atol=1e-14)


def test_exact_turns_autocast_off_and_does_nothing_where_autocast_is_unknown():
    from pyro_bdl.curvature.jacobian import exact

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with exact(torch.device("cpu")):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    with exact(torch.device("meta")):  # torch.autocast("meta") itself raises
        assert torch.ones(2, device="meta").sum().device.type == "meta"
