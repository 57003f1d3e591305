"""VOGN and IVON with ``grad_scaler=``: float16 autocast with torch's GradScaler, on the CPU
(``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler("cpu")`` behave as on
a GPU). docs/methods/precision.md, pyro_bdl/infer/natural_gradient/loss_scaling.py."""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import pyro
import pytest
import torch
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.distributed import allreduce_mean
from pyro_bdl.infer import IVON, VOGN

METHODS = [VOGN, IVON]
N = 32


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, generator=g)
    return x, (x[:, 0] > 0).long()


def _method(cls, scaler=None, batchnorm: bool = False, reduce_fn=None, dtype=None, **options):
    pyro.clear_param_store()
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(8))
    net = nn.Sequential(*layers).to(dtype)
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), N)
    lr = 0.05 if cls is VOGN else 0.1
    return cls(model, dataset_size=N, lr=lr, grad_scaler=scaler, reduce_fn=reduce_fn, **options)


def _confident_vogn(scaler=None, reduce_fn=None):
    """VOGN on a network whose logits favour class 0 by about 18 (last bias ±9): for y = 0 the
    per-example gradients ∂ℓ/∂logits = p − y are about e⁻¹⁸ ≈ 10⁻⁸, below float16's smallest
    number (6·10⁻⁸); for y = 1 they are about −1, which overflows float16 at S = 2¹⁶."""
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        net[2].bias.copy_(torch.tensor([9.0, -9.0]))
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), N)
    return VOGN(model, dataset_size=N, lr=0.05, grad_scaler=scaler, reduce_fn=reduce_fn)


def _run(method, steps: int, fp16: bool = False, dtype=None):
    """μ after each step (μ₀ first, read after set-up) and the losses."""
    x, y = _data()
    x = x.to(dtype)
    torch.manual_seed(2)
    method.setup(x, y)
    means, losses = [method.state.mean.clone()], []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            losses.append(method.step(x, y))
        means.append(method.state.mean.clone())
    return means, losses


def _steps(method, n: int) -> list[float]:
    """``n`` steps on the whole data set under float16 autocast; their losses."""
    x, y = _data()
    out = []
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.float16):
            out.append(method.step(x, y))
    return out


def _snapshot(method) -> dict[str, torch.Tensor]:
    state = method.state
    out = {"mean": state.mean, "momentum": state.momentum, "curvature": state.curvature}
    out |= {"scale": method.guide.scale, "rng": torch.get_rng_state()}
    out |= {f"buffer{i}": b for i, b in enumerate(method.guide.model.net.buffers())}
    return {k: v.clone() for k, v in out.items()}


CONFIGURATIONS = {
    "plain": {},
    "particles": {"num_particles": 3},
    "float64": {"dtype": torch.float64},
    "batchnorm": {"batchnorm": True},  # hidden parameters: their ĝ (and VOGN's ĥ) unscaled too
    "clip": {"clip_radius": 1e-3},  # IVON's only
}


@pytest.mark.parametrize(
    ("cls", "config"),
    [(cls, c) for cls in METHODS for c in CONFIGURATIONS if c != "clip" or cls is IVON],
)
def test_a_scaled_step_equals_the_unscaled_one_bit_for_bit(cls, config):
    # Scaling by a power of two is exact in floating point (absent overflow and underflow, which
    # float32 does not reach here): the backward pass's every product and sum is the unscaled
    # one times S, and the division by S (S² for VOGN's squares) undoes it exactly. The scale
    # grows every second step, so several values of S are used.
    options = CONFIGURATIONS[config]
    plain, _ = _run(_method(cls, **options), steps=5, dtype=options.get("dtype"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    method = _method(cls, scaler, **options)
    scaled, _ = _run(method, steps=5, dtype=options.get("dtype"))
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))
    assert method.skipped_steps == 0 and scaler.get_scale() == 2.0**12


