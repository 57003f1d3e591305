"""Prior families over network weights.

A prior maps ``(module, name, param)`` — the owning module, the parameter's name within it, and a
tensor with the parameter's shape, dtype and device — to a distribution whose event shape is the
parameter's shape. It also offers the initial location of the posterior (by default the module's
current weights, so a pretrained network starts where it was).

Usage::

    bnn = bdl.bayesianize(net, prior=bdl.priors.LayerwiseNormal(method="kaiming"))
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import pyro.distributions as dist
import torch
from torch import nn

from pyro_bdl._validation import check_choice, check_positive, check_probability
from pyro_bdl.distributions import ScaleMixtureNormal as ScaleMixtureDistribution

__all__ = [
    "Laplace",
    "LayerwiseNormal",
    "NonGaussianPriorError",
    "Normal",
    "Prior",
    "ScaleMixtureNormal",
    "gaussian_prior",
]

_INIT_OPTIONS = ("module", "prior_mean", "sample")


class Prior(abc.ABC):
    """Base class: an element-wise prior expanded to the parameter's shape.

    Subclasses implement :meth:`element`, returning a distribution with scalar (or broadcastable)
    batch shape on ``param``'s dtype and device; :meth:`__call__` expands it to the parameter's
    shape and declares every dim an event dim.

    :param str init: initial posterior location: ``"module"`` (the module's current weights, the
        default), ``"prior_mean"`` or ``"sample"`` (a draw from the prior).
    """

    #: Whether the distribution depends only on the layer, the parameter's name, dtype and
    #: device, so that a lifted site builds it once per dtype and device and reuses it on every
    #: pass. A subclass whose distribution reads values that change during training (a
    #: ``pyro.param`` hyperparameter) sets it to ``False``; a plain callable prior is never
    #: cached.
    cacheable: ClassVar[bool] = True

    def __init__(self, *, init: str = "module"):
        self.init = check_choice("init", init, _INIT_OPTIONS)

    @abc.abstractmethod
    def element(self, module: nn.Module, name: str, param: torch.Tensor) -> dist.Distribution:
        """The element-wise distribution for one parameter (batch shape broadcastable to it)."""

    def __call__(self, module: nn.Module, name: str, param: torch.Tensor) -> dist.Distribution:
        return self.element(module, name, param).expand(param.shape).to_event(param.dim())

    def init_loc(self, module: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
        """The initial posterior location for ``param`` (a new tensor, no gradient)."""
        with torch.no_grad():
            if self.init == "module":
                return param.detach().clone()
            d = self(module, name, param)
            if self.init == "prior_mean":
                return d.mean.detach().clone()
            return d.sample().detach()

    def _tensor(self, value: float, like: torch.Tensor) -> torch.Tensor:
        return _filled(value, like)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _filled(value: float, like: torch.Tensor) -> torch.Tensor:
    # A fill on the device: as_tensor of a Python number would be a blocking host→device copy
    # on CUDA, once per weight site per forward pass.
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _number(name: str, value: float) -> float:
    """A prior's fixed number given as a tensor, as a float; refuses one that requires grad
    (``float`` would cut it from the graph, so a hyperparameter meant to be learned would silently
    stay fixed) or that holds more than one number. Anything else is returned as it is, for the
    checks that follow."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise TypeError(
                f"{name} must be a fixed number; got a tensor that requires grad, which the prior "
                "would turn into a constant (no gradient would reach it). To learn a prior "
                "hyperparameter, pass a callable prior instead, e.g. "
                "prior=lambda module, name, param: dist.Normal(0.0, pyro.param('prior_scale', "
                "torch.tensor(1.0), constraint=constraints.positive)).expand(param.shape)"
                ".to_event(param.dim())."
            )
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be one number; got a tensor of shape {tuple(value.shape)}. For a "
                "prior that differs between weights, pass a callable prior "
                "(module, name, param) -> Distribution."
            )
        return float(value)
    return value


