"""Everyday PyTorch habits around the inference objects: copies (``copy.deepcopy``, ``pickle``)
train like the originals, a call under ``torch.no_grad()`` or ``torch.inference_mode()`` (as
evaluation code wraps its calls) is the call outside it, and a guide or network converted on
its own is refused with the fix rather than trained past."""

from __future__ import annotations

import contextlib
import copy
import pickle

import pyro
import pyro.distributions as pdist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_bdl.distributed import DataParallelSVI
from pyro_bdl.guides import AutoMeanField
from pyro_bdl.infer import IVON, VOGN, FusedOptim, TraceSuffStat_ELBO
from tests.infer.test_ivon import small_classifier

MODES = {
    "outside": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def _method(name: str, model):
    if name == "VOGN":
        return VOGN(model, dataset_size=16, lr=0.1)
    return IVON(model, dataset_size=16, lr=0.1, hess_init=0.1)


def _store() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pyro.get_param_store().items()}


# -- pickle --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_an_unpickled_method_steps_like_the_original(method):
    """``pickle`` copies each tensor on its own storage, so the per-site views a pass writes
    through (the weight sample the layers read, the per-layer gradients) stopped being views:
    the copy trained on stale weights and gradients, with another loss and no error."""
    model, x, y = small_classifier()
    original = _method(method, model)
    original.step(x, y)
    twin = pickle.loads(pickle.dumps(original))
    mean_before = original.state.mean.clone()

    torch.manual_seed(3)
    copy_losses = [twin.step(x, y) for _ in range(2)]
    assert torch.equal(original.state.mean, mean_before)  # the copy shares no storage
    torch.manual_seed(3)
    losses = [original.step(x, y) for _ in range(2)]

    assert copy_losses == losses
    assert torch.equal(twin.state.mean, original.state.mean)
    assert torch.equal(twin.guide.scale, original.guide.scale)
    assert twin.guide.loc is twin.state.mean  # the copy's guide reads the copy's state


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda obj: pickle.loads(pickle.dumps(obj))}


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_fused_optimizer_resumes_the_moments(how):
    """The copy held copies of the parameters with their Adam moments, and met the param
    store's parameters as new ones (moments from zero); pickle refused Pyro's weak references."""
    runs = []
    for copied in (False, True):
        pyro.clear_param_store()
        model, x, y = small_classifier()
        guide = AutoMeanField(model)
        guide(x, y)
        optim = FusedOptim(torch.optim.Adam, {"lr": 0.01})
        pyro.set_rng_seed(1)
        SVI(model, guide, optim, Trace_ELBO()).step(x, y)
        if copied:
            optim = COPIES[how](optim)
        svi = SVI(model, guide, optim, Trace_ELBO())
        runs.append(([svi.step(x, y) for _ in range(2)], _store()))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[1][1].items():
        assert torch.equal(value, runs[0][1][name]), name


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_elbo_rolls_back_the_network_it_runs(how):
    """The copy of an ELBO that had stepped held copies of the layers whose buffers it had
    learned to save: with the original network, a refused step put back the copies' BatchNorm
    statistics and left the network's changed by the refused pass."""
    model, x, y = small_classifier()
    guide = AutoMeanField(model)
    guide(x, y)
    elbo = TraceSuffStat_ELBO(num_kl_samples=10)
    SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), elbo).step(x, y)

    def refusing(x, y):
        model(x, y)  # a training pass: BatchNorm's running statistics change
        raise RuntimeError("refused after the forward pass")

    svi = SVI(refusing, guide, pyro.optim.Adam({"lr": 0.01}), COPIES[how](elbo))
    batchnorm = model.net[1]
    before = {k: v.clone() for k, v in batchnorm.state_dict().items()}
    with pytest.raises(RuntimeError, match="refused after the forward pass"):
        svi.step(x + 1.0, y)
    for name, value in batchnorm.state_dict().items():
        assert torch.equal(value, before[name]), name


# -- grad modes ----------------------------------------------------------------------------------


