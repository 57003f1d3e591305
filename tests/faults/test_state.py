"""Class 1 of the fault suite: a refused training step changes nothing.

Every case builds a VOGN (or SVI with TraceSuffStat_ELBO) over a small digits-sized network with
BatchNorm, takes a :func:`snapshot` (parameters, buffers with BatchNorm's running statistics and
``num_batches_tracked``, gradients, VOGN's state, the optimizer's state, the param store, the
torch/python/numpy random states), triggers a refusal, checks the error's type and message, and
checks that the snapshot is unchanged. A refused step restores the random state, so a retry with
good data reproduces the uninterrupted run bit for bit; that is tested too.
"""

from __future__ import annotations

import copy

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoMeanField
from pyro_bdl.infer import VOGN, TraceSuffStat_ELBO
from tests.faults.common import assert_same, rng_states

N, FEATURES, CLASSES, B = 200, 64, 10, 16  # load_digits: 8x8 images, 10 classes
NAN, INF = float("nan"), float("inf")


# --- the objects ---------------------------------------------------------------------------


def lifted_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES)
    )
    return bayesianize(net, priors.Normal(scale=1.0))


def hand_model(net: nn.Module, fail: dict | None = None):
    """A hand-written model without the input checks of ``models``: bad data reaches the network
    (and BatchNorm) before anything refuses it. ``fail["calls"]`` counts down to a raise."""

    def model(x, y=None):
        if fail is not None and fail.get("calls") is not None:
            fail["calls"] -= 1
            if fail["calls"] < 0:
                raise RuntimeError("injected failure in the model")
        logits = net(x)
        with pyro.plate("data", N, subsample=torch.arange(len(logits))):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y)
        return logits

    return model


