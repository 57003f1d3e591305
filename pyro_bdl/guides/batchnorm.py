"""BatchNorm statistics for sampled networks, and a Bayesian-model-average predictor using them.

A network whose weights were drawn from a posterior (SWAG, mean-field, ...) sees activations with
different means and variances than the network BatchNorm's running statistics were gathered on;
predicting with stale statistics badly hurts accuracy and calibration (Maddox et al., 2019,
section 4). :func:`refresh_batchnorm` recomputes them for one draw with a forward pass over (a
fraction of) the training inputs; :func:`predict_with_bn_refresh` draws S weights, refreshes
BatchNorm for each, and averages the predictive probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from contextlib import ExitStack

import torch
from pyro import poutine
from torch import nn

from pyro_bdl._validation import check_positive_int, check_probability
from pyro_bdl.models.checks import NetworkShape, check_network_input

__all__ = ["batchnorm_layers", "predict_with_bn_refresh", "refresh_batchnorm"]

_BatchNorm = nn.modules.batchnorm._BatchNorm


def batchnorm_layers(net: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of ``net`` that keep running statistics."""
    return [m for m in net.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def _is_lifted(net: nn.Module) -> bool:
    return bool(getattr(net, "_bdl_sites", None))


def _check_fraction(fraction: float) -> None:
    if fraction != 1.0:
        check_probability("fraction", fraction)


def _input_batches(
    data, *, fraction: float, batch_size: int, generator: torch.Generator | None
) -> Iterable[torch.Tensor]:
    """Inputs of ``data`` (a tensor of rows, or an iterable of ``x`` or ``(x, ...)`` batches)."""
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or data.shape[0] == 0:
            raise ValueError(
                f"data must hold at least one row; got shape {tuple(data.shape)}. Pass the "
                "training inputs."
            )
        n = max(1, math.ceil(fraction * data.shape[0]))
        if n < data.shape[0]:
            idx = torch.randperm(data.shape[0], generator=generator)[:n].to(data.device)
            data = data[idx]
        return data.split(batch_size)
    if not isinstance(data, Iterable):
        raise TypeError(
            f"data must be a tensor of inputs or an iterable of batches (a DataLoader); got "
            f"{type(data).__name__}. Pass the training inputs x_train or their DataLoader."
        )
    num_batches = None
    if fraction < 1.0:
        if not hasattr(data, "__len__"):
            raise ValueError(
                "fraction < 1 needs data with a length (a DataLoader or a list of batches); "
                "pass fraction=1.0 or a tensor of inputs."
            )
        num_batches = max(1, math.ceil(fraction * len(data)))  # type: ignore[arg-type]

    def batches():
        for i, batch in enumerate(data):
            if num_batches is not None and i >= num_batches:
                return
            yield batch[0] if isinstance(batch, (tuple, list)) else batch

    return batches()


@torch.no_grad()
def refresh_batchnorm(
    net: nn.Module,
    data,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    fraction: float = 1.0,
    batch_size: int = 256,
    generator: torch.Generator | None = None,
) -> int:
    """Recompute the running statistics of every BatchNorm layer of ``net`` for one set of
    weights, in place.

    The statistics are reset and re-estimated as the exact average over the chosen batches
    (``momentum=None`` while refreshing), with only the BatchNorm layers in training mode (dropout
    and other layers keep their mode, so they do not perturb the statistics). Training flags and
    momenta are restored afterwards. A network without BatchNorm is left untouched. A batch the
    network cannot take (another device, dtype or input width) is refused naming the fix, and
    the statistics are then those from before the call.

    Usage::

        weights = guide.sample_weights()
        refresh_batchnorm(bnn, x_train, weights=weights, fraction=0.1)
        with pyro.poutine.condition(data=weights):
            logits = bnn.eval()(x_test)

    :param torch.nn.Module net: the (lifted) network.
    :param data: training inputs: a tensor of rows, or an iterable of ``x`` or ``(x, y)`` batches.
    :param dict weights: ``{site name: value}`` for the lifted weight sites (required when
        ``net`` was lifted with :func:`~pyro_bdl.bayesianize`; otherwise its sites would be drawn
        from the prior).
    :param float fraction: the share of the rows (tensor) or batches (iterable) to use, in (0, 1].
    :param int batch_size: rows per forward pass when ``data`` is a tensor.
    :param torch.Generator generator: picks the subset of rows when ``fraction < 1``.
    :returns: the number of examples the statistics were computed from (0 without BatchNorm).

    References:

    [1] `A Simple Baseline for Bayesian Uncertainty in Deep Learning`, Maddox et al. (NeurIPS 2019)
    """
    if not isinstance(net, nn.Module):
        raise TypeError(
            f"net must be a torch.nn.Module; got {type(net).__name__}. Pass the network (a "
            "ready-made model's is model.net)."
        )
    _check_fraction(fraction)
    check_positive_int("batch_size", batch_size)
    if weights is None and _is_lifted(net):
        raise ValueError(
            "net has Bayesian weight sites, so weights=None would draw them from the prior; pass "
            "weights={site: value} (for example guide.sample_weights())."
        )
    layers = batchnorm_layers(net)
    if not layers:
        return 0
    batches = _input_batches(data, fraction=fraction, batch_size=batch_size, generator=generator)
    shape = NetworkShape(net)
    modes = {m: m.training for m in net.modules()}
    momenta = {m: m.momentum for m in layers}
    saved = _bn_state(layers)
    seen = 0
    try:
        net.eval()
        for m in layers:
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the refresh batches
            m.train()
        with ExitStack() as stack:
            if weights is not None:
                stack.enter_context(poutine.condition(data=dict(weights)))
            for x in batches:
                check_network_input(shape, x)
                net(x)
                seen += x.shape[0]
    except BaseException:
        _restore(layers, saved)
        raise
    finally:
        for m, momentum in momenta.items():
            m.momentum = momentum
        for module, training in modes.items():
            module.training = training
    if seen == 0:
        raise ValueError("data yielded no batches; pass at least one batch of training inputs.")
    return seen


def _bn_state(layers: list[_BatchNorm]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in m._buffers.items() if v is not None} for m in layers]


