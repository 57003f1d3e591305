"""A training step reads tensors back to the host only where a check needs a value.

On a GPU every read (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``) waits for the queued
kernels, so the per-step path of a classifier's model and of the point-estimate guides is held to
a counted number: the model's batch check reads once (finite inputs and the label range fused),
Categorical's own validation of the logits once (a NaN logit is refused), the guides never.
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro import poutine
from torch import nn
from torch.overrides import TorchFunctionMode

import pyro_bdl as bdl

READS = {"item", "__int__", "__float__", "__bool__", "__index__", "tolist", "numpy"}


class _CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.read_from: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
            self.read_from.append(args[0] if args else None)
        return func(*args, **(kwargs or {}))


def _step_parts(guide_cls, **options):
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(scale=1.0)), 100)
    guide = guide_cls(model, **options)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(5, (8,))
    svi = pyro.infer.SVI(model, guide, pyro.optim.SGD({"lr": 1e-3}), pyro.infer.Trace_ELBO())
    svi.step(x, y)  # the first call (set-up, output width) is not the per-step path
    return model, guide, x, y


@pytest.mark.parametrize(
    ("guide_cls", "options"),
    [
        (bdl.guides.AutoSWAG, {"rank": 2}),
        (bdl.guides.AutoSubnetLaplace, {"subnetwork": "last_layer"}),
    ],
)
@pytest.mark.parametrize("validation", [True, False])
def test_a_point_step_reads_back_only_the_batch_check(guide_cls, options, validation):
    model, guide, x, y = _step_parts(guide_cls, **options)
    pyro.enable_validation(validation)
    with _CountReads() as guide_reads:
        guide_trace = poutine.trace(guide).get_trace(x, y)
    assert guide_reads.reads == []
    with _CountReads() as model_reads:
        trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(x, y)
        trace.nodes["y"]["fn"].log_prob(y)
    # With validation, Categorical checks its logits (one read); the labels it would check
    # again were checked by the batch check.
    assert model_reads.reads == (["tolist", "__bool__"] if validation else ["tolist"])


def test_the_fused_batch_check_still_names_each_failure():
    model, _, x, y = _step_parts(bdl.guides.AutoSWAG, rank=2)
    bad_x = x.clone()
    bad_x[1, 0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"x contains 1 non-finite value\(s\).*\(1, 0, 2, 3\)"):
        model(bad_x, y)
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 5\); got min 0, max 7"):
        model(x, torch.tensor([0, 1, 2, 3, 4, 7, 1, 1]))
    with pytest.raises(ValueError, match=r"got min -1, max 4"):
        model(x, torch.tensor([0, 1, 2, 3, 4, -1, 1, 1]))
    with pytest.raises(ValueError, match=r"binary labels 0 or 1.*2"):
        bdl.models.check_batch(x, torch.tensor([0, 1, 2, 1, 0, 0, 1, 1]), task="binary")


@pytest.mark.parametrize(
    ("guide_cls", "options"),
    [
        (bdl.guides.AutoSWAG, {"rank": 2}),
        (bdl.guides.AutoSubnetLaplace, {"subnetwork": "last_layer"}),
        (bdl.guides.AutoMeanField, {}),
    ],
)
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_a_whole_svi_step_reads_back_twice(guide_cls, options, optim):
    """TraceSuffStat_ELBO sums every site's term on the device and reads the loss once, and
    FusedOptim reads nothing: the step reads the batch check and the loss. Pyro's Trace_ELBO
    reads each site's log-density (``.item()`` per model and guide site: a GPU sync each)."""
    # Validation's own checks read (the prior's support check of each weight, per site): off,
    # as in the benchmarks, before the model builds its priors.
    pyro.enable_validation(False)
    model, guide, x, y = _step_parts(guide_cls, **options)
    constructor = torch.optim.SGD if optim == "sgd" else torch.optim.Adam
    reads = {}
    for elbo in (bdl.infer.TraceSuffStat_ELBO(), pyro.infer.Trace_ELBO()):
        optimizer = bdl.infer.FusedOptim(constructor, {"lr": 1e-3})
        svi = pyro.infer.SVI(model, guide, optimizer, elbo)
        svi.step(x, y)  # the optimizer's set-up
        with _CountReads() as counted:
            svi.step(x, y)
        # Adam's step counters are host tensors (on a GPU too, unless capturable): reading them
        # waits for nothing.
        assert optimizer.optimizer is not None
        counters = {id(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s}
        reads[type(elbo).__name__] = [
            r for r, t in zip(counted.reads, counted.read_from) if id(t) not in counters
        ]
    assert reads["TraceSuffStat_ELBO"] == ["tolist", "item"]
    # Four weight sites (the conv's and the linear layer's weight and bias) and the labels.
    assert reads["Trace_ELBO"].count("item") >= 4


@pytest.mark.parametrize(
    ("guide_cls", "options", "support_checks"),
    [
        # A point mass's term is the prior's log-density, whose support check reads once per
        # weight site (the conv's and the linear layer's weight and bias); a mean-field site's
        # is its exact KL, which checks nothing.
        (bdl.guides.AutoSWAG, {"rank": 2}, 4),
        (bdl.guides.AutoSubnetLaplace, {"subnetwork": "last_layer"}, 4),
        (bdl.guides.AutoMeanField, {}, 0),
    ],
)
def test_with_validation_on_the_weights_add_no_read(guide_cls, options, support_checks):
    """The lifted weights' terms are summed in one pass (pyro_bdl.infer.normal_sites), with no
    support check per site: Pyro's validation adds only Categorical's check of the logits and
    its NaN and inf warnings on the likelihood's log-density, three reads whatever the number of
    weight sites."""
    model, guide, x, y = _step_parts(guide_cls, **options)
    elbo = bdl.infer.TraceSuffStat_ELBO()
    svi = pyro.infer.SVI(model, guide, bdl.infer.FusedOptim(torch.optim.SGD, {"lr": 1e-3}), elbo)
    svi.step(x, y)
    with _CountReads() as counted:
        svi.step(x, y)
    one_pass = ["tolist", "__bool__", "__bool__", "__bool__", "item"]
    assert counted.reads == one_pass
    elbo._group_normal_sites = False  # site by site
    with _CountReads() as counted:
        svi.step(x, y)
    assert len(counted.reads) == len(one_pass) + support_checks