def batch(i: int, n: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def nan_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(99)
    x[3, 5] = NAN
    return x, y


def overflow_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Finite inputs (so ``models``' checks pass) whose activations overflow float32."""
    x, y = batch(98)
    return x * 1e30, y


def trained_vogn(model, steps: int, **options) -> VOGN:
    vogn = VOGN(model, dataset_size=N, lr=1e-2, **options)
    for i in range(steps):
        vogn.step(*batch(i))
    return vogn


# --- snapshot: everything a step could change ----------------------------------------------


def _vogn_state(vogn: VOGN) -> dict:
    out: dict = {
        "temperature": vogn.temperature,
        "optimizer": copy.deepcopy(vogn.optimizer.state_dict()),
        "needs_setup": vogn.needs_setup,
        "pending": copy.deepcopy(vogn._pending),
        "scale_temperature": vogn._scale_temperature,
        "guide": {k: v.clone() for k, v in vogn.guide.state_dict().items()},
    }
    if vogn.state is not None:
        s = vogn.state
        out["state"] = {
            "step": s.step,
            "tensors": [t.detach().clone() for t in (s.mean, s.momentum, s.curvature)],
            "hidden": [t.detach().clone() for t in s.hidden],
            "hidden_m": [t.clone() for t in s.hidden_momentum],
            "hidden_s": [t.clone() for t in s.hidden_curvature],
        }
    return out


def snapshot(*objects) -> dict:
    """State dicts (parameters and every buffer), gradients, VOGN's state, optimizer state, the
    param store and the torch, python and numpy random states."""
    out: dict = {
        "rng": rng_states(),
        "param_store": {
            k: (v.detach().clone(), None if v.grad is None else v.grad.clone())
            for k, v in pyro.get_param_store().named_parameters()
        },
    }
    for i, obj in enumerate(objects):
        if isinstance(obj, VOGN):
            out[f"{i}:vogn"] = _vogn_state(obj)
        elif isinstance(obj, nn.Module):
            out[f"{i}:state_dict"] = {k: v.detach().clone() for k, v in obj.state_dict().items()}
            out[f"{i}:grads"] = {
                k: None if p.grad is None else p.grad.clone() for k, p in obj.named_parameters()
            }
        elif isinstance(obj, pyro.optim.PyroOptim):
            out[f"{i}:pyro_optim"] = copy.deepcopy(obj.get_state())
        else:
            raise TypeError(f"snapshot: unsupported {type(obj).__name__}")
    return out


def assert_eval_predictions_finite(net: nn.Module) -> None:
    net.eval()
    with torch.no_grad():
        assert bool(torch.isfinite(net(batch(7)[0])).all()), "eval predictions are not finite"
    net.train()


# --- VOGN: the known case, a NaN or overflowing batch ---------------------------------------


@pytest.mark.parametrize("at_step", [1, 3])
@pytest.mark.parametrize(
    "kind, make, error",
    [
        # The step checks its inputs before the model runs (Pyro's own validation would name the
        # NaN logits instead, after BatchNorm has run).
        ("hand", nan_batch, r"the argument args\[0\] contains 1 non-finite value"),
        # BatchNorm normalises the overflowing activations (the loss stays finite) but their
        # running variance and the squared gradients overflow.
        ("hand", overflow_batch, r"gradient of the likelihood for weights \(ĥ\) is not finite"),
        ("classifier", nan_batch, r"the argument args\[0\] contains 1 non-finite value"),
        ("classifier", overflow_batch, r"gradient of the likelihood for weights \(ĥ\) is not"),
    ],
)
def test_vogn_refuses_a_non_finite_batch_and_changes_nothing(kind, make, error, at_step):
    pyro.clear_param_store()
    net = lifted_net()
    model = hand_model(net) if kind == "hand" else models.classifier(net, N)
    vogn = trained_vogn(model, at_step - 1)
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match=error) as info:
        vogn.step(*make())
    assert_same(before, snapshot(vogn, net))
    assert vogn.needs_setup == (at_step == 1)
    if at_step > 1 and "argument" in error:
        assert f"VOGN step {at_step}: " in str(info.value)
        assert "Nothing was updated" in str(info.value)
    assert_eval_predictions_finite(net)  # the symptom: NaN running statistics


@pytest.mark.parametrize("at_step", [1, 3])
def test_vogn_own_input_check_names_the_step_and_argument(at_step):
    # Our check, independent of Pyro's validation switch; it comes before the model runs (the
    # check of each site's likelihood: tests/infer/test_vogn.py).
    net = lifted_net()
    vogn = trained_vogn(hand_model(net), at_step - 1)
    before = snapshot(vogn, net)
    with (
        pyro.validation_enabled(False),
        pytest.raises(
            ValueError,
            match=rf"VOGN step {at_step}: the argument args\[0\] contains 1 non-finite value",
        ),
    ):
        vogn.step(*nan_batch())
    assert_same(before, snapshot(vogn, net))


@pytest.mark.parametrize("at_step", [1, 3])
def test_a_retry_after_a_refused_step_reproduces_the_uninterrupted_run(at_step):
    # The refused step restores torch's random state: a retry draws the weight sample the
    # uninterrupted run drew, so both runs end bit for bit equal (state, BatchNorm, RNG).
    def run(refuse: bool):
        pyro.set_rng_seed(0)
        net = lifted_net()
        vogn = VOGN(hand_model(net), dataset_size=N, lr=1e-2)
        for i in range(4):
            if refuse and i == at_step - 1:
                with pytest.raises(ValueError):
                    vogn.step(*nan_batch())
            vogn.step(*batch(i))
        return snapshot(vogn, net)

    assert_same(run(refuse=False), run(refuse=True))


def test_setup_and_evaluate_loss_refuse_a_nan_batch_and_change_nothing():
    net = lifted_net()
    vogn = VOGN(hand_model(net), dataset_size=N)
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match="Expected parameter logits"):
        vogn.setup(*nan_batch())
    assert_same(before, snapshot(vogn, net))
    vogn.step(*batch(0))
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match="Expected parameter logits"):
        vogn.evaluate_loss(*nan_batch())
    assert_same(before, snapshot(vogn, net))


