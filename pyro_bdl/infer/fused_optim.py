r"""One torch optimizer over every parameter of a Pyro run: :class:`FusedOptim`.

:class:`pyro.optim.PyroOptim` builds one torch optimizer per parameter and steps them one by one,
and Pyro's ``zero_grads`` then allocates a new zero gradient per parameter. On a network with
dozens of weight tensors that host work dominates a GPU step (docs/gpu.md): Adam without
``foreach`` launches several kernels per parameter, per step. :class:`FusedOptim` keeps a single
torch optimizer whose parameter groups gather every parameter it has been called with (one group
per distinct set of hyperparameters), asks for the multi-tensor (``foreach``) kernels where the
optimizer has them, and leaves the gradients ``None`` after the step so that ``zero_grads`` has
nothing to allocate.

The update is the per-parameter one: torch's optimizers update each parameter from its own
gradient and state, so one optimizer over all parameters computes what one optimizer per parameter
computes. :class:`FusedOptim` keeps the per-parameter semantics of ``PyroOptim`` where the two
could differ:

- only the parameters passed to a call move: a parameter it holds but that this step did not pass
  (the model skipped its site) keeps its value and its state (Adam's step count included);
- :meth:`get_state` returns PyroOptim's form, ``{param name: torch state_dict of one parameter}``,
  so a state or checkpoint written by ``pyro.optim.Adam`` loads into ``FusedOptim(torch.optim.Adam,
  ...)`` and back; state for a parameter not yet seen waits for its first step, as in PyroOptim;
- ``clip_args`` clip each parameter's gradient on its own, as PyroOptim does.

Hyperparameters that a torch optimizer changes inside ``step`` (Pyro's ``ClippedAdam`` decays its
``lr`` on every call) change once per step for the whole group, also for a parameter that the step
did not pass; per-parameter optimizers would leave that parameter's copy alone. Every optimizer in
``torch.optim`` keeps its hyperparameters fixed.

Usage::

    optim = FusedOptim(torch.optim.Adam, {"lr": 1e-3})
    svi = SVI(model, guide, optim, Trace_ELBO())       # or DataParallelSVI(...)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import pyro
import torch
from pyro.optim import PyroOptim
from torch.nn.utils import clip_grad_value_

__all__ = ["FusedOptim"]

#: How a group runs, not what it computes: left out when groups are compared.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def _is_scheduler(constructor: Any) -> bool:
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    return isinstance(constructor, type) and issubclass(constructor, schedulers)


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params" and k not in _IMPLEMENTATION}


class FusedOptim(PyroOptim):
    """A :class:`pyro.optim.PyroOptim` that keeps one torch optimizer over every parameter.

    A drop-in for ``pyro.optim.Adam({...})`` and friends in :class:`pyro.infer.SVI` and
    :class:`~pyro_bdl.distributed.DataParallelSVI`, with the same trajectory (see the module
    docstring), far fewer kernel launches and no allocation of zero gradients per step.

    Usage::

        optim = FusedOptim(torch.optim.Adam, {"lr": 1e-3})
        optim = FusedOptim(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}, {"clip_norm": 10.0})
        optim = FusedOptim(torch.optim.Adam, lambda name: {"lr": 1e-2 if "scale" in name else 1e-3})

    :param type optim_constructor: a ``torch.optim.Optimizer`` subclass (``torch.optim.Adam``).
    :param optim_args: its keyword arguments, or a callable ``optim_args(param_name)`` (or
        ``(module_name, param_name)``, as PyroOptim) returning them per parameter; parameters
        with equal arguments share a parameter group. ``foreach=True`` is added where the
        optimizer takes it and neither ``foreach`` nor ``fused`` is given.
    :param dict clip_args: ``{"clip_norm": ..., "clip_value": ...}``, applied to each parameter's
        gradient on its own before the step (as PyroOptim does).
    """

    optimizer: torch.optim.Optimizer | None

    def __init__(
        self,
        optim_constructor: type[torch.optim.Optimizer],
        optim_args: dict | Callable[..., dict],
        clip_args: dict | None = None,
    ):
        if _is_scheduler(optim_constructor):
            raise TypeError(
                f"optim_constructor must be a torch.optim.Optimizer class; got the learning-rate "
                f"scheduler {optim_constructor.__name__}. FusedOptim does not schedule learning "
                "rates: use pyro.optim.PyroLRScheduler (one optimizer per parameter) for a "
                "schedule."
            )
        if not (
            isinstance(optim_constructor, type)
            and issubclass(optim_constructor, torch.optim.Optimizer)
        ):
            raise TypeError(
                "optim_constructor must be a torch.optim.Optimizer class such as "
                f"torch.optim.Adam; got {optim_constructor!r}. Pass the torch class, not Pyro's "
                "wrapper: FusedOptim(torch.optim.Adam, {'lr': 1e-3})."
            )
        if not (isinstance(optim_args, dict) or callable(optim_args)):
            raise TypeError(
                "optim_args must be a dict of the optimizer's keyword arguments or a callable "
                f"returning one per parameter; got {type(optim_args).__name__}. Write for "
                "example {'lr': 1e-3}."
            )
        if clip_args is not None and not isinstance(clip_args, dict):
            raise TypeError(
                f"clip_args must be a dict {{'clip_norm': ..., 'clip_value': ...}} or None; got "
                f"{type(clip_args).__name__}. FusedOptim clips every parameter alike; for "
                "per-parameter clipping use pyro.optim.PyroOptim."
            )
        unknown = set(clip_args or {}) - {"clip_norm", "clip_value"}
        if unknown:
            raise ValueError(
                f"clip_args takes clip_norm and clip_value; got {sorted(unknown)}. Remove them."
            )
        super().__init__(optim_constructor, optim_args, clip_args)
        signature = inspect.signature(optim_constructor).parameters
        self._foreach = "foreach" in signature
        self._defaults = {
            k: v.default
            for k, v in signature.items()
            if k != "params" and v.default is not inspect.Parameter.empty
        }
        self.optimizer = None
        self._held: set[torch.Tensor] = set()

    # -- stepping ---------------------------------------------------------------------------

    def __call__(self, params: Iterable[torch.Tensor], *args, **kwargs) -> None:
        """Step exactly ``params`` (an iterable of parameters), in one torch ``step`` call, and
        set their gradients to ``None``. Parameters seen for the first time join the optimizer,
        with any state :meth:`set_state` left waiting for them.

        Runs outside inference mode: a first step under ``torch.inference_mode()`` would create
        the optimizer's state (Adam's moments) as inference tensors, which every later step
        outside it would fail to update in place."""
        with torch.inference_mode(False):
            self._step(list(params), *args, **kwargs)

    def _step(self, params: list[torch.Tensor], *args, **kwargs) -> None:
        for p in params:
            if p not in self._held:
                self._add(p)
        if not params:
            return
        assert self.optimizer is not None
        hidden = self._hide_others(params)
        try:
            self._clip([p for p in params if p.grad is not None])
            self.optimizer.step(*args, **kwargs)
        finally:
            for p, grad in hidden:
                p.grad = grad
        for p in params:
            p.grad = None

    def _hide_others(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Take away, for this step, the gradients of held parameters not passed (the torch
        optimizer skips a parameter without a gradient, so it neither moves nor ages)."""
        passed = set(params)
        if len(passed) == len(self._held):  # every held parameter was passed
            return []
        hidden = [(p, p.grad) for p in self._held if p not in passed and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        return hidden  # type: ignore[return-value]

    def _clip(self, params: list[torch.Tensor]) -> None:
        clip = self.pt_clip_args
        if not clip or not params:
            return
        if clip.get("clip_norm") is not None:
            # Each gradient scaled by min(1, c / (|g| + 1e-6)), as clip_grad_norm_ on one tensor.
            grads = [p.grad for p in params]
            norms = torch.stack(torch._foreach_norm(grads))  # type: ignore[arg-type]
            coef = (clip["clip_norm"] / (norms + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, list(coef.unbind()))  # type: ignore[arg-type]
        if clip.get("clip_value") is not None:
            clip_grad_value_(params, clip["clip_value"])

    # -- parameters and groups --------------------------------------------------------------

    def _add(self, param: torch.Tensor) -> None:
        name = self._name(param)
        saved = None if name is None else self._state_waiting_to_be_consumed.pop(name, None)
        self._place(param, saved)
        self._held.add(param)

    def _place(self, param: torch.Tensor, saved: dict | None) -> None:
        """Put ``param`` in its group, with the state and hyperparameters of ``saved`` (a
        one-parameter torch ``state_dict``) where given."""
        args = dict(self._get_optim_args(param))
        if saved is None:
            self._group(param, args)
            return
        # torch's own load_state_dict casts the state to the parameter's device and dtype.
        one = self.pt_optim_constructor([param], **args)
        one.load_state_dict(saved)
        self._group(param, {**args, **_hyperparameters(one.param_groups[0])})
        assert self.optimizer is not None
        self.optimizer.state[param] = one.state[param]

    def _group(self, param: torch.Tensor, args: dict) -> None:
        """Put ``param`` in the parameter group with ``args`` (made if none has them). Missing
        arguments take the optimizer's own defaults, as they would for a per-parameter one."""
        args = {**self._defaults, **args}
        if self._foreach and args.get("foreach") is None and not args.get("fused"):
            args["foreach"] = True
        if self.optimizer is None:
            self.optimizer = self.pt_optim_constructor([param], **args)
            return
        wanted = _hyperparameters(args)
        for group in self.optimizer.param_groups:
            if {k: group.get(k) for k in wanted} == wanted:
                group["params"].append(param)
                return
        self.optimizer.add_param_group({"params": [param], **args})

    @staticmethod
    def _name(param: torch.Tensor) -> str | None:
        store = pyro.get_param_store()
        try:
            return store.param_name(param)
        except KeyError:  # a parameter kept outside the param store has no name to restore by
            return None

    # -- state ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``pickle``) holds the state by parameter name, as
        :meth:`get_state` gives it, and takes it up when it first steps the param store's
        parameters of those names: a copy of the torch optimizer would hold copies of the
        parameters, which the copy would never step, and start every moment afresh (and Pyro's
        parameters carry weak references, which ``pickle`` refuses)."""
        state = dict(self.__dict__)
        waiting = {**self._state_waiting_to_be_consumed, **self.get_state()}
        state.update(optimizer=None, _held=set(), _state_waiting_to_be_consumed=waiting)
        return state

    def get_state(self) -> dict:
        """``{param name: the torch state_dict of that one parameter}``, as PyroOptim's."""
        out: dict[str, dict] = {}
        if self.optimizer is None:
            return out
        for group in self.optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                name = self._name(p)
                if name is None:
                    continue
                state = self.optimizer.state.get(p)
                out[name] = {
                    "state": {0: state} if state else {},
                    "param_groups": [{**hyper, "params": [0]}],
                }
        return out

    def set_state(self, state_dict: dict) -> None:
        """Load a :meth:`get_state` (or PyroOptim ``get_state``): parameters already held take
        their state now, the others on their first step."""
        held = {self._name(p): p for p in self._held}
        waiting = {}
        for name, saved in state_dict.items():
            param = held.get(name)
            if param is None:
                waiting[name] = saved
            else:
                self._reload(param, saved)
        self._state_waiting_to_be_consumed.update(waiting)

    def _reload(self, param: torch.Tensor, saved: dict) -> None:
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                group["params"] = [p for p in group["params"] if p is not param]
        self.optimizer.param_groups = [g for g in self.optimizer.param_groups if g["params"]]
        self.optimizer.state.pop(param, None)
        self._place(param, saved)
