"""Deprecated path of the noise families and KLTerms: moved to :mod:`pyro_bdl.infer.kl`;
the old path goes in the next release."""

import warnings

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

warnings.warn(
    "pyro_bdl.infer.kl_noise moved to pyro_bdl.infer.kl; the old path goes in the next "
    "release. Import pyro_bdl.infer.kl instead.",
    DeprecationWarning,
    stacklevel=2,
)