def test_a_refused_first_step_keeps_a_pending_checkpoint():
    source = trained_vogn(hand_model(lifted_net()), 2)
    state = source.state_dict()
    net = lifted_net()
    vogn = VOGN(hand_model(net), dataset_size=N, lr=1e-2)
    vogn.load_state_dict(state)
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match=r"the argument args\[0\] contains 1 non-finite"):
        vogn.step(*nan_batch())
    assert_same(before, snapshot(vogn, net))
    vogn.step(*batch(5))  # the checkpoint is applied now, as without the refusal
    assert vogn.step_count == 3


# --- VOGN: non-finite gradient and loss terms -----------------------------------------------


@pytest.mark.parametrize(
    "index, name",
    [
        (0, r"weights \(ĝ\)"),
        (1, r"weights \(ĥ\)"),
        (2, r"1\.weight \(hidden\) \(ĝ\)"),
        (5, r"1\.bias \(hidden\) \(ĥ\)"),
    ],
)
def test_a_non_finite_gradient_is_refused_naming_the_step_and_tensor(index, name):
    # reduce_fn receives [ĝ, ĥ, ĝ of 1.weight, ĝ of 1.bias, ĥ of 1.weight, ĥ of 1.bias]; a NaN
    # written there stands for one arriving from another rank.
    poison = {"on": False}

    def reduce_fn(tensors):
        if poison["on"]:
            tensors[index].view(-1)[0] = NAN

    net = lifted_net()
    vogn = trained_vogn(hand_model(net), 2, reduce_fn=reduce_fn)
    poison["on"] = True
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match=rf"VOGN step 3: the gradient .* for {name} is not"):
        vogn.step(*batch(2))
    assert_same(before, snapshot(vogn, net))


def test_an_error_in_reduce_fn_changes_nothing():
    def reduce_fn(tensors):
        raise ConnectionError("peer closed the connection")

    net = lifted_net()
    vogn = VOGN(hand_model(net), dataset_size=N, reduce_fn=reduce_fn)
    before = snapshot(vogn, net)
    with pytest.raises(ConnectionError, match="peer closed") as info:
        vogn.step(*batch(0))
    assert "VOGN step 1 was refused" in "".join(info.value.__notes__)
    assert_same(before, snapshot(vogn, net))


def test_a_non_finite_kl_is_refused_naming_the_term():
    # δ = 1e300 overflows δ̃ in float32: σ = 0 and log σ = -inf, so the KL would be infinite
    # while the likelihood is finite; the set-up refuses that σ first, naming the prior.
    net = lifted_net()
    vogn = VOGN(hand_model(net), dataset_size=N, prior_precision=1e300)
    before = snapshot(vogn, net)
    with pytest.raises(
        ValueError,
        match=r"VOGN step 1: with prior_precision=1e\+300 .* the initial posterior scale σ is "
        "zero or not finite",
    ):
        vogn.step(*batch(0))
    assert_same(before, snapshot(vogn, net))
    assert vogn.needs_setup


# --- VOGN: hyperparameters changed between steps --------------------------------------------


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("lr", NAN, r"\['lr'\] must be a finite number >= 0; got nan"),
        ("lr", INF, r"\['lr'\] must be a finite number >= 0; got inf"),
        ("lr", -1e-3, r"\['lr'\] must be a finite number >= 0"),
        ("lr", "fast", r"\['lr'\] must be a finite number >= 0; got 'fast'"),
        ("lr", torch.tensor([1e-3, 1e-3]), r"\['lr'\] must be a finite number"),
        ("betas", (1.0, 0.999), r"\['betas'\] must be a pair"),
        ("betas", (NAN, 0.999), r"\['betas'\] must be a pair"),
        ("betas", (0.9,), r"\['betas'\] must be a pair"),
    ],
)
@pytest.mark.parametrize("at_step", [1, 3])
def test_bad_hyperparameters_in_the_optimizer_are_refused_before_any_change(
    key, value, match, at_step
):
    net = lifted_net()
    vogn = trained_vogn(hand_model(net), at_step - 1)
    vogn.optimizer.param_groups[0][key] = value
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match=rf"VOGN step {at_step}: .*{match}"):
        vogn.step(*batch(at_step))
    assert_same(before, snapshot(vogn, net))


