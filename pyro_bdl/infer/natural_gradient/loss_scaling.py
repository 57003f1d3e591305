r"""Loss scaling for float16 autocast: a natural-gradient step driven by torch's ``GradScaler``.

Under ``torch.autocast(..., dtype=torch.float16)`` the backward pass runs through float16
activations, whose gradients below about 6·10⁻⁸ flush to zero. Mixed-precision training
multiplies the loss by a scale S before the backward pass and divides the gradients by S after
it; a step whose scaled gradients overflow is skipped and S shrinks, and S grows again after a
run of good steps (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

A natural-gradient method runs its own backward pass, so ``GradScaler.scale(loss).backward()``
cannot be written around it. :class:`LossScaling` lets the method use the user's scaler through
its public API instead: the method scales the quantity it differentiates with
``scaler.scale``; the estimates become the gradients of placeholder parameters of a small
optimizer (:class:`EstimatesOptimizer`), so that ``scaler.unscale_`` divides them by S in place
and records any inf or NaN, ``scaler.step`` skips or takes the (empty) step, and
``scaler.update`` shrinks or grows S exactly as for any torch optimizer. The scaler's own
state_dict stays the one to save with a checkpoint.

Estimates that are quadratic in the gradient (VOGN's Σ gᵢ², scaled by S²) are divided by S once
more before the scaler's division. Scaling by a power of two (GradScaler's default factors) is
exact in floating point, so without autocast a scaled step equals the unscaled one bit for bit.

VOGN's set-up pass (its first curvature, at w = μ) is scaled too, and divided by S²
without the scaler (:meth:`LossScaling.unscale_first`): the step's own ``unscale_`` follows. Its
overflow is settled once the ranks have averaged the first curvature, which spreads it
(:meth:`LossScaling.check_first`): the first step is skipped on every rank, and the scaler
records the overflow through a placeholder gradient of inf. Below S = 1 a non-finite value is
no overflow (the scale shrinks the gradients there) but a NaN or inf gradient of a finite loss,
which backing off would hide while S sinks to 0: it is refused, as without a scaler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pyro_bdl._validation import all_finite
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState

__all__ = ["EstimatesOptimizer", "LossScaling", "SkippedStep", "check_grad_scaler"]


class SkippedStep(Exception):
    """A step whose scaled estimates overflowed: skipped, with ``loss`` its loss (NaN when the
    first step's set-up pass overflowed: there is no σ yet)."""

    def __init__(self, loss: float):
        super().__init__(f"the scaled gradients overflowed (loss {loss!r}); step skipped")
        self.loss = loss


def check_grad_scaler(method: str, scaler: object) -> torch.amp.GradScaler | None:
    """``scaler`` if it is an enabled ``torch.amp.GradScaler``; ``None`` for ``None`` or a
    disabled one (which scales nothing); anything else is refused."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        got = type(scaler).__name__
        if isinstance(scaler, type):  # GradScaler itself, not an instance of it
            got = f"the class {scaler.__name__} itself, not an instance"
        raise TypeError(
            f"{method}: grad_scaler must be a torch.amp.GradScaler (or None); got {got}. Pass "
            "e.g. grad_scaler=torch.amp.GradScaler('cuda') to train under float16 autocast."
        )
    return scaler if scaler.is_enabled() else None


class EstimatesOptimizer(torch.optim.Optimizer):
    """A step's estimates as the ``.grad`` of placeholder parameters (zero-stride, one element
    of memory each), so that ``GradScaler.unscale_`` and ``GradScaler.step`` treat them as an
    optimizer's gradients. :meth:`step` updates nothing: the method's own update follows."""

    def __init__(self, estimates: Sequence[torch.Tensor]):
        params = []
        for e in estimates:
            p = torch.nn.Parameter(torch.zeros((), dtype=e.dtype, device=e.device).expand_as(e))
            p.grad = e
            params.append(p)
        super().__init__(params, {})
        self.estimates = list(estimates)

    def step(self, closure: Callable | None = None):  # type: ignore[override]
        return closure() if closure is not None else None


class LossScaling:
    """One natural-gradient method's use of a ``GradScaler``, step by step.

    :param scaler: an enabled ``torch.amp.GradScaler``.
    :param int curvature_power: how the method's ĥ scales with the loss: 1 when ĥ is linear in
        the gradient (IVON's ĝε/σ), 2 when it is a square (VOGN's Σ gᵢ²).
    """

    def __init__(self, scaler: torch.amp.GradScaler, curvature_power: int):
        self.scaler = scaler
        self.curvature_power = curvature_power
        self._optimizer: EstimatesOptimizer | None = None
        self._unscaled = False
        self._device = torch.device("cpu")
        #: Whether the set-up pass (VOGN's first curvature) overflowed; its check is pending.
        self.first_overflowed, self._first_pending = False, False
        #: Steps skipped because their scaled gradients were not finite.
        self.skipped_steps = 0

    def scale(self, root: torch.Tensor) -> torch.Tensor:
        """``root`` (the quantity the method differentiates) times the current scale S."""
        self._device = root.device  # where an overflow of the set-up pass is recorded
        return self.scaler.scale(root)

    def unscale_first(self, estimates: list[torch.Tensor], curvatures: list[torch.Tensor]) -> None:
        """Divide the set-up pass's ``estimates`` by S in place (``curvatures`` by
        S^curvature_power), without the scaler's bookkeeping (the step's own :meth:`unscale`
        follows); an overflow is noted, and settled by :meth:`check_first`."""
        torch._foreach_div_(estimates, self.scaler.get_scale())
        self._divide_curvatures(curvatures)
        self.first_overflowed, self._first_pending = not all_finite(estimates), True

    def check_first(self, state: NaturalGradientState | None, where: str) -> None:
        """Once after a scaled set-up, when the ranks have averaged the first curvature of
        ``state`` (an overflow on any rank reaches all): :class:`SkippedStep` if it is not
        finite, or, below S = 1, the refusal :meth:`refuse_below_one` explains."""
        if not self._first_pending:
            return
        self._first_pending = False
        assert state is not None
        if all_finite([state.curvature, *state.hidden_curvature]):
            return
        scale = self.scaler.get_scale()
        if scale < 1:
            raise ValueError(
                f"{where}: the first curvature (of the set-up pass at w = μ) is not finite; "
                f"nothing was set up. {self._below_one(scale)}"
            )
        raise SkippedStep(math.nan)

    def unscale(self, estimates: list[torch.Tensor], curvatures: list[torch.Tensor]) -> bool:
        """Divide the step's ``estimates`` by S in place (``curvatures``, a subset of them,
        by S^curvature_power); whether all are finite."""
        known = self._optimizer.estimates if self._optimizer is not None else []
        if len(known) != len(estimates) or any(a is not b for a, b in zip(known, estimates)):
            self._optimizer = EstimatesOptimizer(estimates)  # new buffers: set-up, .to()
        self._divide_curvatures(curvatures)
        self.scaler.unscale_(self._optimizer)  # type: ignore[arg-type]  # set just above
        self._unscaled = True
        return all_finite(estimates)

    def _divide_curvatures(self, curvatures: list[torch.Tensor]) -> None:
        """Divide ``curvatures`` by S^(curvature_power − 1): what a square carries beyond the
        one factor S that every estimate carries."""
        if self.curvature_power > 1:
            torch._foreach_div_(curvatures, self.scaler.get_scale() ** (self.curvature_power - 1))

    def refuse_below_one(self, refuse: Callable[[], None]) -> None:
        """Before a skip: below S = 1 the scale shrinks the gradients instead of enlarging them,
        so a non-finite estimate is no overflow of the scaled loss (but a NaN or inf gradient of
        a finite loss, which backing off would hide for ever): ``refuse()``, the method's check
        of its estimates, raises the refusal a method without a scaler gives, noted here."""
        scale = self.scaler.get_scale()
        if scale >= 1:
            return
        try:
            refuse()
        except ValueError as err:
            err.add_note(self._below_one(scale))
            raise

    def _below_one(self, scale: float) -> str:
        """Why a non-finite value at ``scale`` < 1 is refused, and the fix."""
        return (
            f"grad_scaler's scale is {scale!r} (below 1, after {self.skipped_steps} skipped "
            "step(s)): there loss scaling shrinks the gradients, so a non-finite value is no "
            "overflow of the scaled loss but a NaN or inf gradient of a finite loss, refused "
            "instead of skipped. Fix the model or the data, then set the scale back, e.g. "
            "scaler.update(new_scale=2.0**16)."
        )

    def finish(self, skipped: bool) -> None:
        """After a taken or skipped step: the scaler steps (or skips) its placeholder optimizer
        and updates S (backs off after a skip, grows after ``growth_interval`` good steps)."""
        if not self._unscaled:  # the set-up pass overflowed: the scaler records an inf
            self._optimizer = EstimatesOptimizer([torch.full((), math.inf, device=self._device)])
            self.scaler.unscale_(self._optimizer)
        assert self._optimizer is not None
        self.scaler.step(self._optimizer)
        self.scaler.update()
        self._unscaled = False
        self.skipped_steps += int(skipped)

    def abandon(self) -> None:
        """After a step refused for another reason: forget this step's unscaling, keep S."""
        if self._unscaled:
            self.scaler.update(new_scale=self.scaler.get_scale())
            self._unscaled = False

    def __getstate__(self) -> dict:
        # The placeholder optimizer holds views of the method's buffers: rebuilt on use.
        return {**self.__dict__, "_optimizer": None, "_unscaled": False}
