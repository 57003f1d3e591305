"""Deprecated path of the streaming estimator: moved to :mod:`pyro_bdl.infer.kl`;
the old path goes in the next release."""

import warnings

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

warnings.warn(
    "pyro_bdl.infer.kl_streaming moved to pyro_bdl.infer.kl; the old path goes in the next "
    "release. Import pyro_bdl.infer.kl instead.",
    DeprecationWarning,
    stacklevel=2,
)
