"""A Laplace fit under ``torch.autocast`` (bfloat16 on the CPU): the network runs in bfloat16,
but the curvature is accumulated in float32 or float64, never in bfloat16, and the posterior is
the float32 one to within the rounding of the bfloat16 forward pass."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.curvature.ggn import diagonal_ggn, output_hessian_factor
from pyro_bdl.curvature.jacobian import ParamSlot, subnet_jacobian
from pyro_bdl.guides import AutoSubnetLaplace
from tests.common import assert_close

#: bfloat16's unit round-off, 2⁻⁸ (8 significand bits).
BF16_U = 2.0**-8


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(40, 3, generator=g), torch.randint(0, 2, (40,), generator=g)


def _variances(structure: str, autocast: bool) -> torch.Tensor:
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(1.0)), 40)
    guide = AutoSubnetLaplace(model, subnetwork="all", hessian_structure=structure)
    x, y = _data()
    guide(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        guide.fit((x, y), check_mode=False)
    return guide.posterior.variances()


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_an_autocast_fit_matches_the_float32_fit(structure):
    """Tolerance: each Jacobian entry of this 2-layer net passes at most 4 bfloat16 roundings
    (the input cast, the matmul, tanh, the backward matmul), so it is off by ≤ 4u relatively;
    a GGN entry is a sum of products of two of them (≤ 8u), and with the prior λ = 1 bounding
    H below, the variances, entries of H⁻¹, inherit that relative error: rtol 8u ≈ 0.031."""
    exact, mixed = _variances(structure, False), _variances(structure, True)
    assert mixed.dtype in (torch.float32, torch.float64)
    assert_close(mixed, exact, rtol=8 * BF16_U, atol=0.0)


def test_the_accumulating_passes_never_accumulate_in_bfloat16():
    """Under autocast the network's outputs are bfloat16; the diagonal GGN, the Jacobian and the
    output Hessian factor come back in float32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, _ = _data()
    slots = [
        ParamSlot(p, net[int(name.split(".")[0])], name.split(".")[1])
        for name, p in net.named_parameters()
    ]

    def forward():
        return net(x)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert forward().dtype == torch.bfloat16
        factor = lambda f: output_hessian_factor(f, "categorical")  # noqa: E731
        assert factor(forward()).dtype == torch.float32
        assert diagonal_ggn(forward, slots, factor).dtype == torch.float32
        jac = subnet_jacobian(forward, slots, torch.arange(10))
        assert jac.dtype == torch.float32
