"""Data-parallel refusals are agreed without opting in: VOGN and IVON with
``reduce_fn=allreduce_mean()`` (no :class:`~pyro_bdl.distributed.StepAgreement`) and a NaN batch on
rank 1 refuse the step on every rank, change nothing, and stay in step; a plain ``reduce_fn``
makes the other rank refuse the non-finite mean; ``allreduce_mean_`` of tensors of different
lengths raises a clear error on every rank instead of aborting a process inside gloo; and a
refusing rank's ``allreduce_sum().refuse`` makes the other rank's reduction refuse (the path a
Laplace ``fit(reduce_fn=...)`` takes).

Two ``gloo`` ranks on 127.0.0.1 run every case in turn (tests/distributed's ``spawn_phases``), with
a timeout on every collective, so a rank left waiting fails the tests instead of blocking CI.
"""

from __future__ import annotations

from functools import partial

import pyro
import pytest
import torch
import torch.distributed as dist
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.distributed import allreduce_mean, allreduce_mean_, allreduce_sum
from pyro_bdl.infer import IVON, VOGN
from pyro_bdl.priors import Normal
from tests.distributed.test_data_parallel import WORLD, spawn_phases
from tests.faults.test_distributed import _clone, _refusal, _same

pytestmark = pytest.mark.distributed

N = 40
B = 4
METHODS = {"vogn": VOGN, "ivon": IVON}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (N,), generator=g)


def _batch(step: int, rank: int, bad_rank: int | None = None):
    x, y = _data()
    lo = (step * WORLD + rank) * B
    x, y = x[lo : lo + B].clone(), y[lo : lo + B].clone()
    if rank == bad_rank:
        x[2, 1] = float("nan")
    return x, y


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    return models.classifier(bayesianize(net, Normal(scale=1.0)), N)


def _snapshot(method, net) -> dict:
    return {
        "state": _clone(method.state_dict()) if not method.needs_setup else None,
        "net": {k: v.clone() for k, v in net.state_dict().items()},
        "scale": method.guide.scale.clone() if not method.needs_setup else None,
        "rng": torch.get_rng_state(),
    }


def _method_case(name: str, rank: int, *, plain: bool, first: bool) -> dict:
    """A NaN batch on rank 1, at the first step (``first``) or the second; ``plain``: a
    ``reduce_fn`` of our own without ``refuse``."""

    def plain_mean(tensors):
        for t in tensors:
            dist.all_reduce(t)
            t /= WORLD

    model = _model()
    reduce_fn = plain_mean if plain else allreduce_mean()
    method = METHODS[name](model, dataset_size=N, reduce_fn=reduce_fn)
    pyro.set_rng_seed(3 + rank)
    if not first:
        method.step(*_batch(0, rank))
    before = _snapshot(method, model.net)
    verdict = _refusal(lambda: method.step(*_batch(1, rank, bad_rank=1)))
    verdict["changed"] = not _same(before, _snapshot(method, model.net))
    method.step(*_batch(2, rank))  # still in step: a good batch trains on both ranks
    verdict["after"] = method.state_dict()["mean"]
    verdict["steps"] = method.step_count
    return verdict


def _shapes_case(rank: int) -> dict:
    tensors = [torch.ones(3 + rank, dtype=torch.float64)]
    verdict = _refusal(lambda: allreduce_mean_(tensors))
    verdict["unchanged"] = bool((tensors[0] == 1).all())
    good = [torch.full((3,), float(rank), dtype=torch.float64)]
    allreduce_mean_(good)  # the ranks are still in step
    verdict["after"] = good[0]
    return verdict


def _sum_case(rank: int) -> dict:
    """Rank 1 refuses before its reduction (as a Laplace fit refuses a NaN batch) and says so
    through ``refuse``; rank 0 is in the reduction."""
    reduce_fn = allreduce_sum()
    t = torch.ones(5, dtype=torch.float64)

    def run():
        if rank == 1:
            error = ValueError("data tensor 0 (0: x, 1: y) contains 1 non-finite value(s)")
            reduce_fn.refuse(error)
            raise error
        reduce_fn(t)

    verdict = _refusal(run)
    verdict["unchanged"] = bool((t == 1).all())
    verdict["after"] = reduce_fn(torch.ones(2, dtype=torch.float64))
    return verdict


