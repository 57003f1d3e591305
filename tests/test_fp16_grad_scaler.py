r"""float16 autocast with torch's ``GradScaler``, on the CPU, for every SVI-trained method: the
recipe of docs/methods/precision.md ("float16 with GradScaler").

``SVI.step`` runs the backward pass itself, so the recipe takes the loss from the ELBO
(``elbo.differentiable_loss``), scales it with ``torch.amp.GradScaler`` and steps a torch
optimizer over the param store's tensors. ``torch.autocast("cpu", dtype=torch.float16)`` and
``GradScaler("cpu")`` behave on the CPU as on CUDA, so the recipe is tested here on every run.

Tolerance. float16 keeps 11 significant bits: one rounding changes a number by a relative
u = 2⁻¹¹ at most (round to nearest gives u/2; u covers the worst case). The CPU's float16
products accumulate in float32 and round once, at the end. Per step on the conv-ReLU-linear net
below: forward, the convolution (x, W₁, output: 3 roundings), ReLU (exact: it only zeroes), the
linear layer (W₂, output: 2); backward, the gradient into the linear output (1), the products
for ∂W₂ and ∂h (2), ReLU's mask (exact), the convolution's product for ∂W₁ (1): 9 roundings,
taken as R = 16 with room for the bias adds. Scaling by a power of two and unscaling are exact
(no overflow, and no scaled gradient near float16's smallest normal number). So each
per-example term of a gradient is off by a relative R·u at most. A gradient sums B = 8 such
terms, and the bound holds against the sum of their sizes, not against the sum itself: terms of
random sign (p − y, one example per term) add up to about √B times one term while their errors
add up to at most B times R·u of one: relative to the gradient, R·u·√B = 45u ≈ 0.022. SGD with
momentum (a linear filter of the gradients) moves the weights by a sum of learning rate ×
gradient, so the movement over a few steps is off by the same relative R·u·√B (the gradients
are evaluated at points that differ by that much of a few small steps: second order). The
likelihood runs in float32 (the model upcasts the network's output), the KL and the guide in
float32, so they add nothing (the streaming KL's sums over its M samples too: they run with
autocast off). Measured: 1u for the mean-field and Radial
guides (the float32 KL moves their scales), 22u for the point estimates.

Loss scale. The minibatch ELBO multiplies the data term by N/B (the data plate), which acts as
a loss scale of its own: the gradients that pass through float16 are large. The largest is a
weight gradient of the last layers, a sum over the batch of per-example terms each scaled by
N/B: for the last bias Σ_b (N/B)(p_b − y_b), at most N in size; for a weight that times the
activations entering it (about 0.2 N on this net, measured). ``init_scale = 2^⌊log₂(65504 / (8
N))⌋`` keeps it below float16's largest number 65504 with an 8-fold margin (64 for N = 100).
GradScaler's default, 2¹⁶, makes the first steps overflow; each is skipped and halves the
scale, so with the largest gradient at most N, at most ⌈log₂(2¹⁶ · N / 65504)⌉ steps are skipped
(7 for N = 100; 5 here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from torch import nn
from torch.overrides import TorchFunctionMode

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoEnsemble, AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.infer import TraceSuffStat_ELBO
from tests.common import assert_close, assert_float32_or_wider, assert_moved_alike

#: float16's unit round-off (11 significant bits) and its largest finite number.
U, FP16_MAX = 2.0**-11, 65504.0
N, B, STEPS = 100, 8, 3
#: Relative error of the movement of the weights, derived in the module docstring.
RELATIVE = 16 * U * math.sqrt(B)
#: The rule of the module docstring: a power of two at most 65504 / (8 N) (64 for N = 100).
SAFE_SCALE = 2.0 ** math.floor(math.log2(FP16_MAX / (8 * N)))
#: GradScaler's default initial scale, which overflows on the first steps here.
DEFAULT_SCALE = 2.0**16


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    return list(zip(x.split(B), y.split(B), strict=True))


BATCHES = _batches()


PRIORS: dict[str, Callable[[], priors.Prior]] = {
    "Normal": lambda: priors.Normal(scale=1.0),
    "Laplace": lambda: priors.Laplace(scale=1.0),
    "ScaleMixtureNormal": priors.ScaleMixtureNormal,
}


def _model(seed: int | None = 0, prior: str = "Normal"):
    if seed is not None:  # None: the caller seeds (AutoEnsemble.from_training, seed + k)
        torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    return models.classifier(bayesianize(net, PRIORS[prior]()), N)


class _Float16Ops(TorchFunctionMode):
    """Records the torch functions that return a float16 tensor."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float16:
            self.names.add(getattr(func, "__name__", str(func)))
        return out