def test_a_scheduler_that_sets_lr_to_nan_is_refused_at_the_next_step():
    net = lifted_net()
    vogn = VOGN(hand_model(net), dataset_size=N, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(vogn.optimizer, lambda e: 1.0 if e < 2 else NAN)
    for i in range(2):
        vogn.step(*batch(i))
        scheduler.step()
    before = snapshot(vogn, net)
    with pytest.raises(ValueError, match=r"VOGN step 3: .*\['lr'\] must be .*; got nan"):
        vogn.step(*batch(2))
    assert_same(before, snapshot(vogn, net))


@pytest.mark.parametrize("value", [0.0, -1.0, NAN, INF, "hot", None, True, torch.ones(2)], ids=repr)
@pytest.mark.parametrize("at_step", [1, 3])
def test_a_temperature_schedule_returning_a_bad_value_is_refused(value, at_step):
    net = lifted_net()
    bad = {"on": False}
    vogn = trained_vogn(
        hand_model(net), at_step - 1, temperature=lambda step: value if bad["on"] else 1.0
    )
    bad["on"] = True
    before = snapshot(vogn, net)
    with pytest.raises(
        ValueError, match=rf"VOGN step {at_step}: the temperature schedule returned"
    ):
        vogn.step(*batch(at_step))
    assert_same(before, snapshot(vogn, net))


def test_a_temperature_change_then_a_refused_step_keeps_sigma():
    # Setting τ changes σ at the next step; a refused step puts σ back as it was.
    net = lifted_net()
    vogn = trained_vogn(hand_model(net), 2)
    vogn.temperature = 0.5
    before = snapshot(vogn, net)
    with pytest.raises(ValueError):
        vogn.step(*nan_batch())
    assert_same(before, snapshot(vogn, net))
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        vogn.temperature = NAN
    assert_same(before, snapshot(vogn, net))


# --- VOGN: bad x and y ----------------------------------------------------------------------


def _bad_inputs():
    x, y = batch(50)
    return {
        "x list": ((x.tolist(), y), TypeError, r"must be (a )?(torch\.)?Tensor"),
        "x float64": ((x.double(), y), RuntimeError, r"same dtype"),
        "x too wide": ((torch.randn(B, FEATURES + 1), y), RuntimeError, r"cannot be multiplied"),
        "y out of range": ((x, torch.full((B,), CLASSES)), ValueError, r"support|\[0, 10\)"),
        "y too short": ((x, y[:-1]), ValueError, r"broadcastable|same number of rows"),
        "y (B, 1)": ((x, y[:, None]), ValueError, r"broadcasts the distribution's|shape \(16,\)"),
        "y float": ((x, y.float() + 0.5), ValueError, r"support|integer class labels"),
    }


_CHECKED_BY_THE_MODEL = {
    "x float64": (TypeError, r"x has dtype torch\.float64.*expects torch\.float32"),
    "x too wide": (ValueError, r"x has 65 features.*expects 64"),
}


@pytest.mark.parametrize("case", list(_bad_inputs()))
@pytest.mark.parametrize("kind", ["hand", "classifier"])
@pytest.mark.parametrize("at_step", [1, 3])
def test_bad_x_and_y_are_refused_before_any_change(case, kind, at_step):
    (x, y), error, match = _bad_inputs()[case]
    if kind == "classifier" and case in _CHECKED_BY_THE_MODEL:
        # NetworkModel checks the input's dtype and width itself, with a clear message; a
        # hand-written model leaves them to torch (the refusal must change nothing either way).
        error, match = _CHECKED_BY_THE_MODEL[case]
    net = lifted_net()
    model = hand_model(net) if kind == "hand" else models.classifier(net, N)
    vogn = trained_vogn(model, at_step - 1)
    before = snapshot(vogn, net)
    with pytest.raises(error, match=match):
        vogn.step(x, y)
    assert_same(before, snapshot(vogn, net))


def test_a_model_that_raises_mid_step_changes_nothing():
    fail: dict = {"calls": None}
    net = lifted_net()
    vogn = trained_vogn(hand_model(net, fail), 2, num_particles=3)
    fail["calls"] = 2  # the third particle's pass raises, after two passes through BatchNorm
    before = snapshot(vogn, net)
    with pytest.raises(RuntimeError, match="injected failure"):
        vogn.step(*batch(2))
    assert_same(before, snapshot(vogn, net))


# --- SVI with TraceSuffStat_ELBO ------------------------------------------------------------


def svi_setup(fail: dict | None = None, num_particles: int = 1):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    net = lifted_net()
    model = hand_model(net, fail)
    guide = AutoMeanField(model)
    optim = pyro.optim.Adam({"lr": 1e-2})
    elbo = TraceSuffStat_ELBO(num_kl_samples=4, num_particles=num_particles)
    return net, SVI(model, guide, optim, elbo), optim


@pytest.mark.parametrize("at_step", [1, 3])
def test_svi_refuses_a_non_finite_loss_naming_term_and_step_and_changes_nothing(at_step):
    net, svi, optim = svi_setup()
    for i in range(at_step - 1):
        svi.step(*batch(i))
    before = snapshot(net, optim)
    with (
        pyro.validation_enabled(False),
        pytest.raises(
            ValueError,
            match=rf"TraceSuffStat_ELBO at step {at_step}: the likelihood term of site 'y' is non",
        ),
    ):
        svi.step(*nan_batch())
    assert_same(before, snapshot(net, optim))
    assert_eval_predictions_finite(net)


@pytest.mark.parametrize("at_step", [1, 3])
def test_svi_retry_after_a_refused_step_reproduces_the_uninterrupted_run(at_step):
    # At step 1 the refusal also undoes the autoguide's set-up, so the retry sets it up again.
    def run(refuse: bool):
        net, svi, optim = svi_setup()
        for i in range(4):
            if refuse and i == at_step - 1:
                with pyro.validation_enabled(False), pytest.raises(ValueError):
                    svi.step(*nan_batch())
            svi.step(*batch(i))
        return snapshot(net, optim)

    assert_same(run(refuse=False), run(refuse=True))


def test_svi_a_failure_in_a_later_particle_restores_the_gradients():
    # With two particles the first one's backward pass has already accumulated gradients when
    # the second fails; they are put back, so the next step does not count them.
    fail: dict = {"calls": None}
    net, svi, optim = svi_setup(fail, num_particles=2)
    svi.step(*batch(0))
    fail["calls"] = 1
    before = snapshot(net, optim)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        svi.step(*batch(1))
    assert "TraceSuffStat_ELBO step 2 was refused" in "".join(info.value.__notes__)
    assert_same(before, snapshot(net, optim))


def test_the_rollback_copies_only_the_buffers_a_pass_writes():
    # Saving must stay cheap: BatchNorm's running statistics and counter (a few hundred bytes
    # here), not the initial weights that bayesianize keeps as buffers (as large as the weights).
    net = lifted_net()
    vogn = trained_vogn(hand_model(net), 1)
    saved = {name for _, name in vogn._rollback._entries}
    assert saved == {"running_mean", "running_var", "num_batches_tracked"}


class CallCounter(nn.Module):
    """A layer that replaces its buffer (instead of writing it in place) on every call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls = self.calls + 1
        return x


def test_a_buffer_replaced_by_the_pass_is_put_back():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(FEATURES, 16), CallCounter(), nn.BatchNorm1d(16), nn.Linear(16, CLASSES)
    )
    net = bayesianize(net, priors.Normal(scale=1.0))
    vogn = trained_vogn(hand_model(net), 2)
    before = snapshot(vogn, net)
    x, y = batch(5)
    y = y.clone()
    y[0] = CLASSES + 3  # refused by Pyro at the observation, after the pass replaced the buffer
    with pytest.raises(ValueError, match="Expected value argument"):
        vogn.step(x, y)
    assert_same(before, snapshot(vogn, net))
    assert int(net[1].calls) == int(before["1:state_dict"]["1.calls"])
