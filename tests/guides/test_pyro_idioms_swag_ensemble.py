"""AutoSWAG, AutoEnsemble and AutoMultiSWAG under Pyro's own idioms: traced guides, ELBO
evaluation after collection, Predictive, param-store naming, checkpoints, and float32 weights
far from zero."""

from __future__ import annotations

import os
import tempfile
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.guides import AutoEnsemble, AutoMultiSWAG, AutoSWAG
from pyro_bdl.guides.swag import NotCollectedError
from pyro_bdl.infer import TraceSuffStat_ELBO
from tests.faults.common import assert_same, rng_states
from tests.guides.test_contract import BATCH, data, small_model


def _train_delta(k: int, x, y, *, clear: bool = True):
    """Member k: a fresh model and AutoDelta, trained a few steps (the store cleared first)."""
    pyro.set_rng_seed(k)
    if clear:
        pyro.clear_param_store()
    model = small_model(k)
    guide = AutoDelta(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 5e-2}), Trace_ELBO())
    for _ in range(3):
        svi.step(x[:BATCH], y[:BATCH])
    return model, guide


def _train_swag(k: int, x, y, *, collections: int = 3):
    pyro.set_rng_seed(k)
    pyro.clear_param_store()
    model = small_model(k)
    guide = AutoSWAG(model, rank=2)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 5e-2}), Trace_ELBO())
    for _ in range(collections):
        svi.step(x, y)
        guide.collect()
    return model, guide, svi


# ----------------------------------------------------------------------------- tracing


def _draws_of_traced(guide, x, y, calls: int) -> torch.Tensor:
    site = guide.layout.names[0]
    traced = pyro.ops.jit.trace(lambda: guide(x, y)[site], ignore_warnings=True)
    with warnings.catch_warnings():
        # torch deprecates torch.jit.trace, which Pyro's JIT (and JitTrace_ELBO) still uses.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.stack([traced().detach().reshape(-1) for _ in range(calls)])


def test_a_traced_ensemble_draws_every_member_on_later_calls():
    x, y = data()
    members = [_train_delta(k, x, y)[1].median() for k in range(3)]
    guide = AutoEnsemble(small_model(0), members)
    guide(x, y)
    site = guide.layout.names[0]
    known = torch.stack([m[site].reshape(-1) for m in members])
    pyro.set_rng_seed(0)
    draws = _draws_of_traced(guide, x, y, 30)
    # Every draw is one member's value, and the trace does not freeze the first one: with 30
    # uniform draws of 3 members, P(some member never drawn) ≤ 3·(2/3)^30 ≈ 1.6e-5.
    picked = [(known == d).all(-1).nonzero().flatten().tolist() for d in draws]
    assert all(len(p) == 1 for p in picked)
    assert {p[0] for p in picked} == {0, 1, 2}


def test_a_traced_multiswag_keeps_drawing_after_its_first_call():
    x, y = data()
    members = [_train_swag(k, x, y)[1] for k in range(2)]
    guide = AutoMultiSWAG(small_model(0), members)
    guide(x, y)
    pyro.set_rng_seed(0)
    draws = _draws_of_traced(guide, x, y, 10)
    # Continuous Gaussian draws: two equal rows have probability 0.
    assert torch.isfinite(draws).all()
    assert len({tuple(d.tolist()) for d in draws}) == len(draws)


# ----------------------------------------------------------------------------- SWAG roles


def test_evaluate_loss_after_collect_scores_the_point_being_trained():
    x, y = data()
    model, guide, svi = _train_swag(0, x, y)
    assert guide.num_collected == 3
    guide.mode = "point"
    expected = svi.evaluate_loss(x, y)
    guide.mode = "auto"
    before = rng_states()
    # The point estimate is deterministic: no draw, so the random state does not move either.
    assert svi.evaluate_loss(x, y) == expected
    assert TraceSuffStat_ELBO(num_kl_samples=4).loss(model, guide, x, y) == pytest.approx(
        expected,
        rel=1e-6,  # the same log-densities summed in another order (float32)
    )
    assert_same(before, rng_states())


def test_predictive_after_collect_still_draws_the_swag_posterior():
    x, y = data()
    model, guide, _ = _train_swag(0, x, y)
    predictive = Predictive(model, guide=guide, num_samples=4, return_sites=["_RETURN"])
    logits = predictive(x)["_RETURN"]
    assert not torch.equal(logits[0], logits[1])
    guide.mode = "point"
    logits = predictive(x)["_RETURN"]
    assert torch.equal(logits[0], logits[1])


