"""AutoEnsemble and AutoMultiSWAG: draws are members, the member predictive is the exact mixture,
the moments, state round trips, refused inputs; and the guide contract of
tests/guides/test_contract.py run on both guides."""

from __future__ import annotations

import importlib
import sys
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from scipy.stats import binom, chi2
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import AutoEnsemble, AutoMultiSWAG, AutoSWAG, ensemble
from pyro_bdl.guides.ensemble import MemberMixture
from pyro_bdl.guides.state_checks import StateDictMismatchError
from pyro_bdl.guides.swag import NotCollectedError
from pyro_bdl.predictive import sample_outputs
from tests.common import assert_close, rows_per_forward
from tests.guides import test_contract as contract
from tests.guides.test_contract import (  # noqa: F401  (collected here with this module's cases)
    Case,
    GuideEntry,
    test_get_posterior,
    test_median,
    test_predictive,
    test_quantiles,
    test_sites_and_shapes,
    test_state_dict_round_trip,
    test_subsampled_minibatches,
    test_torch_save_round_trip,
)

M = 3


def train_delta(model, x, y, steps: int = 3):
    guide = AutoDelta(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for step in range(steps):
        rows = slice(step * contract.BATCH, (step + 1) * contract.BATCH)
        svi.step(x[rows], y[rows])
    return guide


def train_swag(model, x, y):
    guide = AutoSWAG(model, rank=3)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for step in range(6):
        rows = slice((step * contract.BATCH) % contract.N, (step * contract.BATCH) % contract.N + 8)
        svi.step(x[rows], y[rows])
        guide.collect()
    return guide


def _build(models_out: list):
    def build():
        model = contract.small_model(seed=int(torch.randint(1000, ())))
        models_out.append(model)
        return model

    return build


def _make(cls, train, num_members: int):
    """``(model of member 0, guide of cls)`` over ``num_members`` members trained by ``train``."""
    x, y = contract.data()
    built: list = []
    guide = cls.from_training(_build(built), lambda model: train(model, x, y), num_members)
    return built[0], guide


def make_ensemble(num_members: int = M):
    return _make(AutoEnsemble, train_delta, num_members)


def make_multiswag(num_members: int = M):
    return _make(AutoMultiSWAG, train_swag, num_members)


def _case(make) -> Case:
    pyro.set_rng_seed(0)  # the factories must rebuild the same members
    model, guide = make(5)  # five members: two draws rarely coincide (the predictive test)
    return Case(model, guide, lambda x, y: guide(x, y))


GUIDES = [
    GuideEntry("ensemble", lambda: _case(make_ensemble), posterior="flat"),
    GuideEntry("multiswag", lambda: _case(make_multiswag), posterior="flat"),
]


@pytest.fixture(params=GUIDES, ids=lambda e: e.name)
def fitted(request):
    """The contract's fixture, over this module's guides."""
    x, y = contract.data()
    case = request.param.make()
    case.fit(x, y)
    return request.param, case, x[: contract.BATCH], y[: contract.BATCH]


def _set_up(made):
    """Set the guide of ``(model, guide)`` up on the model's sites; returns the pair."""
    x, y = contract.data()
    made[1](x[:4], y[:4])
    return made


# ----------------------------------------------------------------------------- draws and outputs


def test_members_are_trained_independently():
    _model, guide = _set_up(make_ensemble())
    locs = guide.ensemble_locs
    for j in range(M):
        for k in range(j):
            assert not torch.equal(locs[j], locs[k]), (j, k)


def test_from_training_is_the_documented_loop_bit_for_bit():
    # docs/methods/swag_ensembles.md's loop: seed k, clear the store, build, train, copy.
    x, y = contract.data()

    def build():
        return contract.small_model(seed=int(torch.randint(1000, ())))  # drawn under seed k

    joined = AutoEnsemble.from_training(build, lambda m: train_delta(m, x, y), M, seed=0)
    members = []
    for k in range(M):
        pyro.set_rng_seed(k)
        pyro.clear_param_store()
        model = build()
        members.append(train_delta(model, x, y).median())
    looped = AutoEnsemble(model, members)
    for guide in (joined, looped):
        guide(x[:4], y[:4])
    assert torch.equal(joined.ensemble_locs, looped.ensemble_locs)


def test_every_draw_is_a_member_and_members_are_picked_uniformly():
    _model, guide = _set_up(make_ensemble())
    n = 3000
    draws = guide.get_posterior().sample((n,))
    match = (draws.unsqueeze(1) == guide.ensemble_locs).all(-1)  # (n, M)
    assert (match.sum(1) == 1).all()  # each draw is exactly one member
    counts = match.sum(0)
    # Each count is Binomial(n, 1/M); a two-sided 1e-4 band per member (3 members: the test
    # fails by chance with probability < 3e-4 — and the seed is fixed).
    lo, hi = binom.ppf(5e-5, n, 1 / M), binom.isf(5e-5, n, 1 / M)
    assert ((counts >= lo) & (counts <= hi)).all(), counts


def _gaussians_or_points(kind: str, count: int) -> list:
    """``count`` members 100 apart (member k near 100·k), Gaussians of scale 1 or points."""
    locs = [torch.full((2,), 100.0 * k) for k in range(count)]
    if kind == "points":
        return [pyro.distributions.Delta(loc, event_dim=1) for loc in locs]
    return [pyro.distributions.Normal(loc, 1.0).to_event(1) for loc in locs]


@pytest.mark.parametrize("path", ["points", "gaussians", "traced"])
def test_mixture_picks_its_members_with_equal_weights(path):
    # Each sampling path of MemberMixture: gathered point masses, Gaussians drawn member by
    # member, and the traced gather, whose later calls must draw other members.
    count, n = 4, 4000
    mix = MemberMixture(_gaussians_or_points("points" if path == "points" else "normal", count))
    if path == "traced":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
            draw = torch.jit.trace(
                lambda t: mix.sample((n // 2,)) + t, torch.zeros(()), check_trace=False
            )
        draws = torch.cat([draw(torch.zeros(())), draw(torch.zeros(()))])
    else:
        draws = mix.sample((n,))
    # A Gaussian draw lies within 50 of its member's location but for a 50σ tail.
    member = (draws[:, 0] / 100).round().long()
    counts = torch.bincount(member, minlength=count).double()
    assert counts.numel() == count
    if path == "traced":  # the second call picked anew (equal picks: chance 4^-2000)
        assert not torch.equal(member[: n // 2], member[n // 2 :])
    # Pearson's statistic of the counts against n/M each is χ²(M − 1) under equal weights; its
    # 1 − 1e-4 quantile fails by chance once in 10⁴ runs (and the seed is fixed).
    statistic = float(((counts - n / count) ** 2 / (n / count)).sum())
    assert statistic < chi2.isf(1e-4, count - 1), counts


def test_member_outputs_are_each_members_network_exactly():
    model, guide = _set_up(make_ensemble())
    x, _ = contract.data()
    out = guide.member_outputs(model, x)
    assert out.shape == (M, 1, contract.N, contract.CLASSES)
    for k in range(M):
        values = guide.layout.unpack(guide.ensemble_locs[k])
        expected = pyro.poutine.condition(model.net, data=values)(x)
        assert_close(out[k, 0], expected)


def test_multiswag_member_outputs_are_the_members_own_predictives():
    # The exact mixture: member k's draws are those of member k's own AutoSWAG under the same
    # random stream, so averaging over members weights each member's predictive 1/M.
    model, guide = _set_up(make_multiswag())
    x, _ = contract.data()
    pyro.set_rng_seed(5)
    mixed = guide.member_outputs(model, x, num_samples=4)
    pyro.set_rng_seed(5)
    own = torch.stack([sample_outputs(model, m, x, num_samples=4) for m in guide.members])
    assert_close(mixed, own)
    assert not torch.equal(mixed[0], mixed[1])


@pytest.mark.parametrize("make", [make_ensemble, make_multiswag], ids=["ensemble", "multiswag"])
def test_member_outputs_run_all_members_in_one_pass(make):
    # Parallel: a one-row pass checks the output's memory (the first call on rows of this
    # shape only), then ONE pass of the network for the M · S draws; sequential: one full pass
    # per draw, no check of its own.
    model, guide = _set_up(make())
    x, _ = contract.data()
    rows, handle = rows_per_forward(model.net)
    try:
        out = guide.member_outputs(model, x, num_samples=2)
        assert out.shape == (M, 2, contract.N, contract.CLASSES)
        assert rows == [1, contract.N]
        rows.clear()
        guide.member_outputs(model, x, num_samples=2)  # the output size is known now
        assert rows == [contract.N]
        rows.clear()
        guide.member_outputs(model, x, num_samples=2, parallel=False)
        assert rows == [contract.N] * (M * 2)
        rows.clear()
        guide.member_outputs(model, x, num_samples=2, max_parallel=4)  # chunks of 4 and 2
        assert rows == [contract.N, contract.N]
    finally:
        handle.remove()


def test_parallel_member_outputs_equal_the_sequential_ones_exactly():
    # Point masses: member m's draws are member m's network, whichever pass computes them;
    # chunks of 4 + 2 and 5 + 1 (a one-draw chunk is a plain draw) put each where it belongs.
    model, guide = _set_up(make_ensemble())
    x, _ = contract.data()
    sequential = guide.member_outputs(model, x, num_samples=2, parallel=False)
    assert not torch.equal(sequential[0], sequential[1])
    assert torch.equal(sequential[:, 0], sequential[:, 1])
    for max_parallel in (None, 4, 5):
        parallel = guide.member_outputs(model, x, num_samples=2, max_parallel=max_parallel)
        assert torch.equal(parallel, sequential), max_parallel


def test_multiswag_parallel_and_sequential_member_outputs_agree_in_distribution():
    model, guide = _set_up(make_multiswag())
    x, _ = contract.data()
    pyro.set_rng_seed(6)
    s = 200
    par = guide.member_outputs(model, x, num_samples=s).softmax(-1)
    seq = guide.member_outputs(model, x, num_samples=s, parallel=False).softmax(-1)
    # Sequential: member m's draws are those of its own AutoSWAG drawn one by one.
    pyro.set_rng_seed(7)
    own = [sample_outputs(model, m, x, num_samples=3, parallel=False) for m in guide.members]
    pyro.set_rng_seed(7)
    assert_close(guide.member_outputs(model, x, num_samples=3, parallel=False), torch.stack(own))
    # Per member, the means of two independent s-draw estimates differ with standard error
    # sqrt((var_par + var_seq) / s) per entry; 6 SE over M · N · C = 360 entries makes a false
    # failure below 360 · 2e-9 for Gaussian means (s = 200: the CLT is accurate for probabilities).
    assert par.std(1).amax() > 0  # the draws differ: a distribution, not a point
    se = ((par.var(1) + seq.var(1)) / s).sqrt()
    assert ((par.mean(1) - seq.mean(1)).abs() <= 6 * se + 1e-6).all()
    # ... and member m's draws are member m's: the members' predictives are told apart.
    assert ((par.mean(1)[0] - seq.mean(1)[1]).abs() > 6 * se[0] + 1e-6).any()


@pytest.mark.parametrize("make", [make_ensemble, make_multiswag], ids=["ensemble", "multiswag"])
@pytest.mark.parametrize("parallel", [True, False])
def test_member_outputs_refused_for_memory_change_nothing(make, parallel):
    # 3 members x 10**6 draws of (40, 3) float32 outputs: 1.44e9 bytes, above a 1e9 bound. The
    # check runs before any member's draws: one pass on one row (parallel) or the first draw.
    model, guide = _set_up(make())
    x, _ = contract.data()
    state = {k: v.clone() for k, v in guide.state_dict().items()}
    rng = torch.get_rng_state()
    rows, handle = rows_per_forward(model.net)
    try:
        with pytest.raises(ValueError, match=r"num_samples=3000000 .* need 1440000000 bytes"):
            guide.member_outputs(model, x, num_samples=10**6, parallel=parallel, max_memory=10**9)
    finally:
        handle.remove()
    assert rows == ([1] if parallel else [contract.N])
    assert torch.equal(torch.get_rng_state(), rng)
    after = guide.state_dict()
    assert state.keys() == after.keys()
    assert all(torch.equal(v, after[k]) for k, v in state.items())
    assert guide.member is None


@pytest.mark.gpu
@pytest.mark.parametrize("make", [make_ensemble, make_multiswag], ids=["ensemble", "multiswag"])
def test_member_outputs_on_cuda_match_the_cpu(make):
    # The member order lives on the host; each draw's member is gathered on the device.
    model, guide = _set_up(make())
    x, _ = contract.data()
    pyro.set_rng_seed(3)
    cpu = guide.member_outputs(model, x, num_samples=2)
    model.net.to("cuda")  # the lifted network's initial values and the priors follow it
    guide.to("cuda")
    pyro.set_rng_seed(3)
    cuda = guide.member_outputs(model, x.cuda(), num_samples=2)
    sequential = guide.member_outputs(model, x.cuda(), num_samples=2, parallel=False)
    assert cuda.device.type == "cuda"
    if make is make_ensemble:  # point masses: the same networks (cuBLAS may add in other orders)
        assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-5)
        assert_close(cuda, sequential, rtol=1e-4, atol=1e-5)
    else:  # the CUDA generator draws other numbers: same shape, distinct members
        assert cuda.shape == cpu.shape and not torch.allclose(cuda[0], cuda[1])


def test_a_member_per_draw_is_checked():
    _model, guide = _set_up(make_ensemble())
    with pytest.raises(ValueError, match=r"member indices in \[0, 3\)"):
        guide.member = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        guide.member = torch.tensor([0.0, 1.0])
    posterior = MemberMixture(guide.member_posteriors(), member=torch.tensor([2, 0, 2]))
    assert torch.equal(posterior.expand((3, 1)).sample().squeeze(1), guide.ensemble_locs[[2, 0, 2]])
    with pytest.raises(ValueError, match="members of 3 draws, but 4 are drawn"):
        posterior.sample((4,))
    # log_prob: each draw's own member's (a point mass: 0 at it, -inf elsewhere).
    values = guide.ensemble_locs[[2, 1, 2]]
    assert posterior.log_prob(values).tolist() == [0.0, float("-inf"), 0.0]


def test_sample_outputs_draw_from_every_member():
    model, guide = _set_up(make_ensemble())
    x, _ = contract.data()
    draws = sample_outputs(model, guide, x, num_samples=60)
    members = guide.member_outputs(model, x)[:, 0]  # (M, N, C)
    which = (draws.unsqueeze(1) - members).abs().amax((-1, -2)) < 1e-5  # (60, M)
    assert (which.sum(1) == 1).all()
    # P(some member never drawn in 60) ≤ 3 · (2/3)^60 ≈ 1e-10.
    assert which.any(0).all()


def test_moments_are_the_mixtures():
    _model, guide = _set_up(make_multiswag())
    means = torch.stack([m.get_posterior().mean for m in guide.members])
    variances = torch.stack([m.get_posterior().variance for m in guide.members])
    loc, scale = guide.flat_loc_scale()
    assert_close(loc, means.mean(0))
    # Law of total variance, written the other way round: E[σ²] + E[μ²] − E[μ]². In float32
    # E[μ²] − E[μ]² cancels: round-off ~ ε·max μ² ≈ 1.2e-7 · 0.12 = 1.5e-8 absolute (1.7e-8
    # measured, 2.9e-5 of the smallest variance), so atol 1e-7 with rtol 1e-4 is ≥ 6× that.
    expected = variances.mean(0) + means.square().mean(0) - means.mean(0).square()
    assert_close(scale.square(), expected, rtol=1e-4, atol=1e-7)


def test_mixture_log_prob_and_fixed_member():
    points = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    members = [pyro.distributions.Delta(p, event_dim=1) for p in points]
    mix = MemberMixture(members)
    assert_close(mix.log_prob(points), torch.full((2,), -torch.log(torch.tensor(2.0))))
    assert mix.log_prob(torch.tensor([5.0, 5.0])) == float("-inf")
    fixed = MemberMixture(members, member=1).expand((4,))
    assert_close(fixed.sample(), points[1].expand(4, 2))
    with pytest.raises(ValueError, match="member must be"):
        MemberMixture(members, member=2)


# ----------------------------------------------------------------------------- state


def test_state_of_another_size_is_refused_whole():
    model, guide = _set_up(make_ensemble())
    _, other = _set_up((model, AutoEnsemble(model, M + 1)))
    before = other.ensemble_locs.clone()
    with pytest.raises(StateDictMismatchError, match="ensemble_locs"):
        other.load_state_dict(guide.state_dict())
    assert torch.equal(other.ensemble_locs, before)
    _, same = _set_up((model, AutoEnsemble(model, M)))
    same.load_state_dict(guide.state_dict())
    assert torch.equal(same.ensemble_locs, guide.ensemble_locs)


def test_multiswag_state_of_another_rank_is_refused_whole():
    model, guide = _set_up(make_multiswag())
    _, other = _set_up((model, AutoMultiSWAG(model, M, rank=4)))
    with pytest.raises(StateDictMismatchError, match=r"members\.0\.swag_deviations"):
        other.load_state_dict(guide.state_dict())
    assert all(m.num_collected == 0 for m in other.members)


def test_state_dict_before_the_first_call_is_refused_not_empty():
    # The members wait unpacked until the guide sees the model: a state saved before would be
    # empty and load into nothing, also where the guide sits inside another module.
    model, guide = make_ensemble()
    for owner in (guide, nn.ModuleDict({"guide": guide})):
        with pytest.raises(RuntimeError, match=r"call the guide once .* before state_dict\(\)"):
            owner.state_dict()
    _set_up((model, guide))
    assert guide.state_dict()["ensemble_locs"].shape[0] == M


@pytest.mark.parametrize("make", [make_ensemble, make_multiswag], ids=["ensemble", "multiswag"])
def test_member_outputs_before_the_first_call_names_the_call(make):
    # Without the targets the set-up would read them as a latent site (Pyro's "discrete sample
    # site 'y'"), so member_outputs does not set the guide up.
    model, guide = make()
    x, _ = contract.data()
    with pytest.raises(RuntimeError, match=r"guide\(x, y\)\) before member_outputs"):
        guide.member_outputs(model, x[:4])
    assert guide.prototype_trace is None


# ----------------------------------------------------------------------------- refused inputs


def _values(seed: int, width: int = 6):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(contract.FEATURES, width), nn.Tanh(), nn.Linear(width, 3))
    values = {name: p.detach().clone() for name, p in net.named_parameters()}
    bnn = bayesianize(net, priors.Normal(scale=1.0))
    return models.classifier(bnn, contract.N), values


@pytest.mark.parametrize(
    ("members", "error", "match"),
    [
        (0, ValueError, "members must be >= 1"),
        ([], ValueError, r"M = 0"),
        (True, TypeError, "bool"),
        ({"a": 1}, TypeError, "members must be a list"),
        ([object()], TypeError, r"members\[0\] must be a dict"),
        ([{"0.weight": 1.0}], TypeError, "must be a tensor"),
    ],
)
def test_bad_members_are_refused(members, error, match):
    model, _ = _values(0)
    with pytest.raises(error, match=match):
        AutoEnsemble(model, members)


def test_a_member_guide_that_never_ran_is_refused():
    # Its median() would call the model without arguments (a TypeError of the model's).
    model, _ = _values(0)
    with pytest.raises(ValueError, match=r"members\[0\] is an AutoDelta that has not seen the"):
        AutoEnsemble(model, [AutoDelta(model)])


def test_identical_members_are_refused():
    # A build() that seeds its own network: every member starts alike and, trained without
    # noise on the same batches, ends alike (an ensemble of one run counted M times).
    x, y = contract.data()
    with pytest.raises(ValueError, match=r"members\[0\] and members\[1\] hold the same weights"):
        AutoEnsemble.from_training(
            lambda: contract.small_model(0), lambda m: train_delta(m, x, y), 2
        )


def test_identical_multiswag_members_are_refused():
    # A script that builds each member's network from one seed and seeds each run alike: two
    # SWAG runs on the same batches are one run.
    x, y = contract.data()
    members = []
    for _ in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = contract.small_model(0)
        members.append(train_swag(model, x, y))
    with pytest.raises(ValueError, match=r"members\[0\] and members\[1\] hold the same weights"):
        AutoMultiSWAG(model, members)


def test_members_given_in_another_key_order_are_one_layout():
    model, values = _values(0)
    _, other = _values(1)
    reordered = dict(reversed(other.items()))
    guide = AutoEnsemble(model, [values, reordered])
    x, y = contract.data()
    guide(x[:4], y[:4])
    assert torch.equal(guide.layout.unpack(guide.ensemble_locs[1])["0.weight"], other["0.weight"])


def test_members_of_different_layouts_are_refused():
    model, small = _values(0)
    _, wide = _values(1, width=7)
    with pytest.raises(ValueError, match=r"members\[1\] has another site layout"):
        AutoEnsemble(model, [small, wide])


def test_members_of_another_model_are_refused_at_set_up():
    model, _ = _values(0)
    _, wide = _values(1, width=7)
    guide = AutoEnsemble(model, [wide])
    x, y = contract.data()
    with pytest.raises(ValueError, match=r"must end in shape|does not sample"):
        guide(x[:4], y[:4])


def test_a_member_with_nan_is_refused():
    model, values = _values(0)
    values["0.bias"][0] = float("nan")
    with pytest.raises(ValueError, match=r"members\[0\]\['0.bias'\] contains NaN"):
        AutoEnsemble(model, [values])


def test_multiswag_refuses_a_member_that_diverged_after_its_last_collect():
    x, y = contract.data()
    model = contract.small_model()
    guide = train_swag(model, x, y)
    with torch.no_grad():
        guide.loc[2] = float("nan")  # what a diverging SGD step leaves
    with pytest.raises(ValueError, match=r"members\[0\]'s weights \(loc\) contain NaN"):
        AutoMultiSWAG(model, [guide])


def test_multiswag_refuses_uncollected_and_foreign_members():
    model = contract.small_model()
    x, y = contract.data()
    fresh = AutoSWAG(model, rank=3)
    fresh(x[:4], y[:4])
    with pytest.raises(NotCollectedError, match="MultiSWAG"):
        AutoMultiSWAG(model, [fresh])
    with pytest.raises(TypeError, match="AutoSWAG guide"):
        AutoMultiSWAG(model, [AutoDelta(model)])
    with pytest.raises(TypeError, match="swag_options"):
        AutoMultiSWAG(model, [fresh], rank=3)


def test_member_index_is_checked():
    _model, guide = _set_up(make_ensemble())
    with pytest.raises(ValueError, match=r"member must be None or an int in \[0, 3\)"):
        guide.member = 3
    with guide.use_member(2):
        assert guide.member == 2
    assert guide.member is None


@pytest.mark.parametrize("make", [make_ensemble, make_multiswag], ids=["ensemble", "multiswag"])
def test_to_inference_data_exports_member_draws(make):
    from pyro_bdl.diagnostics.export import to_inference_data

    model, guide = _set_up(make())
    x, y = contract.data()
    data = to_inference_data(model, guide, x, y, num_samples=4)
    bias = data.posterior["3.bias"].values  # (chain, draw, classes)
    assert bias.shape[:2] == (1, 4) and "_AutoEnsemble_latent" not in data.posterior
    if make is make_ensemble:  # every draw is one member's bias
        members = guide.layout.unpack(guide.ensemble_locs)["3.bias"]
        for draw in torch.as_tensor(bias[0]):
            assert (draw - members).abs().amax(-1).min() < 1e-6


@pytest.mark.parametrize(
    "old, name", [("ensemble_mixture", "MemberMixture"), ("ensemble_swag", "AutoMultiSWAG")]
)
def test_old_module_paths_warn_and_give_the_same_objects(old, name):
    sys.modules.pop(f"pyro_bdl.guides.{old}", None)
    with pytest.warns(DeprecationWarning, match="moved to pyro_bdl.guides.ensemble"):
        module = importlib.import_module(f"pyro_bdl.guides.{old}")
    assert getattr(module, name) is getattr(ensemble, name)