@pytest.mark.parametrize("cls", METHODS)
def test_float16_autocast_with_a_scaler_follows_the_float32_run(cls):
    means32, losses32 = _run(_method(cls), steps=3)
    method = _method(cls, torch.amp.GradScaler("cpu", init_scale=2.0**8))
    means16, losses16 = _run(method, steps=3, fp16=True)
    assert method.skipped_steps == 0
    state = method.state
    for t in (state.mean, state.momentum, state.curvature, *method.estimates, method.guide.scale):
        assert t.dtype == torch.float32  # no accumulator in float16
    # float16 keeps 11 significant bits: u = 2⁻¹¹. As for bf16 (tests/infer/test_ivon.py), each
    # of the two layers rounds its input and output (≈ 3u on its output and on the gradient
    # back through it): ĝ and ĥ ≈ 6u relative, a step ≈ 12u; summed over the steps, with a
    # factor 2 for errors fed forward into later gradients. The scale (2⁸) keeps every gradient
    # inside float16's normal range, so it adds no underflow.
    u = 2.0**-11
    path = sum(float((b - a).norm()) for a, b in itertools.pairwise(means32))
    assert float((means16[-1] - means32[-1]).norm()) <= 2 * 12 * u * path
    for lo, hi in zip(losses16, losses32):
        assert abs(lo - hi) <= 2 * 6 * u * abs(hi)


@pytest.mark.parametrize("cls", METHODS)
def test_an_overflowing_step_is_skipped_changes_nothing_and_the_scale_backs_off(cls):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    method = _method(cls, scaler, batchnorm=True)
    _run(method, steps=2, fp16=True)
    # ∂loss/∂logits is about (p − y)/B per example; at S = 2³⁰ the float16 gradient overflows
    # (its largest finite value is 65504).
    scaler.update(new_scale=2.0**30)
    before, step = _snapshot(method), method.step_count
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = method.step(x, y)
    assert torch.isfinite(torch.tensor(loss))
    assert method.skipped_steps == 1 and method.step_count == step
    after = _snapshot(method)
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])
    ]
    assert scaler.get_scale() == 2.0**29  # GradScaler's backoff factor 0.5
    # It backs off until the gradients fit, then trains.
    for _ in range(40):
        with torch.autocast("cpu", dtype=torch.float16):
            method.step(x, y)
        if method.step_count > step:
            break
    assert method.step_count == step + 1 and not torch.equal(method.state.mean, before["mean"])


@pytest.mark.parametrize("cls", METHODS)
def test_an_overflowing_first_step_is_skipped_and_the_next_one_sets_up(cls):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    method = _method(cls, scaler)
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.float16):
        method.step(x, y)
    assert method.skipped_steps == 1 and method.needs_setup  # as a refused first step
    while method.needs_setup:
        with torch.autocast("cpu", dtype=torch.float16):
            method.step(x, y)
    assert method.step_count == 1 and scaler.get_scale() < 2.0**30


@pytest.mark.parametrize("cls", METHODS)
def test_a_refused_step_keeps_the_scale_and_the_next_step_runs(cls):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    method = _method(cls, scaler)
    _run(method, steps=1, fp16=True)
    scale, step = scaler.get_scale(), method.step_count
    x, y = _data()
    # A refusal after the estimates were unscaled: the update's state check.
    method.optimizer.param_groups[0]["lr"] = float("inf")
    with pytest.raises((ValueError, FloatingPointError)):
        with torch.autocast("cpu", dtype=torch.float16):
            method.step(x, y)
    assert scaler.get_scale() == scale and method.step_count == step
    method.optimizer.param_groups[0]["lr"] = 0.05
    with torch.autocast("cpu", dtype=torch.float16):
        method.step(x, y)  # GradScaler would raise here had the refused step left it unscaled
    assert method.step_count == step + 1 and scaler.get_scale() == 2 * scale


