r"""The observation noise σ of a Gaussian likelihood: fixed, learned as a latent site, or a point
estimate.

- ``"fixed"``: σ is a number given by the user.
- ``"learned"``: σ is a latent site ``"sigma"`` with a prior over σ > 0 (default
  ``LogNormal(0, 1)``: median 1, 95% of its mass in [0.14, 7.1], for standardised targets). The
  guide infers it with the weights; the custom ELBO gives the KL of a LogNormal, HalfNormal, …
  prior in closed form or by its transform (docs/design/variational.md).
- ``"point"``: σ is a param constrained positive, a maximum-likelihood estimate trained with the
  guide's parameters by SVI (no prior); methods that need a known σ (the linearized Laplace) read
  its current value.

Names. The param of a point σ is ``"<model name>.sigma"`` (:func:`param_name`): every model has a
name of its own (:attr:`~pyro_bdl.models.NetworkModel.name`), so two regressors in one program
never share a σ through Pyro's global param store. The latent site of a learned σ is plain
``"sigma"``, like the network's weight sites: a site name lives in one model's trace, and it is
part of the model's contract (guides index their posteriors by it, ``guide.locs_and_scales()
["sigma"]``). Two models in one program each get a guide of their own; guides of the same class
then need distinct prefixes, as for the weights.

Range. Before a Gaussian likelihood is scored, :func:`check_likelihood_range` refuses a σ that is
not finite and positive, a mean (the network's output) that is not finite, and targets, outputs or
σ whose terms or σ-gradient overflow the dtype (targets ×1e30 in float32): such a step would store
σ = inf or NaN.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch.distributions import Distribution

__all__ = [
    "NOISES",
    "SIGMA",
    "NoiseSite",
    "check_likelihood_range",
    "check_noise_prior",
    "default_noise_prior",
    "param_name",
]

#: The noise models of a Gaussian likelihood (``"heteroscedastic"``: the network gives σ(x)).
NOISES = ("fixed", "learned", "point", "heteroscedastic")
#: The name of the latent site holding a learned σ, and the last part of a point σ's param name.
SIGMA = "sigma"


def param_name(model_name: str, short: str = SIGMA) -> str:
    """The param-store name of the param ``short`` that the model named ``model_name`` creates."""
    return f"{model_name}.{short}"


def default_noise_prior() -> Distribution:
    """``LogNormal(0, 1)`` over σ."""
    return dist.LogNormal(0.0, 1.0)


def check_noise_prior(prior: object) -> Distribution:
    """Require a univariate distribution over σ > 0 with valid, finite parameters (checked here
    whether or not distribution validation is on)."""
    if not isinstance(prior, Distribution):
        raise TypeError(
            f"noise_prior must be a distribution over σ > 0 such as dist.LogNormal(0., 1.) or "
            f"dist.HalfNormal(1.); got {type(prior).__name__}."
        )
    if prior.batch_shape or prior.event_shape:
        raise ValueError(
            f"noise_prior must be a distribution over one scalar σ; got batch shape "
            f"{tuple(prior.batch_shape)} and event shape {tuple(prior.event_shape)}. Pass a prior "
            "with scalar parameters, e.g. dist.LogNormal(0., 1.)."
        )
    for name, constraint in prior.arg_constraints.items():
        value = torch.as_tensor(getattr(prior, name))
        if not value.is_floating_point():
            continue
        if not (torch.isfinite(value).all() and constraint.check(value).all()):
            raise ValueError(
                f"noise_prior {type(prior).__name__} has {name}={value.tolist()!r}, which must "
                f"be finite and satisfy {constraint}; pass valid parameters, e.g. "
                "dist.LogNormal(0., 1.)."
            )
    support = prior.support
    assert support is not None
    tiny = torch.tensor(-1e-6)
    if support.is_discrete or support.event_dim or bool(support.check(tiny)):
        raise ValueError(
            f"noise_prior must put its mass on σ > 0; {type(prior).__name__} has support "
            f"{support}. Use a prior over positive numbers such as dist.LogNormal(0., 1.), "
            "dist.HalfNormal(1.) or dist.Gamma(2., 2.)."
        )
    return prior


class NoiseSite:
    """σ of a ``"fixed"``, ``"learned"`` or ``"point"`` Gaussian noise, as the model asks for it
    on each call: the fixed value, a sample from the prior or the positive param. The fixed value
    and the prior are built once per dtype and device of the network's outputs (on a GPU, a
    tensor made from a number on every call is a copy from the host that waits for the queued
    kernels).

    :param str noise: ``"fixed"``, ``"learned"`` or ``"point"``.
    :param prior: the prior over σ (``"learned"``).
    :param float init: σ (``"fixed"``), or the initial value of the param (``"point"``).
    :param str param: the param-store name of a point σ (:func:`param_name`).
    """

    def __init__(self, noise: str, prior: Distribution | None, init: float, param: str = SIGMA):
        self.noise, self.prior, self.init = noise, prior, float(init)
        self.param = param
        self._priors: dict = {}
        self._fixed: dict = {}

    def _init_like(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        value = self._fixed.get(key)
        if value is None:
            value = self._fixed[key] = torch.tensor(self.init, dtype=like.dtype, device=like.device)
        return value

    def _prior_like(self, like: torch.Tensor) -> Distribution:
        assert self.prior is not None
        key = (like.dtype, like.device)
        prior = self._priors.get(key)
        if prior is None:
            params = {
                k: torch.as_tensor(getattr(self.prior, k)).to(like)
                for k in self.prior.arg_constraints
            }
            try:
                prior = type(self.prior)(**params)  # type: ignore[arg-type]
            except TypeError:  # a distribution not built from its parameters alone
                prior = self.prior
            self._priors[key] = prior
        return prior

    def __call__(self, like: torch.Tensor) -> torch.Tensor:
        if self.noise == "fixed":
            return self._init_like(like)
        if self.noise == "learned":
            return pyro.sample(SIGMA, self._prior_like(like))
        # Lazy: the initial value is made only when the param store lacks the param. It is made
        # with inference mode off: a param first made under torch.inference_mode() is an
        # inference tensor, which the optimizer never updates (σ would stay at its start).
        init = lambda: torch.tensor(self.init, dtype=like.dtype, device=like.device)  # noqa: E731
        with torch.inference_mode(False):
            return pyro.param(self.param, init, constraint=constraints.positive)

    def current(self) -> float:
        """The point estimate now (its initial value before the first call)."""
        store = pyro.get_param_store()
        if self.param in store:
            return float(store[self.param].detach())
        return self.init


def check_likelihood_range(
    y: torch.Tensor, mean: torch.Tensor, scale, factor: float, *, where: str
) -> None:
    r"""Refuse a Gaussian likelihood :math:`N(y; \text{mean}, σ^2)` scaled by ``factor`` (N/B)
    that would give a non-finite loss or σ-gradient, before anything is scored.

    The loss holds :math:`\text{factor} \sum_i r_i^2 / 2σ^2` with :math:`r = y - \text{mean}`,
    and its σ-gradient :math:`\text{factor} \sum_i r_i^2 / σ^3`: both are finite when the
    second is (for σ < 1; for σ ≥ 1 the first is at most the second times σ, still bounded by
    the dtype's range before the sum). One reduction and one host sync per batch.

    :param scale: σ, a number or a tensor (per example, or per particle).
    :param str where: what σ is, for the message (``"param 'model_0.sigma'"``, ``"σ(x)"``).
    """
    with torch.no_grad():
        s = torch.as_tensor(scale, dtype=mean.dtype, device=mean.device)
        r2 = (y.to(mean.dtype) - mean).square()
        worst = (r2 / s.square()).sum() * factor
        ok = torch.isfinite(s).all() & (s > 0).all() & torch.isfinite(worst / s.min())
        ok = ok & torch.isfinite(worst)
        if bool(ok):
            return
        low, high = float(s.min()), float(s.max())
        if not (math.isfinite(low) and math.isfinite(high) and low > 0):
            bad = high if not math.isfinite(high) else low
            raise ValueError(
                f"the noise scale σ ({where}) is {bad!r}; it must be finite and > 0, so the "
                f"Gaussian likelihood was not scored and nothing was changed. A previous step "
                "drove it out of range: standardise the targets ((y - y.mean()) / y.std()) or "
                "lower the learning rate, and restart σ (for a point σ: del "
                "pyro.get_param_store()[name], or pyro.clear_param_store())."
            )
        bad = int((~torch.isfinite(mean)).sum())
        if bad:
            raise ValueError(
                f"the network's output (the Gaussian's mean) holds {bad} non-finite value(s) "
                "(NaN or inf) for finite inputs, so the likelihood was not scored and nothing was "
                "changed: the weights (the guide's parameters) are not finite, or overflow the "
                f"network's {mean.dtype}. A previous step diverged: lower the learning rate, and "
                "restart from a checkpoint or a new guide."
            )
        ymax, mmax = float(y.abs().max()), float(mean.detach().abs().max())
        raise ValueError(
            f"the Gaussian likelihood overflows {mean.dtype}: N/B·Σ(y - mean)²/σ³ is not finite "
            f"(largest |y| = {ymax:.3g}, largest |mean| = {mmax:.3g}, σ ({where}) from "
            f"{low:.3g} to {high:.3g}, N/B = {factor:.3g}); a step would make σ or the weights "
            "inf or NaN, so nothing was changed. Standardise the targets ((y - y.mean()) / "
            "y.std()), or use float64 (net.double(), x.double(), y.double())."
        )
