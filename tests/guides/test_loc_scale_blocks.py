"""The location-scale guides process their sites in blocks (pyro_bdl/guides/base.py), one (2, n)
parameter per block: every site is still drawn from its own posterior, with gradients reaching
its block's parameter, and guide.loc / guide.rho show all blocks as one flat vector."""

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
    totals, blocks, flat = guide._blocks()
    assert blocks == [[30], [6, 18], [3]] and totals == [30, 24, 3] and all(flat)
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
    # One parameter per block, views of the flat (2, D) tensor that guide.loc/guide.rho show.
    params = [guide.loc_rho, guide.loc_rho_1, guide.loc_rho_2]
    assert [n for n, _ in guide.named_parameters()] == ["loc_rho", "loc_rho_1", "loc_rho_2"]
    assert [p.shape[1] for p in params] == totals
    assert torch.equal(torch.cat([p.detach() for p in params], 1)[1], guide.rho)
    # d(Σ values)/dμ = 1 and d(Σ values)/dρ = ξ·sigmoid(ρ), through every block.
    g_loc, g_rho = torch.cat(torch.autograd.grad(values.sum(), params), dim=1)
    torch.testing.assert_close(g_loc, torch.ones_like(g_loc))
    torch.testing.assert_close(g_rho, noise.detach() * torch.sigmoid(guide.rho.detach()))


#: Losses of four SVI steps and position-weighted sums of the final loc and ρ (float.hex) of
#: :func:`test_numerics_are_pinned`, recorded on CPU with one thread (torch 2.x, x86-64), with
#: the blocks' fused autograd node and softplus (pyro_bdl/guides/block_sites.py).
PINNED = {
    "AutoMeanField": (
        ["0x1.6fc5cc0000000p+7", "0x1.6e629e0000000p+7", "0x1.6b20f80000000p+7"],
        "-0x1.8529db6c80000p+3",
        "-0x1.2fd2732f40000p+12",
    ),
    "AutoRadial": (
        ["0x1.2ab6480000000p+8", "0x1.2855620000000p+8", "0x1.25f0de0000000p+8"],
        "-0x1.6ff63da380000p+3",
        "-0x1.2fce56ea00000p+12",
    ),
}


@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
def test_numerics_are_pinned(monkeypatch, guide_cls):
    # The storage of the parameters (one tensor or one per block) is an implementation detail:
    # the same seed must give the same bits through sampling, the ELBO and Adam. Several blocks
    # (BLOCK_NUMEL = 24), so the per-block draws and updates are pinned too. Exact equality: a
    # change in how random numbers are consumed or in an update's arithmetic shows here (a
    # different torch build or CPU may change the last bits; re-record PINNED then).
    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    model = small_model()
    guide = guide_cls(model, init_scale=0.05)
    x, y = data()
    svi = pyro.infer.SVI(
        model, guide, pyro.optim.Adam({"lr": 1e-2}), pyro.infer.TraceMeanField_ELBO()
    )
    losses = [svi.step(x[:8], y[:8]).hex() for _ in range(3)]
    with torch.no_grad():
        weights = torch.arange(1, guide.loc.numel() + 1, dtype=torch.float64)
        loc_sum = float((guide.loc.double() * weights).sum()).hex()
        rho_sum = float((guide.rho.double() * weights).sum()).hex()
    assert (losses, loc_sum, rho_sum) == PINNED[guide_cls.__name__]


@pytest.mark.parametrize("guide_cls", [AutoMeanField, AutoRadial])
def test_a_state_saved_with_one_packed_parameter_loads_into_blocks(monkeypatch, guide_cls):
    # Guides saved before the split hold one (2, D) ``loc_rho``: it loads into the blocks.
    model = small_model()
    x, y = data()
    old = guide_cls(model)
    old(x, y)
    with torch.no_grad():
        old.loc.uniform_(-1.0, 1.0)
        old.rho.uniform_(-3.0, -1.0)
    state = old.state_dict()
    assert list(state) == ["loc_rho"] and state["loc_rho"].shape == (2, 57)
    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    pyro.clear_param_store()
    new = guide_cls(model)
    new(x, y)
    new.load_state_dict(state)
    assert torch.equal(new.loc, old.loc) and torch.equal(new.rho, old.rho)
    assert torch.equal(new.loc_rho_1.detach(), state["loc_rho"][:, 30:54])
    assert all(
        torch.equal(a, b)
        for a, b in zip(new.quantiles([0.3]).values(), old.quantiles([0.3]).values())
    )
    assert list(state) == ["loc_rho"]  # the caller's dict is left as it was


def test_blocks_stay_one_flat_vector_after_a_dtype_change(monkeypatch):
    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    model = small_model()
    x, y = data()
    guide = AutoMeanField(model)
    guide(x, y)
    before = guide.loc.clone()
    guide.double()  # gives every parameter a storage of its own
    assert guide.loc.dtype == torch.float64 and torch.equal(guide.loc, before.double())
    with torch.no_grad():
        guide.loc.zero_()  # writes reach the parameters again
    assert not guide.loc_rho_2[0].any()


def test_a_checkpoint_saved_with_one_packed_parameter_resumes_in_blocks(monkeypatch, tmp_path):
    from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint

    model = small_model()
    x, y = data()
    guide, optim = AutoMeanField(model), pyro.optim.Adam({"lr": 1e-2})
    svi = pyro.infer.SVI(model, guide, optim, pyro.infer.TraceMeanField_ELBO())
    for _ in range(2):
        svi.step(x, y)
    path = str(tmp_path / "run.ckpt")
    save_checkpoint(path, guide=guide, optim=optim, step=2)
    moments = optim.get_state()["AutoMeanField.loc_rho"]["state"][0]

    monkeypatch.setattr(base, "BLOCK_NUMEL", 24)
    pyro.clear_param_store()
    new, new_optim = AutoMeanField(model), pyro.optim.Adam({"lr": 1e-2})
    state = load_checkpoint(path, guide=new, optim=new_optim, example_args=(x, y))
    assert state["optim_restored"]
    assert torch.equal(new.loc, guide.loc) and torch.equal(new.rho, guide.rho)
    assert sorted(k for k in pyro.get_param_store() if "loc_rho" in k) == [
        "AutoMeanField.loc_rho",
        "AutoMeanField.loc_rho_1",
        "AutoMeanField.loc_rho_2",
    ]
    # The optimizer's moments are split with the parameter; the next step consumes them.
    pyro.infer.SVI(model, new, new_optim, pyro.infer.TraceMeanField_ELBO()).step(x, y)
    got = new_optim.get_state()
    assert [got[f"AutoMeanField.{n}"]["state"][0]["step"] for n in new._param_names()] == [3] * 3
    waiting = torch.cat(
        [
            got[f"AutoMeanField.{n}"]["state"][0]["exp_avg_sq"]
            for n in ["loc_rho", "loc_rho_1", "loc_rho_2"]
        ],
        dim=1,
    )
    # Adam's second moment after one more step: β₂·v + (1 − β₂)·g², so at least β₂·v.
    assert bool((waiting >= 0.999 * moments["exp_avg_sq"] * (1 - 1e-6)).all())
