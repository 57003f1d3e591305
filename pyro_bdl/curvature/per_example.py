r"""Squared per-example gradients without a batch × parameters tensor (docs/design/vogn.md).

For per-example losses :math:`\ell_i` and a parameter tensor :math:`W`, VOGN needs the summed
gradient :math:`\sum_i g_i` and the sum of squares :math:`\sum_i g_i \odot g_i`, where
:math:`g_i = \nabla_W \ell_i`. Forward hooks save each layer's input :math:`a` and the gradient
edge of its output; one backward pass gives :math:`\delta_i = \partial(\sum_j \ell_j)/\partial z_i`
at every recorded output, and the per-layer rules below finish the job:

- ``Linear`` (any ``(B, ..., in)`` input) and ``Conv1d/2d/3d`` (any stride, padding, dilation,
  groups, padding mode): one of three exact forms per call, picked by a cost model from the
  layer's shapes (:mod:`pyro_bdl.curvature.per_example_forms`): a grouped weight-gradient
  convolution or an unfolded input and a batched product, both forming the per-example gradient
  :math:`\sum_p \delta_{i,p} a_{i,p}^\top` over positions :math:`p` and squaring it, or the
  position-pair identity that forms none (for one position, a ``Linear`` on ``(B, in)``:
  :math:`\sum_i (\delta_i a_i^\top)^2 = (\delta^2)^\top(a^2)`), in chunks of the batch so the
  extra memory stays below ``max_chunk_elements``.
- ``BatchNorm`` affine parameters: per-example sums over positions of :math:`\delta \odot \hat x`
  (weight) and :math:`\delta` (bias), :math:`\hat x` recomputed from the saved input.
- Any other module with parameters: ``torch.func.vmap(grad)`` over chunks of examples of
  :math:`\langle \delta_i, f(a_i; \theta)\rangle` (the same fallback that
  :func:`vmap_squared_gradients`, the test oracle, uses on a whole loss).

A module called several times in one forward pass (weight sharing) has its per-example gradients
summed over calls before squaring. Lifted layers (:func:`pyro_bdl.bayesianize`) work the same way:
the sampled weight is whatever the layer used in the forward pass.

Two rules to know. Examples are dim 0 of every recorded layer's input and output. A BatchNorm
layer in training mode couples the examples of a batch through its statistics; then
:math:`\delta_i` is example :math:`i`'s share of the summed loss's gradient at the layer output
(the per-example gradients still sum to the exact total gradient), the definition used by VOGN's
reference implementation.

References:

- Goodfellow, "Efficient Per-Example Gradient Computations", arXiv 1510.01799, 2015.
- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019, Appendix B.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pyro_bdl._validation import check_positive_int
from pyro_bdl.curvature.layer_rules import (
    accumulate_sums,
    batch_slices,
    batchnorm_per_example,
    batchnorm_saved_stats,
)
from pyro_bdl.curvature.per_example_forms import (
    FORMS,
    choose_form,
    numbers_per_example,
    pairs_sums,
    per_example,
)
from pyro_bdl.curvature.per_example_functional import (
    direct_targets,
    module_per_example,
    substitute,
    vmap_squared_gradients,
)

__all__ = ["NoPerExampleForm", "PerExampleGradients", "substitute", "vmap_squared_gradients"]

#: Default bound on the numbers held by a chunk's temporaries: 16 MB in fp32, below glibc's
#: 32 MB threshold above which every freed block goes back to the kernel (and the next step's
#: allocation page-faults it in afresh).
DEFAULT_MAX_CHUNK_ELEMENTS = 2**22

Key = tuple[nn.Module, str]


def _is(module: nn.Module, base: type[nn.Module]) -> bool:
    """``module`` is a ``base`` whose forward is ``base``'s own (lifted classes included)."""
    return isinstance(module, base) and type(module).forward is base.forward


def _kind(module: nn.Module) -> str:
    if _is(module, nn.Linear):
        return "linear"
    if any(_is(module, conv) for conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        type(module).forward is nn.modules.batchnorm._BatchNorm.forward
    ):
        return "batchnorm"
    return "fallback"


