"""The exceptions and warnings of data-parallel training."""

from __future__ import annotations

__all__ = ["BatchNormWarning", "GuideNotInitializedError", "StepRefusedError"]


class GuideNotInitializedError(RuntimeError):
    """Data-parallel training was set up before the guide created its parameters."""


class BatchNormWarning(UserWarning):
    """A data-parallel model contains BatchNorm layers whose statistics are not synchronised."""


class StepRefusedError(RuntimeError):
    """A rank refused its step with an exception of a kind the ranks cannot name to each other
    (anything but the built-in ``ValueError``, ``TypeError``, ``FloatingPointError``,
    ``IndexError``, ``KeyError``, ``RuntimeError`` and :class:`GuideNotInitializedError`)."""
