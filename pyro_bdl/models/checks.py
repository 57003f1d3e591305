"""The checks :class:`~pyro_bdl.models.NetworkModel` runs on every batch before the network sees
it: the batch itself (:func:`check_batch`), and the inputs against what the network expects
(:class:`NetworkShape`: the dtype and width of its first layer, the width of its last).

Every check is O(1) in the network's size and raises before any state (weights sampled, running
statistics, random number generators, the param store) changes. Two checks need the network's
output, so the calls that run them are under :func:`rollback`: a model's first call, whose output
shape is not yet known, and every call that scores a Gaussian likelihood, whose range check
(:func:`~pyro_bdl.models.noise.check_likelihood_range`) compares the output with the targets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import pyro
import torch
from torch import nn
from torch.nn.modules import activation

from pyro_bdl._validation import autocast_enabled, check_finite, finite_probe
from pyro_bdl.nn.lift import constant_buffers

__all__ = [
    "IGNORE_INDEX",
    "NetworkShape",
    "batch_tensors",
    "check_batch",
    "check_binary_labels",
    "check_device",
    "check_network_input",
    "label_range",
    "rollback",
]

TASKS = ("classification", "binary", "multilabel", "regression", "tokens")
#: The label of a token that the token-level likelihood skips (Hugging Face's convention).
IGNORE_INDEX = -100

# Layers that keep the shape of their input, so the width seen past them is the one before.
_SHAPE_KEEPING: tuple[type, ...] = (nn.Identity, nn.modules.dropout._DropoutNd)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _keeps_shape(module: nn.Module) -> bool:
    # Lifted networks' layers are PyroModule subclasses of the torch classes: look at the MRO.
    if isinstance(module, (*_SHAPE_KEEPING, nn.MultiheadAttention)):
        return not isinstance(module, nn.MultiheadAttention)
    return any(c.__module__ == activation.__name__ for c in type(module).__mro__)


def label_range(y: torch.Tensor) -> tuple[int, int]:
    """(min, max) of the (non-empty) labels in one pass over them."""
    lo, hi = torch.aminmax(y)
    return int(lo), int(hi)


def check_binary_labels(y: torch.Tensor) -> None:
    """Refuse labels other than 0 and 1 (of any dtype), naming the first offending one."""
    bad = (y != 0) & (y != 1)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"y must hold binary labels 0 or 1 for a Bernoulli likelihood; got {y[first].item()!r} "
            f"at index {first} ({int(bad.sum())} such value(s)). Encode the positive class as 1 "
            "(e.g. (y == positive).float()), or use models.classifier for more than two classes."
        )


def batch_tensors(x: Any) -> dict[str, torch.Tensor]:
    """The tensors of a batch by the name errors give them (``x``, ``x['input_ids']``, ``x[0]``):
    one tensor, a mapping of tensors or a tuple of tensors (:mod:`pyro_bdl.models.structured`);
    refuses anything else, and a ``labels`` entry, which belongs in ``y``."""
    if isinstance(x, torch.Tensor):
        return {"x": x}
    if isinstance(x, Mapping):
        if "labels" in x:
            raise ValueError(
                "x has a 'labels' entry, which the network would receive as an argument; the "
                "model takes the labels as y. Pass y = batch.pop('labels')."
            )
        items = {f"x[{k!r}]": v for k, v in x.items()}
    elif isinstance(x, (tuple, list)):
        items = {f"x[{i}]": v for i, v in enumerate(x)}
    else:
        raise TypeError(
            f"x must be a torch.Tensor, a mapping of tensors (passed to the network as keyword "
            f"arguments) or a tuple of tensors (positional arguments); got {type(x).__name__}."
        )
    if not items:
        raise ValueError(f"x is an empty {type(x).__name__}; pass the network's inputs.")
    for name, t in items.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor with the examples along dim 0; got "
                f"{type(t).__name__}. Bind other arguments of the network with a wrapper module "
                "or functools.partial."
            )
    return items


def _moved(name: str, x: Any, device: torch.device) -> str:
    """The expression that moves the batch part ``name`` (of the batch ``x``) to ``device``."""
    to = f".to({str(device)!r})"
    if name == "y" or isinstance(x, torch.Tensor):
        return f"{name}{to}"
    if isinstance(x, Mapping):
        return f"x = {{k: v{to} for k, v in x.items()}}"
    return f"x = tuple(t{to} for t in x)"


def check_device(
    tensors: Mapping[str, torch.Tensor], device: torch.device | None, *, batch: Any = None
) -> None:
    """Refuse batch tensors that are not on the network's ``device``, naming the tensor, both
    devices and the call that moves it (``None``: the network's device is unknown, nothing to
    check). Runs before any value is read: reading a tensor of another device (a meta tensor, a
    GPU tensor for a CPU network) fails with an error that names neither.

    :param tensors: name -> tensor, as :func:`batch_tensors` gives them (and ``"y"``).
    :param device: the network's device.
    :param batch: the batch ``x`` the tensors come from (for the fix the message proposes).
    """
    if device is None:
        return
    for name, t in tensors.items():
        if t.device != device and device.type == "meta":
            raise ValueError(
                f"{name} is on device {t.device} but the network is on meta, a device of shapes "
                "without values, which cannot run a model. Give the network storage on the "
                f"batch's device, net.to_empty(device={str(t.device)!r}), and load its weights "
                "(net.load_state_dict(...)) before creating the model and guide."
            )
        if t.device != device:
            raise ValueError(
                f"{name} is on device {t.device} but the network is on {device}; the batch must "
                f"be on the network's device. Move it there before the call: "
                f"{_moved(name, batch, device)} (or move the network with "
                f"net.to({str(t.device)!r}) before creating the model and guide)."
            )


def check_batch(
    x: Any,
    y: torch.Tensor | None,
    *,
    task: str,
    num_classes=None,
    device: torch.device | None = None,
    vocabulary: int | None = None,
) -> None:
    """Refuse a malformed batch (type, device, empty, non-finite, shape, label dtype and range)
    with an error that says what to do.

    :param x: a tensor, a mapping of tensors or a tuple of tensors, each with the examples along
        dim 0.
    :param str task: ``"classification"`` (integer labels ``(B,)``), ``"binary"`` (labels 0/1
        ``(B,)``), ``"multilabel"`` (labels 0/1 ``(B, K)``), ``"regression"`` (floats) or
        ``"tokens"`` (integer token labels ``(B, T)``, :data:`IGNORE_INDEX` where skipped).
    :param int num_classes: C, the number of classes (``"classification"``), of label columns
        (``"multilabel"``) or the vocabulary size (``"tokens"``), when known.
    :param device: the network's device (:meth:`NetworkShape.device`), checked first, and a
        batch on the meta device (no values to check) is refused; ``None`` skips both checks.
    :param int vocabulary: V: the network's first input holds token ids in [0, V)
        (:attr:`NetworkShape.vocabulary`).
    """
    tensors = batch_tensors(x)
    check_device(tensors, device, batch=x)
    if isinstance(y, torch.Tensor):
        check_device({"y": y}, device)
    for name, t in {**tensors, "y": y}.items():
        if device is not None and isinstance(t, torch.Tensor) and t.is_meta:
            raise ValueError(
                f"{name} is on the meta device (shapes without values), so the model can neither "
                "check its values nor score them. Build the batch on a real device, and the "
                "network too (one on meta: net.to_empty(device='cpu'), then load its weights)."
            )
    for name, t in tensors.items():
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(
                f"{name} must have at least one row; got shape {tuple(t.shape)}. Pass at least one "
                "example, with the examples along dim 0."
            )
    counts = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"every tensor of the batch needs the same number of rows (examples); got {counts}. "
            "Pass matching slices of the data."
        )
    rows = next(iter(counts.values()))
    # Shapes and dtypes first; the values last, read back to the host in one transfer
    # (:class:`_Values`): on a GPU each read is a synchronisation that stalls the step.
    values = _Values(tensors)
    # The first input: the batch itself, the first of a tuple, or a tokenizer's input_ids.
    entry = next((n for n in ("x", "x[0]", "x['input_ids']") if n in tensors), None)
    if vocabulary is not None and entry is not None:
        ids = tensors[entry]
        if ids.numel() and not (ids.is_floating_point() or ids.dtype == torch.bool):
            values.ids = (entry, ids, vocabulary)
    if y is None:
        values.check()
        return
    if not isinstance(y, torch.Tensor):
        raise TypeError(
            f"y must be a torch.Tensor or None; got {type(y).__name__}. Use torch.as_tensor(y)."
        )
    if y.dim() == 0 or y.shape[0] != rows:
        raise ValueError(
            f"x and y must have the same number of rows; got {rows} rows of x and y "
            f"{tuple(y.shape)}. Pass matching slices of the data."
        )
    if task == "tokens":
        _check_token_labels(y)
        if y.numel():
            # Skipped labels count as 0, always in range: the fused read gives the scored range.
            values.labels = y.masked_fill(y == IGNORE_INDEX, 0)
        lo, hi = values.check()
        if lo < 0 or (num_classes is not None and hi >= num_classes):
            check_token_range(y, num_classes)  # the exact check names the scored min and max
    elif task == "classification":
        if y.dim() != 1:
            raise ValueError(
                f"y must have shape ({rows},) of class labels; got {tuple(y.shape)}. "
                "Use y.reshape(-1) (or y.argmax(-1) for one-hot labels)."
            )
        if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise ValueError(
                f"y must hold integer class labels for a categorical likelihood; got dtype "
                f"{y.dtype}. Use y.long()."
            )
        if num_classes is not None:
            values.labels = y
        lo, hi = values.check()
        if num_classes is not None and (lo < 0 or hi >= num_classes):
            raise ValueError(
                f"class labels must lie in [0, {num_classes}); got min {lo}, max {hi}. "
                "Check the label encoding or the network's number of outputs."
            )
    elif task in ("binary", "multilabel"):
        want = 1 if task == "binary" else 2
        if y.dim() != want:
            shape = f"({rows},)" if task == "binary" else f"({rows}, K)"
            fix = (
                "Use y.reshape(-1), or models.multilabel_classifier for several labels per row."
                if task == "binary"
                else "Use y.reshape(-1, 1) for one label, or models.binary_classifier."
            )
            raise ValueError(
                f"y must have shape {shape} of 0/1 labels for a {task} classifier; got "
                f"{tuple(y.shape)}. {fix}"
            )
        if y.is_complex():
            raise ValueError(
                f"y must hold real 0/1 labels for a {task} classifier; got dtype {y.dtype}. Pass "
                "real labels (y.real)."
            )
        if task == "multilabel" and num_classes is not None and y.shape[1] != num_classes:
            raise ValueError(
                f"y has {y.shape[1]} label column(s) but the network has {num_classes} output(s), "
                "one logit per label; pass y with one column per output (or change the network's "
                "last layer)."
            )
        values.add("y", y)
        values.binary = y
        values.check()
    else:
        if not y.is_floating_point():
            raise ValueError(
                f"y must be floating point for a Gaussian likelihood; got dtype {y.dtype}. "
                "Use y.float() (or a classifier for class labels)."
            )
        values.add("y", y)
        values.check()


class _Values:
    """The value checks of one batch, read back to the host in one transfer: every floating
    tensor is finite (:func:`~pyro_bdl._validation.check_finite`'s one-reduction test), binary
    labels are 0/1 and the (min, max) of class labels. A failed test then runs the exact check,
    which names the offending value."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.floats: list[tuple[str, torch.Tensor]] = []
        for name, t in tensors.items():
            self.add(name, t)
        self.binary: torch.Tensor | None = None  #: labels that must be 0 or 1
        #: (name, token ids, V): ids an embedding of V entries reads, which must lie in [0, V)
        self.ids: tuple[str, torch.Tensor, int] | None = None
        self.labels: torch.Tensor | None = None  #: class or token labels whose range is read

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.is_floating_point() or t.is_complex():
            self.floats.append((name, t))

    def check(self) -> tuple[int, int]:
        """Raise on the first failed test; return (min, max) of :attr:`labels` ((0, 0) when
        none)."""
        probes = [finite_probe(t) for _, t in self.floats]
        if self.binary is not None and self.binary.numel():
            probes.append(((self.binary == 0) | (self.binary == 1)).all())
        if self.ids is not None:
            probes.extend(torch.aminmax(self.ids[1]))
        if self.labels is not None:
            probes.extend(torch.aminmax(self.labels))
        if not probes:
            return 0, 0
        if len({p.device for p in probes}) == 1:
            # stack promotes the boolean verdicts to the labels' integer dtype in its own
            # kernel; a cast per boolean probe would be one more.
            read = torch.stack(probes).tolist()
        else:  # no common device (the network's device is unknown): one read per probe
            read = [int(p) for p in probes]
        for (name, t), ok in zip(self.floats, read):
            if not ok:
                check_finite(name, t)
        k = len(self.floats)
        if self.binary is not None and self.binary.numel():
            if not read[k]:
                check_binary_labels(self.binary)
            k += 1
        if self.ids is not None:
            name, _, vocab = self.ids
            lo, hi = read[k], read[k + 1]
            if lo < 0 or hi >= vocab:
                raise ValueError(
                    f"{name} must hold token ids in [0, {vocab}), the entries of the network's "
                    f"input embedding; got min {lo}, max {hi}. Check the tokenizer against the "
                    "network (a Hugging Face model's config.vocab_size)."
                )
        return (read[-2], read[-1]) if self.labels is not None else (0, 0)


def _check_token_labels(y: torch.Tensor) -> None:
    if y.dim() != 2 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(
            f"y must hold integer token labels of shape (B, T) for a token-level likelihood; got "
            f"{y.dtype} of shape {tuple(y.shape)}. Pass the token ids (y = batch['input_ids'], "
            f"with {IGNORE_INDEX} where a token is not scored)."
        )


def check_token_range(y: torch.Tensor, vocab: int | None) -> None:
    """Refuse token labels outside [0, vocab) other than :data:`IGNORE_INDEX`."""
    scored = y[y != IGNORE_INDEX]
    if not scored.numel():
        return
    lo, hi = label_range(scored)
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(
            f"token labels must lie in [0, {vocab if vocab is not None else 'V'}) or be "
            f"{IGNORE_INDEX} (skipped); got min {lo}, max {hi}. Check the tokenizer against the "
            "network's vocabulary."
        )


def _leaves(net: nn.Module) -> list[nn.Module]:
    """The modules of ``net`` in call order, as far as it is known: through nested
    ``nn.Sequential`` containers; any other module is one opaque step."""
    if isinstance(net, nn.Sequential):
        return [leaf for child in net for leaf in _leaves(child)]
    return [net]


def _float_tensor(module: nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter or buffer that ``module`` holds directly (a lifted
    layer keeps its weights' dtype in its initial-value buffers)."""
    for t in (*module._parameters.values(), *module._buffers.values()):
        if t is not None and t.is_floating_point():
            return t
    return None


def _own_tensor(module: nn.Module) -> torch.Tensor | None:
    """The first parameter or buffer that ``module`` holds directly."""
    for t in (*module._parameters.values(), *module._buffers.values()):
        if t is not None:
            return t
    return None


class NetworkShape:
    """What a network expects of its inputs and gives as outputs, read once from its layers.

    :ivar entry: the layer that receives the inputs, when the call order makes it certain (the
        network is, or starts, an ``nn.Sequential`` of layers), else ``None``.
    :ivar str kind: ``"linear"`` (last dim), ``"flatten"`` (an ``nn.Flatten`` before a linear
        layer: the product of the non-batch dims), ``"conv"`` (dim 1) or ``None``.
    :ivar int width: the input width that ``entry`` expects (``None`` when unknown).
    :ivar int outputs: the output width of the last layer (``None`` when unknown).
    :ivar int vocabulary: V, when the network's first input is token ids read by an embedding
        of V entries: its first layer's, or the one it names as Hugging Face models do
        (``get_input_embeddings()``, reading ``input_ids``); ``None`` otherwise.
    :ivar dtype_source: the module whose floating tensors give the expected input dtype, read on
        every call so that ``net.double()`` after construction is followed.
    :ivar device_source: the module whose tensors give the network's device (the entry layer,
        else any module when every tensor of the network shares one device), read on every call
        so that ``net.to(device)`` after construction is followed; ``None`` for a network spread
        over several devices or without tensors.
    """

    def __init__(self, net: nn.Module):
        leaves = _leaves(net)
        start = 0
        while start < len(leaves) - 1 and isinstance(leaves[start], _SHAPE_KEEPING):
            start += 1
        first = leaves[start]
        self.entry: nn.Module | None = None
        self.kind: str | None = None
        self.width: int | None = None
        if isinstance(first, nn.Linear) and first.in_features > 0:
            self.entry, self.kind, self.width = first, "linear", first.in_features
        elif isinstance(first, _CONV) and first.in_channels > 0:
            self.entry, self.kind, self.width = first, "conv", first.in_channels
            self.spatial = len(first.kernel_size)
        elif (
            isinstance(first, nn.Flatten)
            and first.start_dim == 1
            and first.end_dim == -1
            and start + 1 < len(leaves)
            and isinstance(leaves[start + 1], nn.Linear)
        ):
            linear = leaves[start + 1]
            assert isinstance(linear, nn.Linear)
            self.entry, self.kind, self.width = linear, "flatten", linear.in_features
        end = len(leaves) - 1
        while end > 0 and _keeps_shape(leaves[end]):
            end -= 1
        last = leaves[end]
        self.outputs: int | None = last.out_features if isinstance(last, nn.Linear) else None
        embedding = first if isinstance(first, nn.Embedding) else _input_embedding(net)
        self.vocabulary = None if embedding is None else embedding.num_embeddings
        self.dtype_source = self.entry if self.entry is not None else self._uniform_dtype(net)
        self.device_source = self._device_source(net)

    def _device_source(self, net: nn.Module) -> nn.Module | None:
        if self.entry is not None and _own_tensor(self.entry) is not None:
            return self.entry
        devices = {t.device for t in (*net.parameters(), *net.buffers())}
        if len(devices) != 1:
            return None
        return next((m for m in net.modules() if _own_tensor(m) is not None), None)

    def device(self) -> torch.device | None:
        """The network's device now (``None`` when unknown: see :attr:`device_source`)."""
        if self.device_source is None:
            return None
        t = _own_tensor(self.device_source)
        return None if t is None else t.device

    @staticmethod
    def _uniform_dtype(net: nn.Module) -> nn.Module | None:
        """The first module holding a floating tensor, if every floating tensor of ``net``
        shares one dtype (otherwise the expected input dtype is unknown)."""
        dtypes = {t.dtype for t in (*net.parameters(), *net.buffers()) if t.is_floating_point()}
        if len(dtypes) != 1:
            return None
        return next((m for m in net.modules() if _float_tensor(m) is not None), None)

    def _entry_name(self) -> str:
        # Not repr(entry): a lifted layer's repr reads its weights, which samples them.
        base = next(c for c in type(self.entry).__mro__ if c.__module__.startswith("torch.nn"))
        unit = "channels" if self.kind == "conv" else "features"
        return f"{base.__name__} with {self.width} input {unit}"

    def check_batched(self, x: torch.Tensor) -> None:
        """Refuse a 1-D ``x`` before a first ``Linear``, naming the reshape it needs: torch's
        Linear takes it as one unbatched example, but the model reads ``x.shape[0]`` as the
        number of rows, so it would fail later at the rows of ``y`` or the output's shape."""
        if self.kind != "linear" or x.dim() != 1:
            return
        n, w = x.shape[0], self.width
        entry = f"the network's first layer ({self._entry_name()})"
        if n == w:
            fix = (
                f"x has shape ({n},): one example without its batch dimension, but the model "
                f"takes a batch of rows, shape (B, {w}). Pass x.unsqueeze(0) for one row."
            )
        elif w == 1:
            fix = (
                f"x has shape ({n},) but {entry} expects one feature per row, shape ({n}, 1). "
                "Pass x.unsqueeze(-1)."
            )
        else:
            fix = (
                f"x has shape ({n},) but {entry} expects a batch of rows of {w} features, "
                f"shape (B, {w}). Pass a 2-D batch."
            )
        raise ValueError(fix)

    def check_inputs(self, x: torch.Tensor) -> None:
        """Refuse inputs of the wrong dtype or feature width for the network, naming both."""
        if self.dtype_source is not None:
            ref = _float_tensor(self.dtype_source)
            strict = self.entry is not None  # a known first layer takes only its own dtype
            if (
                ref is not None
                and x.dtype != ref.dtype
                and (strict or x.is_floating_point())
                and not autocast_enabled(x.device)
            ):
                # Only a floating dtype is one a network can be converted to.
                convert = (
                    f" (or convert the network with net.to({x.dtype}) before creating the model)"
                    if x.is_floating_point()
                    else ""
                )
                raise TypeError(
                    f"x has dtype {x.dtype} but the network's weights are {ref.dtype}; the "
                    f"network expects {ref.dtype} inputs. Use x.to({ref.dtype}){convert}."
                )
        if self.kind is None:
            return
        if self.kind == "linear":
            self.check_batched(x)
            got, where = (x.shape[-1] if x.dim() else None), "x.shape[-1]"
        elif self.kind == "flatten":
            got, where = x[0].numel(), "the product of x's non-batch dims"
        else:
            batched = self.spatial + 2
            if x.dim() != batched:
                raise ValueError(
                    f"x must have {batched} dims (batch, channels, {self.spatial} spatial) for the "
                    f"network's first layer ({self._entry_name()}); got shape "
                    f"{tuple(x.shape)}. Add the missing batch or channel dimension."
                )
            got, where = x.shape[1], "x.shape[1] (channels)"
        if got != self.width:
            raise ValueError(
                f"x has {got} features ({where}; rows of shape {tuple(x.shape[1:])}) but the "
                f"network's first layer ({self._entry_name()}) expects {self.width}. Pass "
                f"inputs with {self.width} features (check the feature columns and any "
                "reshaping)."
            )


def _input_embedding(net: nn.Module) -> nn.Embedding | None:
    """The token embedding of a network that names it as Hugging Face models (and PEFT models
    around them) do, by ``get_input_embeddings()``."""
    get = getattr(net, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except NotImplementedError:  # a model without token embeddings
        return None
    return embedding if isinstance(embedding, nn.Embedding) else None


@contextlib.contextmanager
def rollback(net: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore the random number generators, the network's buffers (running statistics) and the
    param store (a lifted network's hidden parameters register there on the first forward pass)
    if the block raises: the checks of a model's first call, and a Gaussian likelihood's range
    check, read the network's output, so they can only run after the forward pass."""
    store = pyro.get_param_store()
    names = set(store.keys())
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    # The lifted weights' initial values and the hidden frozen parameters never change in a
    # forward pass: skip them (a frozen base model would otherwise be copied whole).
    constant = {id(b) for b in constant_buffers(net)}
    saved = [(b, b.clone()) for b in net.buffers() if id(b) not in constant]
    try:
        yield
    except BaseException:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        with torch.no_grad():
            for b, old in saved:
                b.copy_(old)
        for name in set(store.keys()) - names:
            del store[name]
        raise


def check_network_input(shape: NetworkShape, x: Any) -> None:
    """The checks of a :class:`~pyro_bdl.models.NetworkModel`'s own call that concern its
    batch ``x``: its tensors on the network's device, and a tensor batch of the network's dtype
    and input width. Callers that run the network alone (the draws of
    :mod:`pyro_bdl.predictive`, a BatchNorm refresh) would otherwise meet torch's error, which
    names neither the argument nor the fix."""
    check_device(batch_tensors(x), shape.device(), batch=x)
    if isinstance(x, torch.Tensor):
        shape.check_inputs(x)
