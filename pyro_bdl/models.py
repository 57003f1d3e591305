"""Ready-made Pyro models around a lifted network, with the checks a user would otherwise forget.

Users are free to write their own model with ``pyro.sample``; these helpers are what the
``pyro-bdl`` command, the tests and the tutorials use. Both scale the likelihood by N/B through
``pyro.plate("data", N, subsample_size=B)`` and return the network's output.

Usage::

    model = bdl.models.classifier(bnn, dataset_size=len(x_train))
    svi.step(x_batch, y_batch)
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from torch import nn
from torch.distributions import Distribution as TorchDistribution

from pyro_bdl._validation import check_finite, check_positive, check_positive_int

__all__ = [
    "DATA_PLATE",
    "NetworkModel",
    "check_batch",
    "classifier",
    "data_plate",
    "regressor",
]

#: The name of the plate over examples; VOGN and the diagnostics look for it.
DATA_PLATE = "data"


class _LogSoftmaxCategorical(dist.Categorical):
    """``Categorical(logits=logits)``, normalised by one fused ``log_softmax`` (instead of
    ``logits - logsumexp(logits)``) and scoring labels of the batch shape with one ``gather``.

    The classifiers' likelihood pays this on every step; in every other respect (``logits``,
    ``probs``, ``sample``, ``expand``, validation) it is the ordinary ``Categorical``.
    """

    def __init__(self, logits: torch.Tensor, validate_args=None):
        if logits.dim() < 1:
            raise ValueError("`logits` parameter must be at least one-dimensional.")
        self.logits = torch.log_softmax(logits, dim=-1)
        self._param = self.logits
        self._num_events = logits.shape[-1]
        TorchDistribution.__init__(self, logits.shape[:-1], validate_args=validate_args)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        if value.shape != self.batch_shape:  # broadcasting (e.g. enumerated values)
            return super().log_prob(value)
        return self.logits.gather(-1, value.long().unsqueeze(-1)).squeeze(-1)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if batch_shape == self.batch_shape:  # what the data plate asks for on every call
            return self
        return dist.Categorical(logits=self.logits).expand(batch_shape)


def data_plate(dataset_size: int, batch_size: int, device=None) -> pyro.plate:
    """The plate over examples: scales the likelihood by N/B (``batch_size`` may exceed N when
    predicting on a larger test set, in which case no scaling applies)."""
    if batch_size > dataset_size:
        return pyro.plate(DATA_PLATE, batch_size)
    # The batch is already sliced, so the plate only needs the size for its N/B scale: explicit
    # indices avoid the randperm(N) that subsample_size would draw on every call.
    # Passing the device also spares the plate a probe tensor for the default device.
    return pyro.plate(
        DATA_PLATE,
        dataset_size,
        subsample=torch.arange(batch_size, device=device),
        device=device,
    )


def _label_range(y: torch.Tensor) -> tuple[int, int]:
    """(min, max) of the (non-empty) labels in one pass over them."""
    lo, hi = torch.aminmax(y)
    return int(lo), int(hi)


def check_batch(x: torch.Tensor, y: torch.Tensor | None, *, task: str, num_classes=None) -> None:
    """Refuse a malformed batch (type, empty, non-finite, shape, label dtype and range) with an
    error that says what to do."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}.")
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(f"x must have at least one row; got shape {tuple(x.shape)}.")
    check_finite("x", x)
    if y is None:
        return
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor or None; got {type(y).__name__}.")
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"x and y must have the same number of rows; got x {tuple(x.shape)} and y "
            f"{tuple(y.shape)}. Pass matching slices of the data."
        )
    if task == "classification":
        if y.dim() != 1:
            raise ValueError(
                f"y must have shape ({x.shape[0]},) of class labels; got {tuple(y.shape)}. "
                "Use y.reshape(-1) (or y.argmax(-1) for one-hot labels)."
            )
        if y.is_floating_point() or y.dtype == torch.bool:
            raise ValueError(
                f"y must hold integer class labels for a categorical likelihood; got dtype "
                f"{y.dtype}. Use y.long()."
            )
        if num_classes is not None and y.numel():
            lo, hi = _label_range(y)
            if lo < 0 or hi >= num_classes:
                raise ValueError(
                    f"class labels must lie in [0, {num_classes}); got min {lo}, max {hi}. "
                    "Check the label encoding or the network's number of outputs."
                )
    else:
        if not y.is_floating_point():
            raise ValueError(
                f"y must be floating point for a Gaussian likelihood; got dtype {y.dtype}. "
                "Use y.float() (or a classifier for class labels)."
            )
        check_finite("y", y)


