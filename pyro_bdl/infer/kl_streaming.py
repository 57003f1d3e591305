"""Deprecated path of the streaming estimator: moved to :mod:`pyro_bdl.infer.kl`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.infer.kl import (
    ChunkSums,
    LogProbAndScore,
    autograd_score,
    kl_streaming,
    laplace_chunk_sums,
    scale_mixture_chunk_sums,
)

__all__ = [
    "ChunkSums",
    "LogProbAndScore",
    "autograd_score",
    "kl_streaming",
    "laplace_chunk_sums",
    "scale_mixture_chunk_sums",
]

warn_moved(__name__, "pyro_bdl.infer.kl")
