"""The location-scale guides process their sites in blocks (pyro_bdl/guides/base.py): every site
is still drawn from its own posterior, with gradients reaching the one (2, D) parameter."""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro import poutine

from pyro_bdl.guides import AutoMeanField, AutoRadial, base
from tests.guides.test_contract import data, small_model


@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
def test_sites_in_several_blocks_are_drawn_and_differentiated_per_site(monkeypatch, guide_cls):
    # Blocks of at most 24 numbers: the 4 sites of the small MLP (30, 6, 18, 3 weights) fall in
    # 3 blocks, the 30-weight site alone (a site is never cut), 6 + 18 together.
    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    pyro.clear_param_store()
    model = small_model()
    guide = guide_cls(model)
    x, y = data()
    guide(x, y)
    totals, blocks = guide._blocks()
    assert blocks == [[30], [6, 18], [3]] and totals == [30, 24, 3]
    with torch.no_grad():
        guide.rho.uniform_(-3.0, -1.0)  # distinct scales, so a wrong pairing shows
    trace = poutine.trace(guide).get_trace(x, y)
    values = torch.cat([trace.nodes[s.name]["value"].reshape(-1) for s in guide.layout])
    noise = (values - guide.loc) / guide.scale
    # Every block drew fresh noise (no block repeats another's draw).
    parts = noise.detach().split(guide.layout.sizes)
    assert len({round(float(p[0]), 6) for p in parts}) == len(parts)
    if guide_cls is AutoRadial:
        # One radius per site: the site's noise is r·ε/‖ε‖, so its norm is |r|, a N(0, 1) draw
        # per site (distinct across sites with probability 1).
        norms = [float(p.norm()) for p in parts]
        assert len({round(n, 6) for n in norms}) == len(norms)
    # d(Σ values)/dμ = 1 and d(Σ values)/dρ = ξ·sigmoid(ρ), through every block.
    g_loc, g_rho = torch.autograd.grad(values.sum(), [guide.loc, guide.rho])
    torch.testing.assert_close(g_loc, torch.ones_like(g_loc))
    torch.testing.assert_close(g_rho, noise.detach() * torch.sigmoid(guide.rho.detach()))