def _svi_run(kind: str, optim: str, mode: str, loss=None) -> tuple[list[float], dict]:
    """Three steps from the same start, the first and the last under ``mode``."""
    pyro.clear_param_store()
    model, x, y = small_classifier()
    guide = AutoMeanField(model)
    guide(x, y)
    opt = (
        pyro.optim.Adam({"lr": 0.01})
        if optim == "pyro"
        else FusedOptim(torch.optim.Adam, {"lr": 0.01})
    )
    svi = (SVI if kind == "SVI" else DataParallelSVI)(
        model, guide, opt, loss or TraceSuffStat_ELBO(num_kl_samples=10)
    )
    pyro.set_rng_seed(4)
    with MODES[mode]():
        losses = [svi.step(x, y)]
    losses.append(svi.step(x, y))
    with MODES[mode]():
        losses.append(svi.step(x, y))
    return losses, _store()


@pytest.mark.parametrize(
    ("kind", "optim", "mode"),
    [
        ("SVI", "pyro", "no_grad"),
        # Pyro's own optimizers would keep Adam's moments as inference tensors, which the step
        # outside inference mode cannot update; FusedOptim steps outside inference mode.
        ("SVI", "fused", "inference_mode"),
        ("DataParallelSVI", "pyro", "no_grad"),
        ("DataParallelSVI", "pyro", "inference_mode"),
    ],
)
def test_a_suffstat_elbo_step_under_no_grad_is_the_step_with_grad(kind, optim, mode):
    """The ELBO's backward pass was skipped under no_grad (the loss did not require grad), so
    the optimizer stepped without gradients: the parameters did not move, without a word."""
    reference = _svi_run(kind, optim, "outside")
    losses, params = _svi_run(kind, optim, mode)
    assert losses == reference[0]
    assert params.keys() == reference[1].keys()
    for name, value in params.items():
        assert torch.equal(value, reference[1][name]), name


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_data_parallel_step_with_any_elbo_under_no_grad_is_the_step_with_grad(mode):
    # DataParallelSVI.step itself turns autograd on, whatever ELBO it wraps (Pyro's here).
    reference = _svi_run("DataParallelSVI", "pyro", "outside", Trace_ELBO())
    losses, params = _svi_run("DataParallelSVI", "pyro", mode, Trace_ELBO())
    assert losses == reference[0]
    for name, value in params.items():
        assert torch.equal(value, reference[1][name]), name


def test_a_fused_step_under_inference_mode_keeps_a_usable_state():
    """Adam's moments created by a first step under inference mode were inference tensors, and
    the next step outside it raised torch's "Inplace update to inference tensor"."""
    results = []
    for first in ("outside", "inference_mode"):
        p = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
        optim = FusedOptim(torch.optim.Adam, {"lr": 0.1})
        for k, mode in enumerate((first, "outside", first)):
            p.grad = torch.tensor([0.3, -0.1, 2.0]) * (k + 1)
            with MODES[mode]():
                optim([p])
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_a_data_parallel_evaluation_first_under_inference_mode_leaves_the_steps_usable():
    """The step's snapshot of BatchNorm's statistics was first allocated by the evaluation, as
    inference tensors there, and every later step raised torch's "Inplace update to inference
    tensor" when it saved into them."""
    runs = []
    for mode in ("outside", "inference_mode"):
        pyro.clear_param_store()
        model, x, y = small_classifier()
        guide = AutoMeanField(model)
        guide(x, y)
        svi = DataParallelSVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO(), seed=4)
        with MODES[mode]():
            losses = [svi.evaluate_loss(x, y)]
        losses += [svi.step(x, y), svi.step(x, y)]
        runs.append((losses, _store()))
    assert runs[0][0] == runs[1][0]
    for name, value in runs[1][1].items():
        assert torch.equal(value, runs[0][1][name]), name


# -- the guide on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_a_guide_converted_on_its_own_is_refused_by_the_next_step(method):
    """``guide.to(dtype)`` replaced the guide's loc by a converted copy: the method went on
    updating its state while the guide predicted from the μ of the conversion, without a word
    (and wrote the new σ into the guide's copy)."""
    model, x, y = small_classifier()
    runner = _method(method, model)
    runner.step(x, y)
    runner.guide.to(torch.float32)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in runner.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"guide was moved or converted.*{method.lower()}\.to"):
        runner.step(x, y)
    with pytest.raises(RuntimeError, match="guide was moved or converted"):
        runner.evaluate_loss(x, y)
    for key in ("mean", "momentum", "curvature"):
        assert torch.equal(runner.state_dict()[key], state[key])  # the refusal changed nothing
    # The fix the message names: the method moves the guide with its state and layers.
    runner.to(torch.float32)
    runner.step(x.float(), y)
    assert runner.guide.loc is runner.state.mean and runner.guide.loc.dtype == torch.float32


