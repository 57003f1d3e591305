"""A block of a location-scale guide as one autograd node (pyro_bdl/guides/block_sites.py): the
same values and gradients as the same computation made of torch's split, unbind and softplus."""

from __future__ import annotations

import io
import warnings

import pyro
import pytest
import torch
from torch.nn import functional as F

from pyro_bdl.guides import AutoMeanField, AutoRadial, base
from pyro_bdl.guides.block_sites import BlockSites, softplus, softplus_value
from tests.guides.test_contract import data, small_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softplus_value_is_exact_to_a_few_ulps(dtype):
    # From far below (σ = e^ρ) to far above (σ ≈ ρ), and across the chunk boundaries, against
    # log(1 + e^ρ) in float64 (torch's logaddexp; not torch's softplus, which returns ρ itself
    # above 20: 2e-9 off, 1e-10 relative, beyond float64's rounding). Goldberg's log1p is
    # exact to a few ulps and the final addition adds one: 8 ulps allow both.
    rho = torch.cat(
        [
            torch.linspace(-80.0, 80.0, 100_003, dtype=dtype),
            -torch.logspace(-30, 1.5, 1001, dtype=dtype),
            torch.logspace(-30, 1.5, 1001, dtype=dtype),
            torch.zeros(1, dtype=dtype),
        ]
    )
    exact = torch.logaddexp(rho.double(), torch.zeros((), dtype=torch.float64))
    got = softplus_value(rho).double()
    torch.testing.assert_close(got, exact, rtol=8 * torch.finfo(dtype).eps, atol=0.0)
    assert bool((got > 0).all())


def test_softplus_gradient_is_torchs():
    rho = torch.linspace(-30.0, 30.0, 1001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(softplus(rho).sum(), rho)
    torch.testing.assert_close(grad, torch.sigmoid(rho.detach()))


def _reference(param, noise, sizes):
    """The block through torch's own operations (the guide's single-block path)."""
    loc, rho = param.unbind(0)
    scale = F.softplus(rho)
    out = [*loc.split(sizes), *scale.split(sizes)]
    if noise is not None:
        out += torch.addcmul(loc, scale, noise).split(sizes)
    return out


@pytest.mark.parametrize("with_noise", [True, False])
def test_block_sites_match_torchs_operations_in_value_and_gradient(with_noise):
    torch.manual_seed(0)
    sizes = [5, 1, 7, 3]
    param = torch.randn(2, sum(sizes), dtype=torch.float64)
    param[1] -= 2.0
    noise = torch.randn(sum(sizes), dtype=torch.float64) if with_noise else None
    weights = [torch.randn(s, dtype=torch.float64) for s in sizes * 3]
    results = []
    for make in (
        lambda p: BlockSites.apply(p, noise, sizes),
        lambda p: _reference(p, noise, sizes),
    ):
        leaf = param.clone().requires_grad_()
        out = make(leaf)
        # Some outputs take no part in the loss (a site whose value is unused, the scale of a
        # site no KL reads): their gradient arrives as None and counts as zero.
        loss = sum((w * o).sum() for k, (w, o) in enumerate(zip(weights, out)) if k % 4 != 1)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append(([o.detach() for o in out], grad))
    (fused_out, fused_grad), (ref_out, ref_grad) = results
    assert len(fused_out) == len(ref_out) == len(sizes) * (3 if with_noise else 2)
    for a, b in zip(fused_out, ref_out):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(fused_grad, ref_grad)


@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
def test_a_guide_in_several_blocks_traces_and_saves(monkeypatch, guide_cls):
    # Under torch.jit.trace the blocks take torch's own operations (a custom autograd function
    # cannot be saved in a traced module); the traced guide draws what the eager one draws.
    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    pyro.clear_param_store()
    model = small_model()
    x, y = data()
    guide = guide_cls(model)
    guide(x, y)
    assert len(guide._param_names()) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
        traced = torch.jit.trace_module(guide, {"forward": (x, y)}, strict=False)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
    pyro.set_rng_seed(3)
    eager = guide(x, y)
    pyro.set_rng_seed(3)
    again = loaded(x, y)
    assert eager.keys() == again.keys()
    assert all(torch.equal(eager[k], again[k]) for k in eager)


def test_a_subclass_with_its_own_flat_sample_keeps_it(monkeypatch):
    # A guide written against the flat_sample hook (before flat_noise existed) still draws
    # through it in a model of several blocks.
    class Shifted(AutoMeanField):
        def flat_sample(self, loc, scale, sizes):
            return loc + 1.0

    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    pyro.clear_param_store()
    x, y = data()
    guide = Shifted(small_model())
    values = guide(x, y)
    assert len(guide._param_names()) == 3
    for site in guide.layout:
        torch.testing.assert_close(values[site.name], guide.loc[site.slice].view(site.shape) + 1)