#: What may return float16 under the recipe: the network's layers and the view between them
#: (exactly these, on this net). A reduction (a log-density or KL sum), an elementwise op of
#: the likelihood or the guide's sampling here would mean a sum accumulated in float16.
FLOAT16_FUNCTIONS = {"conv2d", "linear", "relu", "flatten"}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        f"{i}/{key}": value
        for i, state in enumerate(optimizer.state.values())
        for key, value in state.items()
    }


def _snapshot(guide: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the guide, copied."""
    return {
        name: t.detach().clone() for name, t in [*guide.named_parameters(), *guide.named_buffers()]
    }


def _assert_bitwise_equal(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"a skipped step changed {changed}"


def _store_parameters() -> list[torch.Tensor]:
    """What the recipe optimizes: the param store's (unconstrained) tensors."""
    return [p for _, p in pyro.get_param_store().named_parameters()]


class _Recipe:
    """The recipe of docs/methods/precision.md, one step at a time."""

    def __init__(self, model, guide, elbo, *, amp: bool, init_scale: float):
        self.model, self.guide, self.elbo, self.amp = model, guide, elbo, amp
        guide(*BATCHES[0])  # the first call creates the guide's parameters
        self.optimizer = torch.optim.SGD(_store_parameters(), lr=1e-3, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=amp)
        self.ops = _Float16Ops()

    def step(self, k: int) -> tuple[float, bool]:
        """One step on batch ``k``: the loss and whether the scaler skipped the step."""
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.amp), self.ops:
            loss = self.elbo.differentiable_loss(self.model, self.guide, *BATCHES[k])
        assert loss.dtype == torch.float32
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        scale = self.scaler.get_scale() if self.amp else 1.0
        self.scaler.step(self.optimizer)  # skipped when a scaled gradient is inf or NaN
        self.scaler.update()
        skipped = self.amp and self.scaler.get_scale() < scale
        assert_float32_or_wider(dict(self.guide.named_parameters()))
        assert_float32_or_wider(dict(self.guide.named_buffers()))
        assert_float32_or_wider(_optimizer_state(self.optimizer))
        return loss.item(), skipped


def _flat(guide: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in guide.parameters()])


# --- the guides trained by SVI: mean-field, Radial, SWAG, the Laplace point phase ---------------

ELBOS: dict[str, Callable[[], Any]] = {
    "Trace_ELBO": Trace_ELBO,
    "TraceSuffStat_ELBO": TraceSuffStat_ELBO,
    # The many-sample Monte Carlo KL (sufficient statistics for the Normal prior), not the
    # closed form.
    "TraceSuffStat_ELBO-mc": lambda: TraceSuffStat_ELBO(kl="mc", num_kl_samples=64),
}

GUIDES: dict[str, Callable[[Callable], nn.Module]] = {
    "AutoMeanField": lambda model: AutoMeanField(model, init_scale=0.05),
    "AutoRadial": lambda model: AutoRadial(model, init_scale=0.05),
    "AutoSWAG": lambda model: AutoSWAG(model, rank=2),
    "AutoSubnetLaplace": lambda model: AutoSubnetLaplace(model, subnetwork="last_layer"),
}


class Case(NamedTuple):
    guide: str
    elbo: str
    prior: str = "Normal"
    #: How TraceSuffStat_ELBO takes every site's KL (``kl_methods``); None for Trace_ELBO.
    kl: str | None = None


CASES = [
    Case("AutoMeanField", "Trace_ELBO"),
    Case("AutoMeanField", "TraceSuffStat_ELBO", kl="exact"),
    Case("AutoMeanField", "TraceSuffStat_ELBO-mc", kl="suffstat_normal"),
    Case("AutoMeanField", "TraceSuffStat_ELBO", "ScaleMixtureNormal", "streaming_scale_mixture"),
    Case("AutoRadial", "Trace_ELBO"),
    Case("AutoRadial", "TraceSuffStat_ELBO", kl="exact"),
    Case("AutoRadial", "TraceSuffStat_ELBO", "Laplace", "streaming_laplace"),
    Case("AutoSWAG", "Trace_ELBO"),
    Case("AutoSubnetLaplace", "Trace_ELBO"),
]
IDS = ["-".join(filter(None, case[:3])) for case in CASES]
LAPLACE_POINT_PHASE = Case("AutoSubnetLaplace", "Trace_ELBO")


