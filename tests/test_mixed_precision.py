r"""Mixed precision on the CPU: training under ``torch.autocast("cpu", dtype=torch.bfloat16)``
stays close to the float32 run from the same seed, and no parameter, accumulator or optimizer
state is ever bfloat16 (docs/methods/precision.md).

Tolerance. bfloat16 keeps 8 significant bits: one rounding changes a number by a relative
u = 2⁻⁸ at most (round to nearest gives u/2; u covers the worst case). Autocast rounds the
operands and the result of every matrix product and runs the elementwise layers between them in
bfloat16. Per step on the 5-16-3 MLP below: forward, layer 1 (x, W₁, output: 3 roundings), tanh
(1), layer 2 (W₂, output: 2); backward, the gradient into layer 2 (1), the products for ∂W₂ and
∂h (2), tanh's derivative (1), the product for ∂W₁ (1): 11 roundings, taken as R = 16 with room
for the bias adds. To first order the errors add, so each gradient is off by a relative R·u =
1/16 at most. SGD (with momentum, a linear filter of the gradients) moves the weights by a sum
of learning rate × gradient, so the movement over a few steps is off by the same relative 1/16
(the gradients are evaluated at points that differ by that much of a few small steps: second
order). The likelihood runs in float32 (the model upcasts the network's output), the KL and the
guide in float32 throughout, so they add nothing.
"""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoEnsemble, AutoMeanField, AutoRadial, AutoSWAG
from pyro_bdl.infer import TraceSuffStat_ELBO
from tests.common import assert_float32_or_wider, assert_moved_alike

#: Relative error of the movement of the weights, derived in the module docstring.
RELATIVE = 16 * 2.0**-8
N, STEPS = 32, 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _model(seed: int | None = 0):
    if seed is not None:  # None: the caller seeds (AutoEnsemble.from_training, seed + k)
        torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    return models.classifier(bayesianize(net, priors.Normal(scale=1.0)), N)


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _optim():
    return pyro.optim.SGD({"lr": 1e-3, "momentum": 0.9})


def _optim_state(optim) -> dict:
    return {
        f"{name}/{key}": value
        for name, state in optim.get_state().items()
        for per_param in state["state"].values()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }


def _set_up(make_guide):
    """A fresh model and ``make_guide(model)`` from seed 0, set up on the data."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _model()
    guide = make_guide(model)
    x, y = _data()
    guide(x, y)
    return model, guide, x, y


def _svi_run(guide_cls, elbo_cls, amp: bool):
    model, guide, x, y = _set_up(lambda model: guide_cls(model, init_scale=0.05))
    start = torch.cat([guide.loc, guide.rho]).detach().clone()
    optim = _optim()
    svi = SVI(model, guide, optim, elbo_cls())
    losses = []
    for _ in range(STEPS):
        with _autocast(amp):
            losses.append(svi.step(x, y))
        assert_float32_or_wider(dict(pyro.get_param_store().items()))
        assert_float32_or_wider(_optim_state(optim))
    with _autocast(amp):  # what the ELBOs sum: every latent site's value, log-density and KL
        guide_tr = poutine.trace(guide).get_trace(x, y)
        model_tr = poutine.trace(poutine.replay(model, guide_tr)).get_trace(x, y)
        guide_tr.compute_log_prob()
        model_tr.compute_log_prob()
        kl = {
            name: torch.distributions.kl_divergence(site["fn"], model_tr.nodes[name]["fn"])
            for name, site in guide_tr.nodes.items()
            if site["type"] == "sample"
        }
    for tr in (guide_tr, model_tr):
        sites = [s for s in tr.nodes.values() if s["type"] == "sample" and not s["is_observed"]]
        assert_float32_or_wider({s["name"]: s["value"] for s in sites})
        assert_float32_or_wider(
            {s["name"]: s["log_prob_sum"] for s in tr.nodes.values() if "log_prob_sum" in s}
        )
    assert_float32_or_wider(kl)
    end = torch.cat([guide.loc, guide.rho]).detach().clone()
    return start, end, losses


@pytest.mark.parametrize("elbo_cls", [Trace_ELBO, TraceSuffStat_ELBO])
@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
def test_svi_under_bf16_autocast_follows_float32(guide_cls, elbo_cls):
    start, fp32, losses32 = _svi_run(guide_cls, elbo_cls, amp=False)
    start_amp, amp, losses16 = _svi_run(guide_cls, elbo_cls, amp=True)
    assert torch.equal(start, start_amp)
    assert_moved_alike(start, fp32, amp, RELATIVE)
    # The loss: a sum of float32 terms whose data part comes through the bf16 layers.
    for a, b in zip(losses16, losses32):
        assert abs(a - b) <= RELATIVE * abs(b)


def _swag_run(amp: bool):
    model, guide, x, y = _set_up(lambda model: AutoSWAG(model, rank=2))
    start = guide.loc.detach().clone()
    optim = _optim()
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(STEPS):
        with _autocast(amp):
            svi.step(x, y)
            guide.collect()
    assert_float32_or_wider(dict(guide.named_buffers()))
    assert_float32_or_wider(dict(pyro.get_param_store().items()))
    assert_float32_or_wider(_optim_state(optim))
    return start, guide.swag_mean.detach().clone()


def test_swag_collection_under_bf16_autocast_follows_float32():
    start, fp32 = _swag_run(amp=False)
    _, amp = _swag_run(amp=True)
    # The SWAG mean averages the iterates: its movement is a mean of movements, each within
    # RELATIVE of float32's.
    assert_moved_alike(start, fp32, amp, RELATIVE)


def _ensemble_run(amp: bool):
    x, y = _data()
    starts = []

    def train(model):
        guide = pyro.infer.autoguide.AutoDelta(model)
        guide(x, y)
        starts.append(torch.cat([p.detach().reshape(-1).clone() for p in guide.parameters()]))
        svi = SVI(model, guide, _optim(), Trace_ELBO())
        for _ in range(STEPS):
            with _autocast(amp):
                svi.step(x, y)
        return guide

    pyro.clear_param_store()
    with _autocast(amp):
        guide = AutoEnsemble.from_training(lambda: _model(seed=None), train, num_members=2)
        guide(x, y)
    assert_float32_or_wider(dict(guide.named_buffers()))
    assert_float32_or_wider(dict(guide.named_parameters()))
    return torch.stack(starts), guide.ensemble_locs.detach().clone()


def test_ensemble_under_bf16_autocast_follows_float32():
    start, fp32 = _ensemble_run(amp=False)
    start_amp, amp = _ensemble_run(amp=True)
    assert torch.equal(start, start_amp)
    assert_moved_alike(start, fp32, amp, RELATIVE)
