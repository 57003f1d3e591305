"""Deprecated path of the noise families and KLTerms: moved to :mod:`pyro_bdl.infer.kl`;
the old path goes in the next release."""

from pyro_bdl._moved import warn_moved
from pyro_bdl.infer.kl import (
    GAUSSIAN_NOISE,
    NOISE_FAMILIES,
    RADIAL_NOISE,
    KLTerms,
    NoiseFamily,
    noise_family,
    sample_gaussian_statistics,
)

__all__ = [
    "GAUSSIAN_NOISE",
    "NOISE_FAMILIES",
    "RADIAL_NOISE",
    "KLTerms",
    "NoiseFamily",
    "noise_family",
    "sample_gaussian_statistics",
]

warn_moved(__name__, "pyro_bdl.infer.kl")