def _recipe(case: Case, *, amp: bool, init_scale: float = SAFE_SCALE) -> _Recipe:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _model(prior=case.prior)
    guide = GUIDES[case.guide](model)
    return _Recipe(model, guide, ELBOS[case.elbo](), amp=amp, init_scale=init_scale)


def _train(case: Case, amp: bool):
    run = _recipe(case, amp=amp)
    start = _flat(run.guide).clone()
    losses = []
    for k in range(STEPS):
        loss, skipped = run.step(k)
        assert not skipped, f"step {k} overflowed at init_scale {SAFE_SCALE}"
        losses.append(loss)
        if case.guide == "AutoSWAG":
            run.guide.collect()
    # The case tests the KL it names (each site's, as TraceSuffStat_ELBO chose it).
    assert set(getattr(run.elbo, "kl_methods", {}).values()) == ({case.kl} - {None})
    return run, start, losses


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float16_with_grad_scaler_follows_float32(case):
    fp32, start, losses32 = _train(case, amp=False)
    amp, start_amp, losses16 = _train(case, amp=True)
    assert torch.equal(start, start_amp)
    assert_moved_alike(start, _flat(fp32.guide), _flat(amp.guide), RELATIVE)
    # The loss: a sum of float32 terms whose data part comes through the float16 layers.
    for a, b in zip(losses16, losses32, strict=True):
        assert abs(a - b) <= RELATIVE * abs(b)
    if case.guide == "AutoSWAG":
        # The SWAG mean averages the iterates: its movement is a mean of movements, each within
        # RELATIVE of float32's.
        assert_moved_alike(start, fp32.guide.swag_mean, amp.guide.swag_mean, RELATIVE)


