"""Data-parallel training on ``torch.distributed``: :class:`DataParallelSVI`, per-epoch data
shards and the collective helpers (docs/design/distributed.md). Start with ``torchrun``; backend
``nccl`` on GPUs, ``gloo`` on CPUs."""

from pyro_bdl.distributed.comm import (
    all_gather_scalars,
    broadcast_,
    get_rank,
    get_world_size,
    is_main_process,
    shard_indices,
)
from pyro_bdl.distributed.errors import BatchNormWarning, GuideNotInitializedError, StepRefusedError
from pyro_bdl.distributed.metrics import shard_range, sharded_metrics
from pyro_bdl.distributed.reduce import (
    AgreedReduce,
    allreduce_mean,
    allreduce_mean_,
    allreduce_sum,
)
from pyro_bdl.distributed.refusal import StepAgreement, agree_on_refusal
from pyro_bdl.distributed.svi import DataParallelSVI

__all__ = [
    "AgreedReduce",
    "BatchNormWarning",
    "DataParallelSVI",
    "GuideNotInitializedError",
    "StepAgreement",
    "StepRefusedError",
    "agree_on_refusal",
    "all_gather_scalars",
    "allreduce_mean",
    "allreduce_mean_",
    "allreduce_sum",
    "broadcast_",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "shard_indices",
    "shard_range",
    "sharded_metrics",
]