def test_sampling_is_explicit_and_refused_before_two_collections():
    x, y = data()
    _, guide, svi = _train_swag(0, x, y, collections=1)
    with pytest.raises(NotCollectedError, match=r"cannot sample its posterior after 1 collect"):
        with guide.sampling():
            pass
    assert guide.mode == "auto"
    svi.step(x, y)
    guide.collect()
    with torch.no_grad(), guide.sampling():
        a, b = guide(x, y), guide(x, y)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():  # outside the block, grad mode or not: the point estimate
        c = guide(x, y)
    loc = guide.layout.unpack(guide.loc.detach())
    assert all(torch.equal(c[k], loc[k].reshape(c[k].shape)) for k in c)


def test_multiswag_members_follow_their_mode():
    x, y = data()
    members = [_train_swag(k, x, y)[1] for k in range(2)]
    guide = AutoMultiSWAG(small_model(0), members)
    guide(x, y)
    members[1].mode = "point"
    posteriors = guide.member_posteriors()
    assert isinstance(posteriors[1], dist.Delta)
    assert torch.equal(posteriors[1].v, members[1].loc.detach())
    assert not isinstance(posteriors[0], dist.Delta)


# ----------------------------------------------------------------------------- param store


def test_ensemble_of_guides_trained_after_clearing_the_store_keeps_distinct_members():
    x, y = data()
    guides, expected = [], []
    for k in range(3):
        _, guide = _train_delta(k, x, y)
        guides.append(guide)
        expected.append(guide.median())  # right after training: this member's own values
    model = small_model(0)
    from_guides = AutoEnsemble(model, guides)
    from_dicts = AutoEnsemble(model, expected)
    from_guides(x, y)
    from_dicts(x, y)
    assert torch.equal(from_guides.ensemble_locs, from_dicts.ensemble_locs)
    locs = from_guides.ensemble_locs
    assert not torch.equal(locs[0], locs[1]) and not torch.equal(locs[1], locs[2])


def test_multiswag_checkpoint_loads_into_a_fresh_guide():
    x, y = data()
    members = [_train_swag(k, x, y)[1] for k in range(2)]
    guide = AutoMultiSWAG(small_model(0), members)
    guide(x, y)
    assert "AutoSWAG.loc" not in pyro.get_param_store()  # the members' now, not the store's
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "multiswag.ckpt")
        save_checkpoint(path, guide=guide)
        pyro.clear_param_store()
        fresh = AutoMultiSWAG(small_model(0), 2, rank=2)
        load_checkpoint(path, guide=fresh, example_args=(x, y))
    assert_same(dict(guide.state_dict()), dict(fresh.state_dict()))


# ----------------------------------------------------------------------------- float32


@pytest.mark.parametrize("diag_only", [True, False])
def test_float32_weights_far_from_zero_get_accurate_variances(diag_only):
    d, t = 1000, 20

    def model():
        pyro.sample("theta", dist.Normal(torch.zeros(d), 1.0).to_event(1))

    guide = AutoSWAG(model, rank=4, diag_only=diag_only)
    guide()
    g = torch.Generator().manual_seed(0)
    base = 1e4 * (1 + torch.rand(d, generator=g, dtype=torch.float64))
    iterates = (base + 1e-3 * torch.randn(t, d, generator=g, dtype=torch.float64)).float()
    for theta in iterates:
        with torch.no_grad():
            guide.loc.copy_(theta)
        guide.collect()
    exact = iterates.double().var(0, unbiased=False)  # of the float32 snapshots themselves
    got = guide.swag_m2.double() / t
    # θ̄ in float64 makes each deviation exact to ~1e-16 relative; stored in float32 each is off
    # by ≤ u = 6e-8 relative, and the float32 sum of T = 20 squares by ≲ T·u = 1.2e-6: 1e-5
    # leaves a factor 8. (A float32 mean is off by up to 5e-4, half the spacing at 1e4, about
    # the deviations' own size: errors of 50% and more.)
    assert float(((got - exact).abs() / exact).max()) < 1e-5
    assert guide.swag_mean.dtype == torch.float64
    assert guide.get_posterior().sample().dtype == torch.float32
    assert guide.median()["theta"].dtype == torch.float32
