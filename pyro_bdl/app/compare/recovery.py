"""Retry a training run that diverged at a lower rate, with a note saying so.

An SGD rate that suits one dataset can blow up on another (a regression target with a small
noise σ has per-example curvature ∝ 1/σ²): rather than fail the whole comparison, a method built
on :func:`retry_lower` trains again from scratch at the rate divided by ``FACTOR``, up to
``ATTEMPTS`` times, and reports the rate it ended at. Any other error propagates unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

from pyro_bdl._caller import user_stacklevel

__all__ = ["ATTEMPTS", "FACTOR", "DivergedWarning", "diverged", "retry_lower"]

#: Tries in all (the first at the given rate).
ATTEMPTS = 4
#: The rate is divided by this after each divergence.
FACTOR = 10.0

T = TypeVar("T")


class DivergedWarning(UserWarning):
    """A training run diverged and was retried at a lower rate."""


def diverged(err: BaseException) -> bool:
    """Whether ``err`` is a divergence: the training loop's non-finite loss
    (``FloatingPointError``), or a distribution check that failed after the parameters blew up
    (the training loop's note says "diverged")."""
    if isinstance(err, FloatingPointError):
        return True
    notes = " ".join(getattr(err, "__notes__", []))
    return isinstance(err, ValueError) and "diverged" in notes


def retry_lower(
    train: Callable[[float], T], rate: float, desc: str, notes: list[str] | None = None
) -> tuple[T, float]:
    """``(train(r), r)`` for the first rate r of ``rate``, ``rate / FACTOR``, … (``ATTEMPTS`` in
    all) at which ``train`` does not diverge (:func:`diverged`); each retry warns
    (:class:`DivergedWarning`) and appends a line to ``notes``. ``train`` must start from
    scratch (fresh guide and parameters) each call. Raises the last divergence, with a note, when
    every rate diverges."""
    for attempt in range(ATTEMPTS):
        try:
            return train(rate), rate
        except (FloatingPointError, ValueError) as err:
            if not diverged(err):
                raise
            if attempt == ATTEMPTS - 1:
                err.add_note(
                    f"{desc}: diverged at every rate down to {rate:g} ({ATTEMPTS} tries, each "
                    f"{FACTOR:g}× lower); check the data's scale or pass a lower rate."
                )
                raise
            note = f"{desc}: diverged at rate {rate:g}; retried from scratch at {rate / FACTOR:g}"
            warnings.warn(note, DivergedWarning, stacklevel=user_stacklevel())
            if notes is not None:
                notes.append(note)
            rate /= FACTOR
    raise AssertionError("unreachable")  # the loop returns or raises
