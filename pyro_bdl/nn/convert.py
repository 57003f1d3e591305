"""Turning every layer of a network into a :class:`~pyro.nn.PyroModule` in place, whatever its
class, or refusing the network before any layer changes.

Pyro converts a layer by giving it the class ``PyroModule[type(layer)]``, a subclass of the
layer's class and of ``PyroModule``. Two kinds of third-party layer need care:

- a class with its own metaclass (PEFT's tuners derive from ``abc.ABC``): Pyro's subclass
  would combine that metaclass with ``PyroModule``'s and fail half-way through the conversion
  with ``TypeError: metaclass conflict``. :func:`pyro_classes` builds every subclass the
  network needs first, under a metaclass derived from both, so the conversion cannot fail;
- a class whose ``__setattr__`` keeps a cache of its weights (``nn.RNNBase``'s
  ``_flat_weights``): :func:`set_weight` sets a lifted weight through ``PyroModule``'s
  ``__setattr__`` alone. Pyro itself makes ``_flat_weights`` re-read the weights on every
  access of a converted RNN, so the recurrent kernels get the sampled weights.

Layers that cannot work once converted are refused by :func:`pyro_classes`, naming the layer
and the way out (see docs/methods/layers.md).

A converted layer's class is a subclass of ``PyroModule[type(layer)]`` (:func:`lifted_class`)
whose attribute lookup and call skip Pyro's per-access work where it does nothing: a forward
pass reads every submodule and buffer through ``PyroModule.__getattr__`` and calls every layer
through ``PyroModule.__call__``, hundreds of times per pass on a ResNet.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pyro.nn import PyroModule
from pyro.nn.module import _Context, _make_name, _PyroModuleMeta
from torch import nn

__all__ = [
    "FastAccess",
    "LayerNotLiftable",
    "convert_",
    "lifted_class",
    "pyro_classes",
    "set_weight",
]

_METAS: dict[tuple[type, ...], type] = {}
_LIFTED: dict[type, type] = {}
_PYRO_GETATTR = PyroModule.__getattr__
_PYRO_CALL = PyroModule.__call__


class LayerNotLiftable(TypeError):
    """A layer of the network cannot become a ``PyroModule``; nothing was changed."""


def _new(module_class: type) -> Any:
    """Unpickling helper: an empty instance of the converted ``module_class`` (rebuilding the
    class in a fresh process, where no conversion has run yet)."""
    return object.__new__(lifted_class(module_class))


def _reduce(self: nn.Module) -> tuple:
    state = getattr(self, "__getstate__", self.__dict__.copy)()
    return _new, (type(self).__dict__["_bdl_layer_class"],), state


class FastAccess:
    """Mixin of the lifted layer classes: ``PyroModule.__getattr__`` and ``__call__`` with the
    same results, minus the work they do on every access that cannot change anything.

    - Reading a submodule that is a named ``PyroModule`` (or ``None``), a buffer that is not a
      parameter, or a ``None`` parameter returns it straight from the layer's dicts: Pyro would
      look up the same dicts in the same order (its sample and param sites first) and add
      nothing. Every other name (a sample site, a parameter, which Pyro registers as a
      ``pyro.param`` site, a plain ``nn.Module``) takes Pyro's own path.
    - Calling a layer while its Pyro context is already active (every layer inside a lifted
      network's forward pass) is ``nn.Module.__call__``: Pyro's ``__call__`` would only count
      the nesting up and down and read a global setting it acts on outside a context.
    """

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        try:
            params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
            pyro_params, pyro_samples = d["_pyro_params"], d["_pyro_samples"]
        except KeyError:  # an instance being built or unpickled
            return _PYRO_GETATTR(self, name)  # type: ignore[arg-type]
        if name not in pyro_params and name not in pyro_samples:
            if name in params:
                if params[name] is None:
                    return None
            elif name in buffers:
                value = buffers[name]
                if not isinstance(value, nn.Parameter):
                    return value
            elif name in modules:
                child = modules[name]
                if child is None or (
                    isinstance(child, PyroModule) and child.__dict__.get("_pyro_name")
                ):
                    return child
        return _PYRO_GETATTR(self, name)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__["_pyro_context"].active:
            return super(PyroModule, self).__call__(*args, **kwargs)  # type: ignore[misc]
        return _PYRO_CALL(self, *args, **kwargs)  # type: ignore[arg-type]


def _metaclass(metas: list[type]) -> type:
    """The most derived of ``metas``, or one class derived from all of them."""
    distinct = list(dict.fromkeys(metas))
    for meta in distinct:
        if all(issubclass(meta, other) for other in distinct):
            return meta
    key = tuple(distinct)
    combined = _METAS.get(key)
    if combined is None:
        combined = type("Pyro" + "".join(m.__name__ for m in distinct[1:]), key, {})
        _METAS[key] = combined
    return combined


def pyro_class(module_class: type) -> type:
    """``PyroModule[module_class]``, built under a combined metaclass where the class has its
    own (Pyro's cache then returns it for every later conversion)."""
    if issubclass(module_class, PyroModule) or module_class is nn.Module:
        return PyroModule[module_class]
    cache = _PyroModuleMeta._pyro_mixin_cache
    if module_class in cache:
        return cache[module_class]
    bases = [pyro_class(b) for b in module_class.__bases__ if issubclass(b, nn.Module)]
    meta = _metaclass([type(module_class), *map(type, bases)])
    if meta is _PyroModuleMeta:
        return PyroModule[module_class]
    converted = meta(
        "Pyro" + module_class.__name__,
        (module_class, *bases),
        {"__reduce__": _reduce, "__module__": __name__, "_bdl_layer_class": module_class},
    )
    cache[module_class] = converted
    return converted


def lifted_class(module_class: type) -> type:
    """The class a lifted layer of ``module_class`` gets: :func:`pyro_class` with the
    :class:`FastAccess` mixin in front, where Pyro's own ``__getattr__`` and ``__call__`` are the
    ones that class resolves to (a layer class with its own, such as a wrapper that forwards
    attributes to what it wraps, keeps :func:`pyro_class`)."""
    base = pyro_class(module_class)
    pyros_own = getattr(base, "__getattr__", None) is _PYRO_GETATTR and base.__call__ is _PYRO_CALL
    if issubclass(module_class, PyroModule) or not pyros_own:
        return base
    lifted = _LIFTED.get(base)
    if lifted is None:
        lifted = type(base)(
            base.__name__,
            (FastAccess, base),
            {"__reduce__": _reduce, "__module__": __name__, "_bdl_layer_class": module_class},
        )
        _LIFTED[base] = lifted
    return lifted


def _refusal(name: str, layer: nn.Module) -> str | None:
    """Why ``layer`` cannot be lifted (``None`` if it can)."""
    what = f"layer {name or '<root>'!r} ({type(layer).__name__})"
    if isinstance(layer, nn.Module) and type(layer).__module__.startswith("torch.jit"):
        return (
            f"{what} is a TorchScript module, whose class cannot change. Lift the Python "
            "module before scripting it."
        )
    # Read the instance dict: some wrappers' __getattr__ raise other errors than AttributeError.
    if layer.__dict__.get("gradient_checkpointing") is True:
        return (
            f"{what} has gradient checkpointing on: its forward pass runs again during the "
            "backward pass, outside the Pyro trace, and would read freshly drawn weights. Turn it "
            "off before bayesianize (Hugging Face: model.activation_checkpointing_disable(), "
            "formerly gradient_checkpointing_disable())."
        )
    return None


def pyro_classes(module: nn.Module) -> dict[type, type]:
    """Build the ``PyroModule`` class (:func:`lifted_class`) of every layer of ``module`` (the
    only global state this touches is Pyro's class cache and this module's), or raise
    :class:`LayerNotLiftable` naming the first layer that cannot be lifted and what to do
    instead. The module itself is not changed."""
    out: dict[type, type] = {}
    for name, layer in module.named_modules():
        reason = _refusal(name, layer)
        if reason is not None:
            raise LayerNotLiftable(reason)
        cls = type(layer)
        if cls in out:
            continue
        try:
            out[cls] = lifted_class(cls)
        except TypeError as e:
            raise LayerNotLiftable(
                f"layer {name or '<root>'!r} ({cls.__name__}) cannot become a PyroModule: {e}. "
                "Hide its parameters (hide=[that class]) and lift the layers around it, or wrap "
                "it in a module whose forward calls it."
            ) from e
    return out


def convert_(module: nn.Module) -> None:
    """Convert ``module`` and every layer in it to ``PyroModule`` s in place, all sharing the
    root's Pyro context and named by their paths, as :func:`pyro.nn.module.to_pyro_module_`
    does, but without re-registering each child through ``setattr``: a wrapper whose
    ``__getattr__`` looks into its children (PEFT's ``ModulesToSaveWrapper``) breaks while one of
    them is removed. After :func:`pyro_classes` has accepted the module, this cannot fail."""
    classes = pyro_classes(module)
    new = {id(layer) for layer in module.modules() if not isinstance(layer, PyroModule)}
    for layer in module.modules():
        if id(layer) in new:
            layer.__class__ = classes[type(layer)]
            state = layer.__dict__
            state["_pyro_name"] = ""
            state["_pyro_context"] = _Context()
            state["_pyro_params"] = OrderedDict()
            state["_pyro_samples"] = OrderedDict()
    # Top-down, as Pyro's add_module would: a new layer, or any layer under a new one, joins its
    # parent's context under its path.
    for parent in module.modules():
        for key, child in parent._modules.items():
            if child is not None and (id(child) in new or id(parent) in new):
                child._pyro_set_supermodule(  # type: ignore[operator]
                    _make_name(parent._pyro_name, key), parent._pyro_context
                )


def set_weight(layer: nn.Module, name: str, value: Any) -> None:
    """``layer.<name> = value`` through ``PyroModule.__setattr__`` only, bypassing a layer
    class's own ``__setattr__`` (``nn.RNNBase`` would read all its weights first, one of which
    is being replaced)."""
    PyroModule.__setattr__(layer, name, value)