@dataclass
class _Call:
    """One recorded call of a layer."""

    args: tuple
    kwargs: dict
    edge: Any  # the gradient edge of the output at call time (robust to later in-place ops)
    versions: tuple[int, ...]
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    delta: torch.Tensor | None = None
    stats: tuple[torch.Tensor, torch.Tensor] | None = None  # BatchNorm's batch mean, 1/std


class NoPerExampleForm(ValueError):
    """A method that needs per-example gradients (VOGN) met a weight site whose layer has no
    per-example form (:meth:`PerExampleGradients.require_forms`)."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-example sums are formed in: ``dtype``, raised to float32 if narrower (the
    bf16 and fp16 tensors of autocast lose the answer in a sum of squares)."""
    if dtype.is_floating_point and torch.finfo(dtype).bits < 32:
        return torch.float32
    return dtype


# -- the tape ----------------------------------------------------------------------------------


class PerExampleGradients:
    r"""Records a forward pass, then gives summed and squared per-example gradients.

    Inside the ``with`` block, forward hooks save what each layer with parameters (or lifted
    weight sites) needs; :meth:`squared_gradients` then runs one backward pass of the summed
    per-example losses and returns, per parameter, :math:`\sum_i g_i` and
    :math:`\sum_i g_i \odot g_i`. No tensor of shape batch × parameters is ever built: the
    per-example gradients that are needed at all are formed in chunks of at most
    ``max_chunk_elements`` numbers.

    Usage::

        with PerExampleGradients(net) as tape:
            losses = F.cross_entropy(net(x), y, reduction="none")
        grads, squared = tape.squared_gradients(losses)

    :param torch.nn.Module module: the network; its submodules with trainable parameters or
        lifted sites are hooked. ``None`` hooks every module called in the block (the process-
        wide hooks VOGN uses when it runs a Pyro model; results are then keyed by
        ``(module, name)``).
    :param layers: hook exactly these modules instead (a tape kept across steps over layers
        already known, as VOGN's after its first step); results are keyed by ``(module, name)``.
    :param int chunk_size: examples per chunk (default: as many as fit in
        ``max_chunk_elements``).
    :param int max_chunk_elements: bound on the numbers held per chunk.
    :param str form: ``"grouped"``, ``"unfold"`` or ``"pairs"`` forces that form of the
        ``Linear`` and convolution rules wherever it applies (``grouped``: convolutions;
        ``pairs``: a layer's only call); default ``None``, the cost model's choice per call.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        *,
        layers: Sequence[nn.Module] | None = None,
        chunk_size: int | None = None,
        max_chunk_elements: int = DEFAULT_MAX_CHUNK_ELEMENTS,
        form: str | None = None,
    ):
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(
                f"module must be a torch.nn.Module or None; got {type(module).__name__}. Pass the "
                "network (or the layer) whose per-example gradients to record."
            )
        if layers is not None and (
            module is not None or not all(isinstance(m, nn.Module) for m in layers)
        ):
            raise TypeError(
                "layers must be a list of torch.nn.Module, given instead of module (not with it); "
                f"got module={type(module).__name__} and layers of "
                f"{sorted({type(m).__name__ for m in layers})}. Pass layers=[...] of modules with "
                "module=None."
            )
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        check_positive_int("max_chunk_elements", max_chunk_elements)
        if form is not None and form not in FORMS:
            raise ValueError(
                f"form must be one of {FORMS} or None; got {form!r}. Pass one of them, or None "
                "for the cost model's choice per call."
            )
        self.form = form
        self.module = module
        self.chunk_size = chunk_size
        self.max_chunk_elements = max_chunk_elements
        self.calls: dict[nn.Module, list[_Call]] = {}
        self._handles: list[Any] = []
        self._paused = False
        # (kind, targets) per module, found once per tape: a tape reused across steps (as VOGN
        # does) skips the per-call look-up.
        self._info: dict[nn.Module, tuple[str, list[str]]] = {}
        self._layers = None if layers is None else list(layers)
        self._forms: dict[tuple, list[str]] = {}
        #: Layers with weights that were called but returned no single tensor (a recurrent
        #: layer's tuple, attention's pair): the type of what they returned.
        self.unrecorded: dict[nn.Module, str] = {}

    def _layer_info(self, module: nn.Module) -> tuple[str, list[str]]:
        info = self._info.get(module)
        if info is None:
            info = self._info[module] = (_kind(module), direct_targets(module))
        return info

    # -- recording -----------------------------------------------------------------------------

    def __enter__(self) -> PerExampleGradients:
        self.calls, self.unrecorded = {}, {}
        if self._layers is not None:
            self._handles = [
                sub.register_forward_hook(self._hook, with_kwargs=True) for sub in self._layers
            ]
        elif self.module is None:
            self._handles = [
                nn.modules.module.register_module_forward_hook(self._hook, with_kwargs=True)
            ]
        else:
            self._handles = [
                sub.register_forward_hook(self._hook, with_kwargs=True)
                for sub in self.module.modules()
                if direct_targets(sub)
            ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        """Drop the recorded calls (and the activations they hold) before the next block."""
        self.calls, self.unrecorded = {}, {}

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._paused or not torch.is_grad_enabled():
            return None
        kind, targets = self._layer_info(module)
        if not targets:
            return None
        if not isinstance(output, torch.Tensor):
            self.unrecorded[module] = type(output).__name__
            return None
        if not output.requires_grad:
            # Nothing upstream requires grad (sampled weights usually do not): make the output a
            # leaf that does, so that the backward pass reaches this layer.
            output = output.detach().requires_grad_()
        values = {}
        if kind == "fallback":
            values = {name: getattr(module, name) for name in targets}
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        call = _Call(
            args, kwargs, get_gradient_edge(output), tuple(t._version for t in tensors), values
        )
        if kind == "batchnorm" and module.training:
            call.stats = batchnorm_saved_stats(output)
        self.calls.setdefault(module, []).append(call)
        return output

    def require_forms(self, sites: Iterable[tuple[str, nn.Module]], method: str) -> None:
        """Refuse weight sites that the recorded pass gives no per-example gradient.

        A site has one when its own layer was called and returned one tensor. It has none when
        the layer returned something else (``nn.LSTM``/``GRU``/``RNN`` return a tuple,
        ``nn.MultiheadAttention`` a pair) or when another layer read the weight without calling
        its layer (``nn.MultiheadAttention`` reads ``out_proj.weight`` directly); squared
        per-example gradients would then silently leave those sites out.

        :param sites: ``(site name, layer owning it)`` of every weight site, as read in the pass.
        :param str method: the method that needs the forms, for the message (``"VOGN"``).
        :raises NoPerExampleForm: naming each such site and its layer, and what to do instead.
        """
        names = {sub: name for name, sub in (self.module or nn.Module()).named_modules()}
        by_layer: dict[nn.Module, list[str]] = {}
        for site, layer in sites:
            if layer not in self.calls:
                by_layer.setdefault(layer, []).append(repr(site))
        missing = []
        for layer, layer_sites in by_layer.items():
            label = layer.__dict__.get("_pyro_name", names.get(layer))
            what = f"{type(layer).__name__} {label!r}" if label else type(layer).__name__
            returned = self.unrecorded.get(layer)
            why = (
                f"returns a {returned}, not one tensor"
                if returned is not None
                else "was not called: another layer read its weights directly"
            )
            missing.append(f"{what} {why} (sites {', '.join(layer_sites)})")
        if missing:
            raise NoPerExampleForm(
                f"{method} needs the per-example gradient of every weight site, and these layers "
                f"have no per-example form: {'; '.join(missing)}. Nothing was set up. "
                "Use IVON (pyro_bdl.infer.IVON: natural-gradient VI from ordinary gradients, "
                "which takes every layer), or keep these layers fixed: freeze them with "
                "layer.requires_grad_(False) before bayesianize (hidden but trainable, VOGN "
                "could not train them either). docs/methods/layers.md lists the layers each "
                "method takes."
            )

    # -- gradients -----------------------------------------------------------------------------

    def compute(
        self,
        losses: torch.Tensor,
        *,
        retain_graph: bool = False,
        out: Mapping[Key, tuple[torch.Tensor, torch.Tensor]] | None = None,
        add: bool = False,
    ) -> dict[Key, tuple[torch.Tensor, torch.Tensor]]:
        """``{(module, name): (Σᵢ gᵢ, Σᵢ gᵢ²)}`` for every recorded target.

        :param out: optional destinations ``{key: (sums, squares)}`` shaped like the parameters
            (views of one flat buffer, say): results with a destination are written there
            (or added to it, with ``add=True``) instead of into new tensors.
        """
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.numel() == 0:
            raise ValueError(
                "losses must be a non-empty 1-d tensor of per-example losses (one per row of the "
                f"batch); got {getattr(losses, 'shape', type(losses).__name__)}. Use "
                "reduction='none' (and sum any other dims)."
            )
        if not self.calls:
            raise RuntimeError(
                "no layer was recorded: run the forward pass inside `with tape:` (with grad "
                "enabled) before calling squared_gradients."
            )
        batch = losses.shape[0]
        order = [(m, c) for m, calls in self.calls.items() for c in calls]
        for module, call in order:
            tensors = [
                t for t in (*call.args, *call.kwargs.values()) if isinstance(t, torch.Tensor)
            ]
            if tuple(t._version for t in tensors) != call.versions:
                raise RuntimeError(
                    f"the input of {type(module).__name__} was modified in place after the layer "
                    "used it; per-example gradients need the input as the layer saw it. Make the "
                    "later operation out of place (for example ReLU(inplace=False), x = x + y "
                    "instead of x += y)."
                )
            first = call.args[0] if call.args else None
            if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] != batch:
                raise ValueError(
                    f"{type(module).__name__} was called with an input of shape "
                    f"{getattr(first, 'shape', None)}; per-example gradients need dim 0 to be "
                    f"the batch of {batch} examples (the length of losses). A layer applied to "
                    "something other than the batch (DoRA's LoRA matrices, applied to an "
                    "identity matrix) has no per-example form: train it with IVON "
                    "(pyro_bdl.infer.IVON), which takes every layer, or keep it fixed."
                )
        if not losses.requires_grad:
            raise ValueError(
                "losses do not depend on any recorded layer (they do not require grad); compute "
                "them from the network's output inside the `with tape:` block."
            )
        deltas = torch.autograd.grad(
            losses.sum(),
            [c.edge for _, c in order],
            allow_unused=True,
            retain_graph=retain_graph,
            materialize_grads=True,
        )
        for (_, call), delta in zip(order, deltas):
            # Under autocast (bf16, fp16) a layer's output gradient, and the input of a layer
            # after the first, are in reduced precision; the sums of squares are accumulated in
            # at least float32 (the parameters' precision), so both are raised to it here.
            call.delta = delta.to(accumulation_dtype(delta.dtype))
            first = call.args[0] if call.args else None
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                wide = torch.promote_types(accumulation_dtype(first.dtype), call.delta.dtype)
                call.delta = call.delta.to(wide)
                call.args = (first.to(wide), *call.args[1:])
        result: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            with torch.no_grad():
                for module, calls in self.calls.items():
                    sums = self._module_sums(module, calls, batch, out, add)
                    for name, (g, s) in sums.items():
                        result[(module, name)] = (g, s)
        finally:
            for _, call in order:
                call.delta = None
        return result

    def squared_gradients(
        self, losses: torch.Tensor, *, retain_graph: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(grads, squared)``: Σᵢ gᵢ and Σᵢ gᵢ ⊙ gᵢ keyed by dotted parameter (site) name.

        :param torch.Tensor losses: per-example losses, shape ``(B,)``.
        :param bool retain_graph: keep the autograd graph (to backpropagate again).
        """
        if self.module is None:
            raise ValueError(
                "squared_gradients names results after the module given to PerExampleGradients; "
                "this tape hooks every module (module=None), so use compute() instead."
            )
        names = {sub: prefix for prefix, sub in self.module.named_modules()}
        raw = self.compute(losses, retain_graph=retain_graph)
        grads, squared = {}, {}
        for (sub, pname), (g, s) in raw.items():
            prefix = names.get(sub)
            key = f"{prefix}.{pname}" if prefix else pname
            grads[key], squared[key] = g, s
        return grads, squared

    def _module_sums(
        self,
        module: nn.Module,
        calls: list[_Call],
        batch: int,
        out: Mapping[Key, tuple[torch.Tensor, torch.Tensor]] | None = None,
        add: bool = False,
    ):
        kind, targets = self._layer_info(module)
        dest = {} if out is None else {n: out[(module, n)] for n in targets if (module, n) in out}
        # The choice depends on shapes only: found once per layer and input shape.
        key = (module, len(calls), *(tuple(c.args[0].shape) for c in calls))
        forms = self._forms.get(key)
        if forms is None:
            forms = self._forms[key] = [self._form(module, kind, c, len(calls) == 1) for c in calls]
        if forms == ["pairs"]:
            a, d = calls[0].args[0], calls[0].delta
            sizes = (self.max_chunk_elements, self.chunk_size)
            return pairs_sums(module, a, d, targets, dest, add, *sizes)  # type: ignore[arg-type]
        per_row = sum(self._numbers(module, kind, f, c) for f, c in zip(forms, calls))
        sums: dict[str, list[torch.Tensor]] = {}
        for lo, hi in batch_slices(batch, per_row, self.max_chunk_elements, self.chunk_size):
            chunk: dict[str, torch.Tensor] = {}
            for form, call in zip(forms, calls):
                assert call.delta is not None
                part = self._per_example(module, kind, form, call, lo, hi)
                for name, pe in part.items():
                    if name in targets:
                        chunk[name] = chunk[name] + pe if name in chunk else pe
            for name, pe in chunk.items():
                accumulate_sums(sums, name, pe, dest.get(name), add)
        return {k: (v[0], v[1]) for k, v in sums.items()}

    def _form(self, module: nn.Module, kind: str, call: _Call, single: bool) -> str:
        """The form of a ``Linear`` or convolution call (``kind`` for other layers)."""
        if kind not in ("linear", "conv"):
            return kind
        if self.form == "unfold" or (self.form == "grouped" and kind == "conv"):
            return self.form
        if self.form == "pairs" and single:
            return "pairs"
        return choose_form(module, call.args[0], call.delta, single)  # type: ignore[arg-type]

    def _numbers(self, module: nn.Module, kind: str, form: str, call: _Call) -> int:
        if kind in ("linear", "conv"):
            return numbers_per_example(module, form, call.args[0], call.delta)  # type: ignore[arg-type]
        # Other layers: a per-example gradient of every target, and the input.
        targets = [
            module._parameters.get(n, getattr(module, "_bdl_init_" + n, None))
            for n in self._layer_info(module)[1]
        ]
        sizes = [t.numel() if isinstance(t, torch.Tensor) else 1 for t in targets]
        return sum(sizes) + int(call.args[0][0].numel())

    def _per_example(
        self, module, kind: str, form: str, call: _Call, lo: int, hi: int
    ) -> dict[str, torch.Tensor]:
        a, d = call.args[0][lo:hi], call.delta[lo:hi]  # type: ignore[index]
        if kind in ("linear", "conv"):
            return per_example(module, form, a, d)
        if kind == "batchnorm":
            return batchnorm_per_example(module, a, d, call.args[0], call.stats)
        assert call.delta is not None
        self._paused = True  # the fallback calls the module again: record nothing meanwhile
        try:
            return module_per_example(
                module, call.args, call.kwargs, call.values, call.delta, lo, hi
            )
        finally:
            self._paused = False