class Normal(Prior):
    r"""Isotropic Gaussian prior :math:`\mathcal N(\text{loc}, \text{scale}^2)` on every weight.

    :param float loc: prior mean.
    :param float scale: prior standard deviation (> 0).
    """

    def __init__(self, loc: float = 0.0, scale: float = 1.0, *, init: str = "module"):
        super().__init__(init=init)
        loc, scale = _number("Normal prior loc", loc), _number("Normal prior scale", scale)
        if not math.isfinite(float(loc)):
            raise ValueError(
                f"Normal prior loc must be finite; got {loc!r}. Pass a finite loc, for example "
                "loc=0.0."
            )
        check_positive("Normal prior scale", scale, fix="Pass scale > 0, for example scale=1.0.")
        self.loc, self.scale = float(loc), float(scale)

    def element(self, module, name, param):
        return _BroadcastNormal.of_numbers(self.loc, self.scale, param)


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class _BroadcastNormal(dist.Normal):
    """A Normal whose ``loc`` and ``scale`` are one number each, broadcast over the batch shape.

    Its log-density reads those two numbers: torch's ``Normal.log_prob`` squares and takes the
    logarithm of the *expanded* scale, two passes over every weight that allocate a copy of it,
    and four more for the quadratic form; here it is two passes (the standardised value, then
    one fused ``addcmul``). Everything else (sampling, KL registrations, ``mean``) is Normal's.

    :ivar numbers: ``(loc, scale)`` as Python floats when built by :meth:`of_numbers` (read
        without a device→host copy: ``TraceSuffStat_ELBO`` groups the sites of one prior by
        them, :mod:`pyro_bdl.infer.normal_sites`), else ``None``.
    """

    numbers: tuple[float, float] | None = None

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor, validate_args=None):
        super().__init__(loc, scale, validate_args=validate_args)
        self._scalars = (loc, scale) if loc.dim() == 0 and scale.dim() == 0 else None

    @classmethod
    def of_numbers(cls, loc: float, scale: float, like: torch.Tensor) -> _BroadcastNormal:
        """N(loc, scale²) on ``like``'s dtype and device, remembering the two numbers."""
        new = cls(_filled(loc, like), _filled(scale, like))
        new.numbers = (loc, scale)
        return new

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(_BroadcastNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new._scalars = self._scalars
        new.numbers = self.numbers
        return new

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        shape = self.batch_shape
        if self._scalars is None or value.shape[value.dim() - len(shape) :] != shape:
            return super().log_prob(value)
        if self._validate_args:
            self._validate_sample(value)
        loc, scale = self._scalars
        z = (value - loc) / scale
        return torch.addcmul(-(scale.log() + _HALF_LOG_2PI), z, z, value=-0.5)


def fan_in_out(module: nn.Module, param: torch.Tensor) -> tuple[int, int]:
    """Fan-in and fan-out of the layer that owns ``param`` (biases use their layer's weight).

    Read from the layer's own attributes (``in_features``, ``in_channels``, ``kernel_size``) so
    that it works after the weight itself has become a sample site; other layers fall back to the
    parameter's shape, as :func:`torch.nn.init._calculate_fan_in_and_fan_out` does.
    """
    if isinstance(module, nn.Linear) or hasattr(module, "in_features"):
        return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]
    if isinstance(module, nn.modules.conv._ConvNd):
        receptive = math.prod(module.kernel_size)
        return (module.in_channels // module.groups) * receptive, module.out_channels * receptive
    if param.dim() >= 2:
        receptive = math.prod(param.shape[2:])
        return param.shape[1] * receptive, param.shape[0] * receptive
    return param.numel(), param.numel()


class LayerwiseNormal(Prior):
    r"""Zero-mean Gaussian whose scale follows the layer's fan-in.

    ``method="kaiming"``: :math:`s = g\sqrt{2/n_\text{in}}` (He et al. 2015);
    ``"xavier"``: :math:`s = g\sqrt{2/(n_\text{in} + n_\text{out})}` (Glorot & Bengio 2010);
    ``"radford"``: :math:`s = g/\sqrt{n_\text{in}}` (Neal 1996). Biases use their layer's fan.

    :param str method: one of ``"kaiming"``, ``"xavier"``, ``"radford"``.
    :param float gain: multiplies the scale (> 0).
    """

    METHODS = ("kaiming", "xavier", "radford")

    def __init__(self, method: str = "kaiming", gain: float = 1.0, *, init: str = "module"):
        super().__init__(init=init)
        self.method = check_choice("LayerwiseNormal method", method, self.METHODS)
        gain = _number("LayerwiseNormal gain", gain)
        check_positive("LayerwiseNormal gain", gain)
        self.gain = float(gain)

    def scale_for(self, module: nn.Module, param: torch.Tensor) -> float:
        fan_in, fan_out = fan_in_out(module, param)
        if self.method == "kaiming":
            return self.gain * math.sqrt(2.0 / fan_in)
        if self.method == "xavier":
            return self.gain * math.sqrt(2.0 / (fan_in + fan_out))
        return self.gain / math.sqrt(fan_in)

    def element(self, module, name, param):
        scale = self.scale_for(module, param)
        return _BroadcastNormal.of_numbers(0.0, scale, param)


class Laplace(Prior):
    """Zero-mean Laplace prior with the given ``scale`` (> 0) on every weight."""

    def __init__(self, scale: float = 1.0, *, loc: float = 0.0, init: str = "module"):
        super().__init__(init=init)
        loc, scale = _number("Laplace prior loc", loc), _number("Laplace prior scale", scale)
        check_positive("Laplace prior scale", scale, fix="Pass scale > 0, for example scale=1.0.")
        if not math.isfinite(float(loc)):
            raise ValueError(
                f"Laplace prior loc must be finite; got {loc!r}. Pass a finite loc, for example "
                "loc=0.0."
            )
        self.loc, self.scale = float(loc), float(scale)

    def element(self, module, name, param):
        return dist.Laplace(self._tensor(self.loc, param), self._tensor(self.scale, param))


class ScaleMixtureNormal(Prior):
    r"""Bayes-by-Backprop scale mixture :math:`\pi\mathcal N(0,s_1^2) + (1-\pi)\mathcal N(0,s_2^2)`.

    :param float pi: weight of the first component, in (0, 1).
    :param float scale1: first component's standard deviation (> 0).
    :param float scale2: second component's standard deviation (> 0).
    """

    def __init__(
        self,
        pi: float = 0.5,
        scale1: float = 1.0,
        scale2: float = math.exp(-6),
        *,
        init: str = "module",
    ):
        super().__init__(init=init)
        pi = _number("ScaleMixtureNormal pi", pi)
        scale1 = _number("ScaleMixtureNormal scale1", scale1)
        scale2 = _number("ScaleMixtureNormal scale2", scale2)
        check_probability("ScaleMixtureNormal pi", pi)
        check_positive("ScaleMixtureNormal scale1", scale1)
        check_positive("ScaleMixtureNormal scale2", scale2)
        self.pi, self.scale1, self.scale2 = float(pi), float(scale1), float(scale2)

    def element(self, module, name, param):
        return ScaleMixtureDistribution(
            self._tensor(self.pi, param),
            self._tensor(self.scale1, param),
            self._tensor(self.scale2, param),
        )


class NonGaussianPriorError(ValueError):
    """A method that needs a Gaussian prior (VOGN, Laplace) was given another one."""


def _base_normal(d: dist.Distribution) -> torch.distributions.Normal | None:
    while isinstance(d, torch.distributions.Independent):
        d = d.base_dist
    return d if isinstance(d, torch.distributions.Normal) else None


def gaussian_prior(spec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, precision)`` of a lifted weight's Gaussian prior, each of the weight's shape.

    Reads the distribution the site's prior builds (any :class:`Prior` or user callable), so
    what :func:`~pyro_bdl.bayesianize` declared is what VOGN and Laplace use.

    :param spec: the site's :class:`~pyro_bdl.nn.SiteSpec`.
    :raises NonGaussianPriorError: the prior is not a (possibly independent) Normal.
    """
    d = spec(spec.module)
    normal = _base_normal(d)
    if normal is None:
        raise NonGaussianPriorError(
            f"site {spec.name!r} has prior {d!r}, but this method needs a Gaussian prior. Lift "
            "the network with priors.Normal or priors.LayerwiseNormal, or pass "
            "prior_precision= explicitly to use a Gaussian prior of that precision instead."
        )
    shape = spec.shape
    mean = normal.loc.detach().expand(shape)
    precision = normal.scale.detach().reciprocal().square().expand(shape)
    return mean, precision
