"""Copying and pickling a guide that needs its model after set-up.

Pyro's ``AutoGuide.__getstate__`` sets the guide's own ``_model`` to ``None`` before pickling (a
model is often a closure, which does not pickle). A Pyro guide needs its model only to set up, so
that is harmless there; a guide whose later calls run the model (a Laplace ``fit`` or
``predict``) would be left unable to make them, the *original* of a ``copy.deepcopy``,
``pickle.dumps`` or ``torch.save`` included. :class:`KeepsModelOnCopy` drops the model from the
pickled state only, and keeps it there when it is a :class:`~pyro_bdl.models.NetworkModel`
that pickles: the copy then runs its own copy of the network, whose layers are the ones its
layout refers to (pickle keeps shared objects shared). Any other model is left out, as Pyro does.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import nn

from pyro_bdl.models import NetworkModel

__all__ = ["KeepsModelOnCopy", "model_lost", "model_pickles"]


class KeepsModelOnCopy:
    """Mixin for a Pyro autoguide (listed before it): the guide keeps its model through
    ``__getstate__``, and the state keeps it when :func:`model_pickles`."""

    _model: Any
    _user_model: Any

    def __getstate__(self):
        keep = {k: self.__dict__[k] for k in ("_model", "master", "_user_model")}
        try:
            self._user_model = None
            state = super().__getstate__()  # type: ignore[misc]
        finally:
            self.__dict__.update(keep)
        if self._user_model and model_pickles(self._user_model[0]):
            state["_model"], state["_user_model"] = self._model, self._user_model
        return state


def model_lost(guide: str, what: str) -> RuntimeError:
    """The error of a copied guide, left without its model, asked to ``what``."""
    return RuntimeError(
        f"this {guide} was copied or unpickled without its model (a model other than a "
        "pyro_bdl.models NetworkModel is not pickled with the guide, as in Pyro), so it can "
        f"sample its posterior but not {what}. Create the guide of the model again and load "
        "this one's state_dict() into it, or save and load with "
        "pyro_bdl.checkpoint.save_checkpoint/load_checkpoint."
    )


class _Skeleton(pickle.Pickler):
    """Pickles an object without its modules and tensors (the costly parts, which pickle)."""

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, (nn.Module, torch.Tensor)) else None


def model_pickles(model) -> bool:
    """Whether ``model`` is a :class:`~pyro_bdl.models.NetworkModel` whose own attributes
    pickle (a ``split`` given as a lambda does not)."""
    if not isinstance(model, NetworkModel):
        return False
    try:
        _Skeleton(io.BytesIO()).dump(model)
    except Exception:  # what fails to pickle raises any type (PicklingError, TypeError, ...)
        return False
    return True