def test_a_guide_state_loaded_before_the_method_has_seen_the_model_names_the_way():
    # torch said only 'Unexpected key(s) in state_dict: "loc", "scale"'.
    model, x, y = small_classifier()
    vogn = _method("VOGN", model)
    vogn.step(x, y)
    saved = vogn.guide.state_dict()
    fresh = _method("VOGN", small_classifier()[0])
    with pytest.raises(RuntimeError, match=r"vogn\.load_state_dict.*vogn\.setup\(x, y\)"):
        fresh.guide.load_state_dict(saved)
    fresh.setup(x, y)  # the guide alone then loads, into the state's own μ
    fresh.guide.load_state_dict(saved)
    assert torch.equal(fresh.state.mean, vogn.state.mean)


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_a_method_moved_under_inference_mode_trains_as_one_moved_outside(method):
    # The moved state and layers were inference tensors, and the next step raised torch's
    # "Inplace update to inference tensor outside InferenceMode".
    runs = []
    for mode in ("outside", "inference_mode"):
        model, x, y = small_classifier()
        runner = _method(method, model)
        runner.step(x, y)
        with MODES[mode]():
            runner.to(torch.float32)
        torch.manual_seed(3)
        runs.append(([runner.step(x.float(), y) for _ in range(2)], runner.state.mean.clone()))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def _constrained_model(y):
    # Element-wise priors without a closed-form KL: the streaming estimator with autograd scores.
    s = pyro.sample("s", pdist.Gamma(2.0, 1.0))
    m = pyro.sample("m", pdist.StudentT(3.0, 0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", pdist.Normal(m, s), obs=y)


def test_a_streaming_kl_loss_under_inference_mode_is_the_loss_outside():
    # Under inference_mode the per-chunk autograd score of the prior raised autograd's "element
    # 0 of tensors does not require grad" from TraceSuffStat_ELBO.loss (SVI.evaluate_loss).
    y = torch.linspace(-1.0, 2.0, 10)
    guide = AutoMeanField(_constrained_model)
    guide(y)
    elbo = TraceSuffStat_ELBO(num_kl_samples=20)
    pyro.set_rng_seed(0)
    expected = elbo.loss(_constrained_model, guide, y)
    assert set(elbo.kl_methods.values()) == {"streaming_elementwise"}
    svi = SVI(_constrained_model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    with torch.inference_mode():
        pyro.set_rng_seed(0)
        assert svi.evaluate_loss(y) == expected


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_a_network_converted_on_its_own_is_refused_with_the_fix(method):
    """``net.float()`` after the first step left a float64 state writing float64 weight samples
    into float32 layers: torch's "mat1 and mat2 must have the same dtype" named neither."""
    model, x, y = small_classifier()
    runner = _method(method, model)
    runner.step(x, y)
    model.net.float()
    before = runner.state_dict()
    with pytest.raises(RuntimeError, match=rf"converted or moved on its own.*{method.lower()}\.to"):
        runner.step(x.float(), y)
    with pytest.raises(RuntimeError, match="converted or moved on its own"):
        runner.evaluate_loss(x.float(), y)
    for key in ("mean", "momentum", "curvature"):
        assert torch.equal(runner.state_dict()[key], before[key])
    runner.to(torch.float32)  # the fix the message names
    runner.step(x.float(), y)
    assert runner.state.mean.dtype == torch.float32


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_a_copy_whose_model_runs_the_original_network_is_refused_naming_the_cause(method):
    # The copy wrote its samples on its own copied layers while the function ran the original
    # network, which drew its weights from the prior: the refusal blamed a changed structure.
    model, x, y = small_classifier(batchnorm=False)
    net = model.net

    def function_model(x, y):
        logits = net(x)
        with pyro.plate("data", 16, subsample_size=len(x)):
            pyro.sample("y", pdist.Categorical(logits=logits), obs=y)

    runner = _method(method, function_model)
    runner.step(x, y)
    twin = copy.deepcopy(runner)
    mean = twin.state.mean.clone()
    with pytest.raises(ValueError, match=rf"copy of {method}.*model is a function.*original"):
        twin.step(x, y)
    assert torch.equal(twin.state.mean, mean)