def test_a_skip_seen_through_reduce_fn_is_skipped_not_refused():
    # Under loss scaling a rank whose scaled gradients overflow passes inf through the
    # reduction, so every rank sees the non-finite mean and skips the same step.
    hit = {"overflow": False}

    def reduce_fn(tensors):
        if hit["overflow"]:
            tensors[0][0] = float("inf")

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    method = _method(IVON, scaler, reduce_fn=reduce_fn)
    _run(method, steps=1)
    hit["overflow"] = True
    mean = method.state.mean.clone()
    method.step(*_data())
    assert method.skipped_steps == 1 and torch.equal(method.state.mean, mean)
    assert scaler.get_scale() == 2.0**7


@pytest.mark.parametrize("cls", METHODS)
def test_grad_scaler_must_be_a_grad_scaler_and_a_disabled_one_scales_nothing(cls):
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch\.amp\.GradScaler"):
        _method(cls, scaler=2.0**16)
    with pytest.raises(TypeError, match=r"got the class GradScaler itself, not an instance"):
        _method(cls, scaler=torch.amp.GradScaler)
    disabled = _method(cls, torch.amp.GradScaler("cpu", enabled=False))
    assert disabled._scaling is None and disabled.skipped_steps == 0


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_a_method_with_a_scaler_copies_between_steps_and_trains_on(copier):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    method = _method(IVON, scaler)
    _run(method, steps=2, fp16=True)
    twin = copier(method)
    x, y = _data()
    for m in (method, twin):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.float16):
            m.step(x, y)
    assert torch.equal(method.state.mean, twin.state.mean) and twin.step_count == 3


@pytest.mark.gpu
@pytest.mark.parametrize("cls", METHODS)
def test_float16_with_a_cuda_grad_scaler_steps_on_the_gpu(cls):
    """The GPU form (``make gpu-check`` runs the gpu-marked tests): float16 autocast on CUDA
    with ``GradScaler("cuda")`` keeps a float32 state on the device, skips no step at S = 2⁸,
    and moves μ to finite values (the numerics are the CPU tests' above: the noise here is the
    device's generator's, so there is no weight-by-weight comparison)."""
    x, y = _data()
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    method = _method(cls, scaler)
    method.guide.model.net.cuda()
    x, y = x.cuda(), y.cuda()
    method.setup(x, y)
    start = method.state.mean.clone()
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.float16):
            method.step(x, y)
    mean = method.state.mean
    assert mean.dtype == torch.float32 and mean.is_cuda and method.step_count == 5
    assert method.skipped_steps == 0 and scaler.get_scale() == 2.0**8
    assert bool(torch.isfinite(mean).all()) and not torch.equal(mean, start)


@pytest.mark.gpu
def test_vogn_skips_an_overflowing_set_up_pass_on_the_gpu():
    """The GPU form of the set-up overflow: the scaler records it through a placeholder
    gradient of inf on the loss's device (``make gpu-check`` runs the gpu-marked tests)."""
    x, _ = _data()
    x, y = x.cuda(), torch.ones(N, dtype=torch.long, device="cuda")
    scaler = torch.amp.GradScaler("cuda")
    method = _confident_vogn(scaler)
    method.guide.model.net.cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        assert math.isnan(method.step(x, y))
    assert method.needs_setup and method.skipped_steps == 1 and scaler.get_scale() == 2.0**15
    with torch.autocast("cuda", dtype=torch.float16):
        assert math.isfinite(method.step(x, y))
    assert method.step_count == 1 and method.state.mean.is_cuda