class NetworkModel:
    """A Pyro model around one network, with the facts methods read from it declared.

    Calling it runs ``model(x, y=None) -> network output``: the network's forward pass and one
    observation site ``"y"`` inside :func:`data_plate`. Laplace (its GGN and predictive),
    data-parallel training and checkpoints read :attr:`net`, :attr:`likelihood`,
    :attr:`dataset_size` and :attr:`noise_scale` from here; a hand-written model has none of
    them, and those methods then ask for what they need.

    :ivar net: the (lifted) network.
    :ivar str likelihood: ``"categorical"`` or ``"gaussian"``.
    :ivar int dataset_size: N, for the data plate's N/B scaling.
    :ivar noise_scale: the Gaussian observation noise σ (``None`` for a classifier).
    """

    LIKELIHOODS = ("categorical", "gaussian")

    def __init__(
        self,
        net: nn.Module,
        *,
        likelihood: str,
        dataset_size: int,
        noise_scale: float | None = None,
    ):
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module; got {type(net).__name__}.")
        if likelihood not in self.LIKELIHOODS:
            raise ValueError(f"likelihood must be one of {self.LIKELIHOODS}; got {likelihood!r}.")
        check_positive_int("dataset_size", dataset_size)
        if likelihood == "gaussian":
            if noise_scale is None:
                raise ValueError(
                    "a Gaussian likelihood needs noise_scale, the observation noise σ."
                )
            check_positive("noise_scale", noise_scale, fix="Pass the observation noise σ > 0.")
        self.net = net
        self.likelihood = likelihood
        self.dataset_size = int(dataset_size)
        self.noise_scale = None if noise_scale is None else float(noise_scale)

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if self.likelihood == "categorical":
            return self._categorical(x, y)
        return self._gaussian(x, y)

    def _categorical(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        check_batch(x, y, task="classification")
        logits = self.net(x)
        if y is not None:
            # The label range depends on the network's output width, known only now.
            lo, hi = _label_range(y)
            if lo < 0 or hi >= logits.shape[-1]:
                check_batch(x, y, task="classification", num_classes=logits.shape[-1])
        with data_plate(self.dataset_size, x.shape[0], x.device):
            pyro.sample("y", _LogSoftmaxCategorical(logits), obs=y)
        return logits

    def _gaussian(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        check_batch(x, y, task="regression")
        mean = self.net(x)
        if mean.dim() == 2 and mean.shape[-1] == 1:
            mean = mean.squeeze(-1)
        if y is not None and y.shape != mean.shape:
            raise ValueError(
                f"y must have the network output's shape {tuple(mean.shape)}; got "
                f"{tuple(y.shape)}. Use y.reshape({tuple(mean.shape)})."
            )
        with data_plate(self.dataset_size, x.shape[0], x.device):
            pyro.sample("y", dist.Normal(mean, self.noise_scale), obs=y)
        return mean

    def __repr__(self) -> str:
        noise = f", noise_scale={self.noise_scale}" if self.noise_scale is not None else ""
        return (
            f"NetworkModel({type(self.net).__name__}, likelihood={self.likelihood!r}, "
            f"dataset_size={self.dataset_size}{noise})"
        )


def classifier(net: nn.Module, dataset_size: int) -> NetworkModel:
    """A categorical-likelihood model ``model(x, y=None) -> logits`` over ``net``'s outputs."""
    return NetworkModel(net, likelihood="categorical", dataset_size=dataset_size)


def regressor(net: nn.Module, dataset_size: int, noise_scale: float) -> NetworkModel:
    """A Gaussian-likelihood model ``model(x, y=None) -> mean`` with a fixed observation noise.

    ``net`` must output shape ``(B,)`` or ``(B, 1)``; targets have shape ``(B,)``.
    """
    return NetworkModel(
        net, likelihood="gaussian", dataset_size=dataset_size, noise_scale=noise_scale
    )
