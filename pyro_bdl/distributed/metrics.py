r"""Classification metrics over a test set sharded across ranks: :func:`sharded_metrics`.

Each rank scores its own shard of the test set and contributes the *sums* behind every metric;
one all-reduce adds them, and every rank finishes the same division:

.. math::

    \text{acc} = \frac{\sum_r c_r}{\sum_r n_r},\quad
    \text{NLL} = \frac{\sum_r \sum_{i\in r} -\log p_{i y_i}}{\sum_r n_r},\quad
    \text{ECE} = \sum_b \frac{|B_b|}{n}\left|\frac{A_b}{|B_b|} - \frac{S_b}{|B_b|}\right|,

with, per confidence bin b, the count |B_b|, the number correct A_b and the confidence sum S_b,
each a sum over ranks (the binning is :func:`pyro_bdl.diagnostics.metrics.bin_sums`). Counts are
integers, exact in float64, so the accuracy and the bin counts equal the unsharded ones exactly;
the NLL, Brier and confidence sums differ only by the order of float64 additions.

Usage::

    part = shard_range(len(x_test))                 # this rank's contiguous slice
    probs = predictive_probs(x_test[part])          # same posterior draws on every rank
    scores = sharded_metrics(probs, y_test[part])   # identical dict on every rank
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pyro_bdl._validation import check_positive_int
from pyro_bdl.diagnostics.metrics import (
    as_tensor,
    bin_sums,
    brier_terms,
    nll_terms,
    reliability_from_sums,
)
from pyro_bdl.distributed.comm import comm_device, get_rank, get_world_size
from pyro_bdl.distributed.refusal import agree_on_refusal

__all__ = ["shard_range", "sharded_metrics"]


def shard_range(dataset_size: int, *, rank: int | None = None, world_size: int | None = None):
    """This rank's contiguous slice of an evaluation set of ``dataset_size`` examples.

    Unlike :func:`~pyro_bdl.distributed.shard_indices` (training: equal shards, the remainder
    left out), every example is scored once: the first ``dataset_size mod world_size`` ranks get
    one example more. A rank may get none when there are fewer examples than ranks.

    :returns: a ``slice`` to index the test tensors with.
    """
    check_positive_int("dataset_size", dataset_size)
    world = get_world_size() if world_size is None else world_size
    rank = get_rank() if rank is None else rank
    check_positive_int("world_size", world)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(
            f"rank must be an int in [0, world_size) = [0, {world}); got {type(rank).__name__} "
            f"{rank!r}. Pass the process's rank (torch.distributed.get_rank()), or leave it out."
        )
    if not 0 <= rank < world:
        raise ValueError(
            f"rank must be an int in [0, world_size) = [0, {world}); got {rank!r}. Pass the "
            "process's rank (torch.distributed.get_rank()), or leave it out."
        )
    base, extra = divmod(dataset_size, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _local_sums(probs, y, num_bins: int, eps: float) -> torch.Tensor:
    """[n, correct, NLL sum, Brier sum, bin counts, bin confidence sums, bin correct counts]."""
    probs, y = as_tensor("probs", probs), as_tensor("y", y)
    if probs.dim() == 2 and probs.shape[0] == 0 and y.shape == (0,):
        # An empty shard (fewer test examples than ranks) contributes zeros.
        return torch.zeros(4 + 3 * num_bins, dtype=torch.float64)
    counts, conf_sum, acc_sum = bin_sums(probs, y, num_bins=num_bins)
    head = torch.stack(
        [
            counts.sum(),
            acc_sum.sum(),
            nll_terms(probs, y, eps=eps).sum(),
            brier_terms(probs, y).sum(),
        ]
    )
    return torch.cat([head, counts, conf_sum, acc_sum]).cpu()


def sharded_metrics(
    probs, y, *, num_bins: int = 15, eps: float = 1e-12, process_group=None
) -> dict[str, object]:
    r"""Accuracy, NLL, Brier score, ECE and MCE of a test set split across ranks.

    Every rank passes its shard's predictive probabilities (shape (n_r, C), n_r may differ, may
    be 0) and labels; one all-reduce adds the sums behind the metrics, and every rank returns the
    same dict. The values equal :func:`~pyro_bdl.diagnostics.metrics.accuracy`, ``nll``,
    ``brier`` and ``ece`` on the concatenated test set (the accuracy and bin counts exactly, the
    rest up to the order of float64 sums). In one process it scores ``probs`` directly.

    A shard refused on any rank (bad probabilities or labels, different numbers of classes)
    raises the same error on every rank, through
    :func:`~pyro_bdl.distributed.agree_on_refusal`, instead of leaving the others waiting.

    :param probs: this rank's mean predictive probabilities, shape (n_r, C).
    :param y: this rank's integer labels, shape (n_r,).
    :param int num_bins: equal-width confidence bins of the ECE (the same on every rank).
    :param float eps: the probability floor of the NLL.
    :returns: ``{"n", "accuracy", "nll", "brier", "ece", "mce", "reliability"}`` (the last a
        :class:`~pyro_bdl.diagnostics.metrics.Reliability`).
    """
    check_positive_int("num_bins", num_bins)
    error: Exception | None = None
    sums = torch.zeros(4 + 3 * num_bins, dtype=torch.float64)
    num_classes = -1
    try:
        sums = _local_sums(probs, y, num_bins, eps)
        num_classes = as_tensor("probs", probs).shape[-1]
    except Exception as refusal:
        error = refusal
    world = get_world_size(process_group)
    if world > 1:
        # The bins fix the length of the sums: ranks that disagree would abort inside gloo.
        shape = agree_on_refusal(
            error, [num_classes, num_bins], step=0, process_group=process_group
        )
        if not bool((shape == shape[0]).all()):
            raise ValueError(
                f"the ranks' probs have different numbers of classes or num_bins differs (per "
                f"rank [classes, num_bins]: {shape.long().tolist()}); pass probabilities over the "
                "same classes and the same num_bins on every rank."
            )
        device = comm_device(process_group)
        total = sums.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
        sums = total.cpu()
    elif error is not None:
        raise error
    n, correct, nll_sum, brier_sum = (float(v) for v in sums[:4])
    if n == 0:
        raise ValueError("the test set is empty on every rank; score at least one example.")
    counts, conf_sum, acc_sum = sums[4:].view(3, num_bins)
    table = reliability_from_sums(counts, conf_sum, acc_sum)
    return {
        "n": int(n),
        "accuracy": correct / n,
        "nll": nll_sum / n,
        "brier": brier_sum / n,
        "ece": table.ece,
        "mce": table.mce,
        "reliability": table,
    }