class _NaNGradient(nn.Module):
    """Once ``broken``, a finite loss whose gradient is NaN (√ at 0): a model defect, which no
    loss scale can cure."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.broken = False

    def forward(self, x):
        out = self.layer(x)
        return torch.sqrt(out * 0.0) if self.broken else out


@pytest.mark.parametrize("cls", METHODS)
def test_a_non_finite_gradient_below_scale_one_is_refused_not_skipped_forever(cls):
    # Without a scaler the step is refused naming the weight; with one, each non-finite step was
    # skipped and S halved, so the run stalled silently (S → 0, never a step). Below S = 1 the
    # scale shrinks the gradients instead of enlarging them: a non-finite estimate there is no
    # overflow of the scaled loss, and the step is refused as without a scaler.
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = _NaNGradient()
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), N)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    method = cls(model, dataset_size=N, lr=0.05, grad_scaler=scaler)
    x, y = _data()
    method.step(x, y)
    net.broken = True
    for _ in range(3):  # S = 4, 2, 1: skipped, as overflows
        assert math.isfinite(method.step(x, y))
    assert method.skipped_steps == 3 and scaler.get_scale() == 0.5
    with pytest.raises(ValueError, match=r"not finite[\s\S]*grad_scaler's scale is 0\.5"):
        method.step(x, y)
    assert method.skipped_steps == 3 and scaler.get_scale() == 0.5 and method.step_count == 1


def test_one_scaler_shared_with_a_torch_optimizer_in_the_documented_order():
    # docs/methods/precision.md: the method's step ends with scaler.update(); another optimizer
    # on the same scaler scales, steps and updates after it. An overflow of that optimizer's
    # gradients then backs off the scale the method uses next, and a refused method step
    # leaves the scaler ready for the optimizer.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    method = _method(IVON, scaler)
    head = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([head], lr=0.1)
    x, y = _data()

    def head_step(factor: float) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (head * factor).sum()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for factor in (1.0, math.inf):  # a finite step, then an overflowing one
        with torch.autocast("cpu", dtype=torch.float16):
            method.step(x, y)
        head_step(factor)
    assert method.step_count == 2 and scaler.get_scale() == 2.0**7
    assert torch.equal(head.detach(), torch.full((3,), 0.9))  # the second step was skipped
    with pytest.raises(ValueError, match="non-finite"):
        method.step(torch.full_like(x, math.nan), y)
    head_step(1.0)
    with torch.autocast("cpu", dtype=torch.float16):
        method.step(x, y)
    assert method.step_count == 3 and method.skipped_steps == 0
    # The other order is what the docs warn against: the method's step updated the scaler
    # already, so an update of one's own finds nothing recorded.
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.update()


@pytest.mark.parametrize("cls", METHODS)
def test_resuming_from_the_method_and_scaler_state_dicts_is_bit_identical(cls):
    # docs/methods/precision.md: save method.state_dict() and scaler.state_dict() (with the
    # network's buffers and the RNG); restoring both into fresh objects continues the run bit
    # for bit, scale, growth count and skipped steps included.
    x, y = _data()

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)
    method = _method(cls, scaler, batchnorm=True)
    torch.manual_seed(2)
    _steps(method, 4)
    net = method.guide.model.net
    saved = copy.deepcopy((method.state_dict(), scaler.state_dict(), net.state_dict()))
    rng, skipped = torch.get_rng_state(), method.skipped_steps
    losses = _steps(method, 6)
    resumed_scaler = torch.amp.GradScaler("cpu")
    resumed = _method(cls, resumed_scaler, batchnorm=True)
    resumed.setup(x, y)
    resumed.load_state_dict(saved[0])
    resumed_scaler.load_state_dict(saved[1])
    resumed.guide.model.net.load_state_dict(saved[2])
    torch.set_rng_state(rng)
    assert _steps(resumed, 6) == losses
    assert torch.equal(resumed.state.mean, method.state.mean)
    assert resumed_scaler.state_dict() == scaler.state_dict()
    assert resumed.skipped_steps == method.skipped_steps - skipped  # each counts its own


@pytest.mark.parametrize("cls", METHODS)
def test_save_checkpoint_takes_the_scaler_as_a_module_and_resumes_bit_for_bit(cls, tmp_path):
    x, y = _data()

    def parts(method, scaler):
        return {"method": method, "scaler": scaler, "net": method.guide.model.net}

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)
    method = _method(cls, scaler, batchnorm=True)
    torch.manual_seed(2)
    _steps(method, 4)
    save_checkpoint(tmp_path / "run.ckpt", modules=parts(method, scaler), step=4)
    losses = _steps(method, 6)
    resumed_scaler = torch.amp.GradScaler("cpu")
    resumed = _method(cls, resumed_scaler, batchnorm=True)
    modules = parts(resumed, resumed_scaler)
    assert load_checkpoint(tmp_path / "run.ckpt", modules=modules, example_args=(x, y))["step"] == 4
    assert _steps(resumed, 6) == losses and torch.equal(resumed.state.mean, method.state.mean)
    assert resumed_scaler.state_dict() == scaler.state_dict()


class _Poisoned:
    """``allreduce_mean()`` with an inf written into rank 1's ĝ at its ``at``-th call: one
    rank's overflow."""

    def __init__(self, rank: int, at: int):
        self.inner, self.rank, self.at, self.calls = allreduce_mean(), rank, at, 0

    def __call__(self, tensors):
        self.calls += 1
        if self.rank == 1 and self.calls == self.at:
            tensors[0].view(-1)[0] = math.inf
        return self.inner(tensors)

    def refuse(self, error: BaseException) -> None:
        self.inner.refuse(error)