def _laplace_case(rank: int) -> dict:
    """A real ``AutoLaplace.fit(reduce_fn=allreduce_sum())`` with a NaN in rank 1's rows: rank 1
    refuses in its own pass, rank 0 waits in the first reduction; both must raise."""
    import warnings

    from pyro_bdl.guides import AutoLaplace

    model = _model()
    guide = AutoLaplace(model, hessian_structure="diag")
    x, y = _data()
    guide(x, y)
    x, y = x[rank::WORLD].clone(), y[rank::WORLD].clone()
    if rank == 1:
        x[2, 1] = float("nan")
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with warnings.catch_warnings():  # the prior-drawn weights are no mode: not what is tested
        warnings.simplefilter("ignore")
        verdict = _refusal(lambda: guide.fit((x, y), reduce_fn=allreduce_sum()))
    after = guide.state_dict()
    verdict["unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )
    verdict["after"] = allreduce_sum()(torch.ones(2, dtype=torch.float64))  # still in step
    return verdict


CASES = {
    "laplace": _laplace_case,
    "ivon": partial(_method_case, "ivon", plain=False, first=False),
    "vogn": partial(_method_case, "vogn", plain=False, first=False),
    "ivon_first": partial(_method_case, "ivon", plain=False, first=True),
    "vogn_first": partial(_method_case, "vogn", plain=False, first=True),
    "vogn_plain": partial(_method_case, "vogn", plain=True, first=False),
    "ivon_plain": partial(_method_case, "ivon", plain=True, first=False),
    "shapes": _shapes_case,
    "sum": _sum_case,
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """Every case's verdicts from both ranks, in one two-rank run (spawn_phases: every collective
    times out, so a rank left waiting fails the run instead of hanging)."""
    ranks = spawn_phases(tmp_path_factory.mktemp("agreement"), CASES)
    return {case: [rank[case] for rank in ranks] for case in CASES}


@pytest.mark.parametrize("case", ["ivon", "vogn", "ivon_first", "vogn_first"])
def test_a_nan_batch_on_one_rank_is_refused_on_every_rank_without_step_agreement(verdicts, case):
    ranks = verdicts[case]
    method = case.split("_")[0].upper()
    step = 1 if case.endswith("_first") else 2
    for verdict in ranks:
        assert verdict["type"] == "ValueError", verdict
        assert verdict["message"].startswith(
            f"rank 1 refused its batch: {method} step {step}: the argument args[0] contains 1 "
            "non-finite value(s) (NaN or inf); the first is at index (2, 1)."
        ), verdict["message"]
        assert (
            "(every rank raised this error; no rank changed any state in this step)"
            in (verdict["message"])
        )
        assert verdict["ranks"] == [1]
        assert not verdict["changed"], "a refused step changed the state"
    assert ranks[1]["cause"] == "ValueError" and ranks[0]["cause"] is None
    # Both ranks then took the same good step: the same number of steps and the same μ.
    assert ranks[0]["steps"] == ranks[1]["steps"] == step
    torch.testing.assert_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["vogn_plain", "ivon_plain"])
def test_a_plain_reduce_fn_makes_the_other_rank_refuse_the_non_finite_mean(verdicts, case):
    ranks = verdicts[case]
    method = case.split("_")[0].upper()
    assert ranks[1]["type"] == "ValueError"
    assert ranks[1]["message"].startswith(f"{method} step 2: the argument args[0] contains 1")
    assert ranks[0]["type"] == "ValueError"
    assert ranks[0]["message"].startswith(
        f"{method} step 2: the gradient of the likelihood for weights (ĝ) is not finite after "
        "reduce_fn (on some rank, or by overflow of the sum) (NaN or inf); nothing was updated."
    ), ranks[0]["message"]
    for verdict in ranks:
        assert not verdict["changed"]
        assert verdict["steps"] == 2
    torch.testing.assert_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)


def test_tensors_of_different_lengths_are_refused_on_every_rank(verdicts):
    for verdict in verdicts["shapes"]:
        assert verdict["type"] == "ValueError"
        assert verdict["message"] == (
            "allreduce_mean_: the ranks passed tensors of different shapes or dtypes (rank 0: 1 "
            "tensor(s), 3 elements; rank 1: 1 tensor(s), 4 elements; equal counts mean the shapes "
            "or dtypes differ); every rank must pass the same shapes, dtypes and order. Nothing "
            "was reduced, on any rank. Give every rank the same model and the same kind of batch."
        )
        assert verdict["unchanged"]
        # The next reduction pairs correctly: the mean of 0 and 1.
        torch.testing.assert_close(verdict["after"], torch.full((3,), 0.5, dtype=torch.float64))


def test_a_refusing_rank_makes_the_other_ranks_sum_refuse(verdicts):
    for verdict in verdicts["sum"]:
        assert verdict["type"] == "ValueError"
        assert verdict["message"].startswith(
            "rank 1 refused its batch: data tensor 0 (0: x, 1: y) contains 1 non-finite value(s)"
        )
        assert verdict["unchanged"]
        torch.testing.assert_close(verdict["after"], torch.full((2,), 2.0, dtype=torch.float64))


def test_a_laplace_fit_with_a_nan_on_one_rank_is_refused_on_every_rank(verdicts):
    for verdict in verdicts["laplace"]:
        assert verdict["type"] == "ValueError", verdict
        assert verdict["message"].startswith("rank 1 refused its batch: "), verdict["message"]
        assert "non-finite" in verdict["message"]
        assert verdict["unchanged"]
        torch.testing.assert_close(verdict["after"], torch.full((2,), 2.0, dtype=torch.float64))