def test_laplace_fit_after_float16_point_phase_matches_float32():
    """Tolerance: the fit runs under the same float16 autocast. Each Jacobian entry of this net
    passes at most 4 float16 roundings (the input cast, the product, the backward product, the
    cast back), so it is off by ≤ 4u relatively, and a GGN entry, a sum of products of two of
    them, by ≤ 8u. The point phase left the weights within RELATIVE of the float32 run's
    movement, which is at most half the weights' size (checked), so the features that form
    the last layer's Jacobian differ by at most RELATIVE / 2 relatively, and the GGN, quadratic
    in them, by RELATIVE. With the prior λ = 1 bounding H below, the variances, entries of H⁻¹,
    inherit the sum: rtol 8u + RELATIVE = 53u ≈ 0.026 (measured: 3.4u)."""
    variances = []
    for amp in (False, True):
        run, start, _ = _train(LAPLACE_POINT_PHASE, amp=amp)
        assert (_flat(run.guide) - start).norm() <= start.norm() / 2
        x = torch.cat([xb for xb, _ in BATCHES])
        y = torch.cat([yb for _, yb in BATCHES])
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            run.guide.fit((x, y), check_mode=False)  # three steps do not reach the mode
        assert_float32_or_wider(dict(run.guide.named_buffers()))
        variances.append(run.guide.posterior.variances())
    fp32, fp16 = variances
    assert fp16.dtype == torch.float64  # the curvature accumulates in float64 by default
    assert_close(fp16, fp32, rtol=8 * U + RELATIVE, atol=0.0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_overflowing_step_is_skipped_and_training_recovers(case):
    run = _recipe(case, amp=True, init_scale=DEFAULT_SCALE)
    before = _snapshot(run.guide)
    loss, skipped = run.step(0)
    assert skipped and math.isfinite(loss)
    assert run.scaler.get_scale() == DEFAULT_SCALE / 2  # backed off
    _assert_bitwise_equal(before, _snapshot(run.guide))
    assert not run.optimizer.state  # the optimizer never stepped: no momentum yet
    _assert_recovers(run, before)


def _assert_recovers(run: _Recipe, before: dict) -> None:
    """Within the number of skipped steps the module docstring bounds, steps go through and the
    parameters move."""
    bound = math.ceil(math.log2(DEFAULT_SCALE * N / FP16_MAX))
    skipped = [run.step(k)[1] for k in range(1, bound + 2)]
    assert not skipped[-1], f"still skipping after {len(skipped) + 1} steps"
    assert 1 + sum(skipped) <= bound
    after = _snapshot(run.guide)
    assert all(torch.isfinite(t).all() for t in after.values())
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nothing_but_the_network_runs_in_float16(case):
    """No log-density, KL sum or sampling step returns float16: only the network's layers."""
    run, _, _ = _train(case, amp=True)
    assert run.ops.names <= FLOAT16_FUNCTIONS, run.ops.names - FLOAT16_FUNCTIONS
    assert run.ops.names  # the layers did run in float16


# --- the ensemble: every member trained by the recipe --------------------------------------------


def _ensemble(amp: bool):
    starts = []

    def train(model):
        run = _Recipe(model, AutoDelta(model), Trace_ELBO(), amp=amp, init_scale=SAFE_SCALE)
        starts.append(_flat(run.guide).clone())
        for k in range(STEPS):
            assert not run.step(k)[1]
        assert run.ops.names <= FLOAT16_FUNCTIONS
        return run.guide

    pyro.clear_param_store()
    guide = AutoEnsemble.from_training(lambda: _model(seed=None), train, num_members=2)
    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
        guide(*BATCHES[0])
    assert_float32_or_wider(dict(guide.named_buffers()))
    return torch.stack(starts), guide.ensemble_locs.detach().clone()


def test_ensemble_members_trained_in_float16_follow_float32():
    start, fp32 = _ensemble(amp=False)
    start_amp, amp = _ensemble(amp=True)
    assert torch.equal(start, start_amp)
    assert_moved_alike(start, fp32, amp, RELATIVE)


def test_an_ensemble_members_overflowing_step_is_skipped():
    model = _model()
    run = _Recipe(model, AutoDelta(model), Trace_ELBO(), amp=True, init_scale=DEFAULT_SCALE)
    before = _snapshot(run.guide)
    assert run.step(0)[1]
    _assert_bitwise_equal(before, _snapshot(run.guide))
    _assert_recovers(run, before)
    AutoEnsemble(model, [run.guide])(*BATCHES[0])  # a finite member the ensemble accepts


# --- what the recipe optimizes -------------------------------------------------------------------


@pytest.mark.parametrize("guide_name", GUIDES)
def test_the_param_store_holds_exactly_the_guides_parameters(guide_name):
    """After the first call, the store's tensors are the guide's own ``parameters()``: the
    recipe may take either; AutoEnsemble has none (its members train as AutoDelta guides)."""
    model = _model()
    guide = GUIDES[guide_name](model)
    guide(*BATCHES[0])
    assert {id(p) for p in _store_parameters()} == {id(p) for p in guide.parameters()}
    ensemble = AutoEnsemble(model, 2)
    ensemble(*BATCHES[0])
    assert not list(ensemble.parameters())


def test_the_param_store_also_holds_the_models_parameters():
    """A model may declare parameters of its own (a regressor's point-estimated noise σ): the
    store has them, ``guide.parameters()`` does not, so the recipe takes the store."""
    net = nn.Linear(3, 1)
    model = models.regressor(bayesianize(net, priors.Normal(scale=1.0)), 10, noise="point")
    guide = AutoMeanField(model)
    guide(torch.randn(4, 3), torch.randn(4))
    store = {id(p) for p in _store_parameters()}
    own = {id(p) for p in guide.parameters()}
    assert own < store and len(store - own) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_recipe_with_cuda_trains_every_guide_on_the_gpu(case):
    """The recipe with "cuda" in both places (``make gpu-check`` runs the gpu-marked tests): no
    step skipped at the rule's scale, finite losses, float32 parameters on the device that
    moved. The numerics are the CPU tests' above (the noise is the device's generator's)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _model(prior=case.prior)
    model.net.cuda()
    guide = GUIDES[case.guide](model)
    batches = [(x.cuda(), y.cuda()) for x, y in BATCHES[:STEPS]]
    guide(*batches[0])
    optimizer = torch.optim.SGD(_store_parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", init_scale=SAFE_SCALE)
    elbo = ELBOS[case.elbo]()
    start = _flat(guide).clone()
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = elbo.differentiable_loss(model, guide, x, y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert bool(torch.isfinite(loss))
    assert scaler.get_scale() == SAFE_SCALE  # no step was skipped
    after = _flat(guide)
    assert after.is_cuda and after.dtype == torch.float32 and not torch.equal(after, start)
    assert_float32_or_wider(dict(guide.named_buffers()))