def _phase_one_rank_overflows(rank: int) -> dict:
    x, y = _data()
    part = slice(rank * N // 2, (rank + 1) * N // 2)
    out = {}
    for cls, at in ((IVON, 3), (VOGN, 4)):  # VOGN's first call averages the first curvature
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        method = _method(cls, scaler, reduce_fn=_Poisoned(rank, at))
        pyro.set_rng_seed(7)  # shared weight noise
        losses = []
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                losses.append(method.step(x[part], y[part]))
        out[cls.name] = {
            "mean": method.state.mean.clone(),
            "steps": method.step_count,
            "skipped": method.skipped_steps,
            "scale": scaler.get_scale(),
        }
    # VOGN's set-up pass overflows on rank 1 only (y = 1 there: gradients ≈ −2¹⁶ in float16),
    # before the first reduction, which averages the first curvature and so spreads it.
    scaler = torch.amp.GradScaler("cpu")
    method = _confident_vogn(scaler, reduce_fn=allreduce_mean())
    y = torch.full((N // 2,), rank, dtype=torch.long)
    losses = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            losses.append(method.step(x[part], y))
    out["set-up"] = {"losses": losses, "steps": method.step_count, "scale": scaler.get_scale()}
    out["set-up"]["mean"] = method.state.mean.clone()
    return out


@pytest.mark.distributed
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    from tests.distributed.test_data_parallel import spawn_phases

    ranks = [r["skip"] for r in spawn_phases(tmp_path, {"skip": _phase_one_rank_overflows})]
    for name in ("IVON", "VOGN"):
        a, b = ranks[0][name], ranks[1][name]
        assert a["steps"] == b["steps"] == 4 and a["skipped"] == b["skipped"] == 1, name
        assert a["scale"] == b["scale"] == 2.0**7, name
        assert torch.equal(a["mean"], b["mean"]), name
    a, b = ranks[0]["set-up"], ranks[1]["set-up"]
    assert math.isnan(a["losses"][0]) and math.isnan(b["losses"][0])
    assert a["steps"] == b["steps"] == 1 and a["scale"] == b["scale"] == 2.0**15
    assert torch.equal(a["mean"], b["mean"])


def test_vogn_scales_its_set_up_pass_so_its_first_curvature_does_not_underflow():
    # The set-up pass (s at w = μ) ran unscaled under float16 autocast: per-example gradients
    # of 10⁻⁸ flushed to zero (every first-layer s was 0 here) while every later pass was
    # scaled. Scaled by S = 2¹⁶ they are ≈ 10⁻³, normal float16 numbers (11 significant bits).
    x, _ = _data()
    y = torch.zeros(N, dtype=torch.long)
    plain = _confident_vogn()
    plain.setup(x, y)
    method = _confident_vogn(torch.amp.GradScaler("cpu"))
    with torch.autocast("cpu", dtype=torch.float16):
        method.setup(x, y)
    ref, got = plain.state.curvature, method.state.curvature
    seen = ref != 0  # float32 rounds p₀ = 1 − 10⁻⁸ to 1: that bias's gradient is exactly 0
    # Each s sums (p − y)² times squared activations: the float16 logits (about ±9, rounded to
    # 2⁻⁷) give e^{−Δ} within 2·2⁻⁸ ≈ 0.8%, its square within 1.6%, and the float16 rounding
    # of the scaled gradient and of the activations adds a few u = 2⁻¹¹: 3% bounds it.
    assert bool(seen.any()) and bool((got[~seen] == 0).all())
    assert float(((got - ref).abs()[seen] / ref[seen]).max()) <= 0.03


def test_vogn_skips_a_first_step_whose_set_up_pass_overflows():
    # For y = 1 the set-up pass's gradients are ≈ −1: −2¹⁶ overflows float16 (largest 65504).
    # The first step is skipped like any overflowing one (nothing set up, S backs off, the loss
    # NaN: there is no σ yet); the next sets up at S = 2¹⁵. setup() itself cannot skip: it
    # refuses, naming the scale, and changes nothing.
    x, _ = _data()
    y = torch.ones(N, dtype=torch.long)
    scaler = torch.amp.GradScaler("cpu")
    method = _confident_vogn(scaler)
    with pytest.raises(ValueError, match=r"grad_scaler's scale S = 65536\.0 too large"):
        with torch.autocast("cpu", dtype=torch.float16):
            method.setup(x, y)
    assert method.needs_setup and scaler.get_scale() == 2.0**16
    with torch.autocast("cpu", dtype=torch.float16):
        loss = method.step(x, y)
    assert math.isnan(loss) and method.needs_setup and method.skipped_steps == 1
    assert scaler.get_scale() == 2.0**15
    with torch.autocast("cpu", dtype=torch.float16):
        assert math.isfinite(method.step(x, y))
    assert method.step_count == 1 and method.skipped_steps == 1


@pytest.mark.parametrize("cls", METHODS)
def test_a_method_moved_between_steps_unscales_its_new_estimates(cls):
    # .to() allocates new estimate buffers: the placeholder optimizer must follow them, or the
    # scaler would unscale the old ones and the step read unscaled (S times too large) values.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    method = _method(cls, scaler)
    _run(method, steps=2, fp16=True)
    method.to(torch.float64)
    twin = copy.deepcopy(method)
    twin._scaling = None  # the same run without a scaler
    x, y = _data()
    for m, fp16 in ((method, True), (twin, False)):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            m.step(x.double(), y)
    # float64 layers do not autocast: the scaled float64 step equals the unscaled one.
    assert method.estimates[0].dtype == torch.float64 and method.skipped_steps == 0
    assert torch.equal(method.state.mean, twin.state.mean)


def test_vogn_refuses_a_non_finite_first_curvature_below_scale_one():
    # The set-up pass's NaN gradient is skipped as an overflow while S ≥ 1, then refused.
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = _NaNGradient()
    net.broken = True
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), N)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    method = VOGN(model, dataset_size=N, lr=0.05, grad_scaler=scaler)
    x, y = _data()
    for _ in range(2):  # S = 2, 1
        assert math.isnan(method.step(x, y))
    with pytest.raises(ValueError, match=r"first curvature[\s\S]*scale is 0\.5 \(below 1"):
        method.step(x, y)
    assert method.needs_setup and method.skipped_steps == 2 and scaler.get_scale() == 0.5