def _restore(layers: list[_BatchNorm], saved: list[dict[str, torch.Tensor]]) -> None:
    for m, state in zip(layers, saved):
        for k, v in state.items():
            m._buffers[k].copy_(v)  # type: ignore[union-attr]


@torch.no_grad()
def predict_with_bn_refresh(
    guide,
    net: nn.Module,
    x: torch.Tensor,
    *,
    num_samples: int = 30,
    bn_data=None,
    bn_fraction: float = 0.1,
    batch_size: int = 1024,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Bayesian model average of softmax(``net(x)``) over ``num_samples`` posterior draws,
    refreshing BatchNorm statistics for every draw.

    Weights come from ``guide.sample_weights()`` when the guide has it (:class:`~pyro_bdl.guides.
    AutoSWAG`), otherwise from calling ``guide(x)`` under ``torch.no_grad()``. ``net``'s
    BatchNorm buffers are restored afterwards, so the call has no lasting side effect.

    Usage::

        probs = predict_with_bn_refresh(guide, bnn, x_test, num_samples=30, bn_data=x_train)

    :param guide: a guide over ``net``'s weight sites.
    :param torch.nn.Module net: the lifted network; it must return logits.
    :param torch.Tensor x: test inputs.
    :param int num_samples: S, the number of weight draws.
    :param bn_data: training inputs for :func:`refresh_batchnorm` (required when ``net`` has
        BatchNorm layers).
    :param float bn_fraction: share of ``bn_data`` used per refresh.
    :param int batch_size: rows per forward pass over ``x``.
    :param torch.Generator generator: picks the refresh subsets.
    :returns: mean predictive probabilities, shape (n, C).
    """
    check_positive_int("num_samples", num_samples)
    check_positive_int("batch_size", batch_size)
    _check_fraction(bn_fraction)
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"x must be a tensor of test inputs; got {type(x).__name__}. Convert it with "
            "torch.as_tensor."
        )
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(
            f"x must be a tensor with at least one row of test inputs; got shape "
            f"{tuple(x.shape)}. Pass at least one example."
        )
    check_network_input(NetworkShape(net), x)
    layers = batchnorm_layers(net)
    if layers and bn_data is None:
        raise ValueError(
            f"net has {len(layers)} BatchNorm layer(s) whose statistics must be recomputed for "
            "every weight draw; pass bn_data=x_train (the training inputs or a loader)."
        )
    sample = getattr(guide, "sample_weights", None)
    saved = _bn_state(layers)
    modes = {m: m.training for m in net.modules()}
    total: torch.Tensor | None = None
    try:
        for _ in range(num_samples):
            weights = sample() if sample is not None else guide(x)
            if layers:
                refresh_batchnorm(
                    net, bn_data, weights=weights, fraction=bn_fraction, generator=generator
                )
            net.eval()
            with poutine.condition(data=weights):
                probs = torch.cat([net(xb).softmax(-1) for xb in x.split(batch_size)])
            total = probs if total is None else total.add_(probs)
    finally:
        _restore(layers, saved)
        for module, training in modes.items():
            module.training = training
    assert total is not None
    return total.div_(num_samples)
