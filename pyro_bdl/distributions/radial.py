r"""The Radial posterior of Farquhar, Osborne & Gal: a Gaussian distance along a uniform direction.

A weight tensor with D numbers is drawn as :math:`w = \mu + \sigma \odot \xi` with

.. math:: \xi = r\,\frac{\varepsilon}{\lVert\varepsilon\rVert_2},\qquad
          \varepsilon \sim \mathcal N(0, I_D),\quad r \sim \mathcal N(0, 1),

normalised over the whole tensor (one direction per tensor per sample). The noise density, the
entropy and the KL against a Normal prior are all exact (docs/design/variational.md); the helpers
:func:`radial_noise`, :func:`radial_log_density` and :func:`radial_entropy_constant` are the
numerical core, shared with the KL estimators of :mod:`pyro_bdl.infer`.

Usage::

    q = Radial(torch.zeros(20, 10), 0.1 * torch.ones(20, 10))  # event_shape (20, 10)
    w = q.rsample()
    kl = torch.distributions.kl_divergence(q, dist.Normal(0., 1.).expand([20, 10]).to_event(2))

References:
    Farquhar, Osborne & Gal, "Radial Bayesian Neural Networks: Beyond Discrete Support in
    Large-Scale Bayesian Deep Learning" (AISTATS 2020).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pyro.distributions import TorchDistribution, constraints
from pyro.distributions.util import sum_rightmost
from torch.distributions import Independent, Normal, register_kl
from torch.distributions.utils import broadcast_all

__all__ = [
    "Radial",
    "radial_entropy_constant",
    "radial_log_density",
    "radial_marginal_icdf",
    "radial_noise",
]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
_EULER_GAMMA = 0.5772156649015329


def _log_sphere_area(dim: int) -> float:
    """log A_{D−1} = log(2 π^{D/2} / Γ(D/2)), the log area of the unit sphere in R^D."""
    return math.log(2.0) + 0.5 * dim * math.log(math.pi) - math.lgamma(0.5 * dim)


def _check_dim(name: str, dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(
            f"{name} must be an int >= 1; got {type(dim).__name__} {dim!r}. Pass a Python int "
            "(the number of weights in the site, param.numel())."
        )
    if dim < 1:
        raise ValueError(
            f"{name} must be >= 1 (the number of weights in the site); got {dim}. Pass the "
            "site's param.numel()."
        )
    return dim


def radial_noise(
    shape: Sequence[int],
    sample_shape: Sequence[int] = (),
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Draw Radial noise :math:`\xi = r\,\varepsilon/\lVert\varepsilon\rVert` of shape
    ``sample_shape + shape``, normalised over the trailing ``shape`` dims (the whole site).

    Usage::

        xi = radial_noise((20, 10), (1000,), dtype=torch.float64)  # 1000 draws for one site

    :param shape: the site's shape (the event shape); ``()`` gives a standard Normal draw.
    :param sample_shape: leading dims of independent draws.
    :param dtype: floating dtype (default: torch's default dtype).
    :param device: device of the result.
    :param generator: optional ``torch.Generator`` for reproducible noise.
    :returns: a tensor of shape ``sample_shape + shape``; no gradient.
    """
    shape, sample_shape = tuple(shape), tuple(sample_shape)
    eps = torch.randn(sample_shape + shape, dtype=dtype, device=device, generator=generator)
    if not shape:  # D = 1 with a scalar site: ε/|ε| = ±1, so ξ = ±r is exactly N(0, 1).
        return eps
    r = torch.randn(
        sample_shape + (1,) * len(shape), dtype=eps.dtype, device=eps.device, generator=generator
    )
    dims = tuple(range(-len(shape), 0))
    norm = torch.linalg.vector_norm(eps, dim=dims, keepdim=True)
    # ‖ε‖ = 0 has probability zero; the clamp only guards against an underflow in low precision.
    return eps * (r / norm.clamp_min(torch.finfo(eps.dtype).tiny))


def radial_log_density(xi: torch.Tensor, *, event_dim: int | None = None) -> torch.Tensor:
    r"""Exact log-density of Radial noise,
    :math:`\log p(\xi) = \log 2 + \log\varphi(\lVert\xi\rVert) - \log A_{D-1}
    - (D-1)\log\lVert\xi\rVert`.

    The trailing ``event_dim`` dims of ``xi`` form one draw (D = their number of elements); the
    leading dims index independent draws. By default the whole tensor is one draw, so for a
    stack of M draws of a site of shape ``s`` pass ``event_dim=len(s)``.

    Usage::

        log_p = radial_log_density(xi, event_dim=2)  # xi of shape (M, 20, 10) -> (M,)

    :param torch.Tensor xi: the noise (not the weights: ``xi = (w - loc) / scale``).
    :param int event_dim: how many trailing dims form one draw (default ``xi.dim()``).
    :returns: tensor of shape ``xi.shape[:xi.dim() - event_dim]``.
    """
    event_dim = xi.dim() if event_dim is None else event_dim
    if not 0 <= event_dim <= xi.dim():
        raise ValueError(
            f"event_dim must lie in [0, xi.dim()] = [0, {xi.dim()}]; got {event_dim}. Pass the "
            "number of trailing dims that form one site."
        )
    d = xi.shape[xi.dim() - event_dim :].numel()
    sq = sum_rightmost(xi * xi, event_dim)
    # log 2 + log φ(ρ) − log A = −ρ²/2 − ½log 2π − (D/2) log π + lgamma(D/2); the −(D−1) log ρ
    # term is written with ρ² to avoid a square root.
    const = -_HALF_LOG_2PI - 0.5 * d * math.log(math.pi) + math.lgamma(0.5 * d)
    out = -0.5 * sq + const
    if d > 1:
        out = out - 0.5 * (d - 1) * sq.log()
    return out


def radial_entropy_constant(dim: int) -> float:
    r"""The entropy of Radial noise in D dimensions,
    :math:`H_D = -\log 2 + \tfrac12\log 2\pi + \tfrac12 + \log A_{D-1} - (D-1)(\gamma+\log 2)/2`
    (:math:`\gamma` the Euler–Mascheroni constant; :math:`E\log|r| = -(\gamma+\log 2)/2`).

    For D = 1 it is the standard Normal entropy ½ log(2πe). Usage::

        h = radial_entropy_constant(site.numel())

    :param int dim: D, the number of weights in the site (>= 1).
    """
    dim = _check_dim("dim", dim)
    return (
        -math.log(2.0)
        + _HALF_LOG_2PI
        + 0.5
        + _log_sphere_area(dim)
        - 0.5 * (dim - 1) * (_EULER_GAMMA + math.log(2.0))
    )


def radial_marginal_icdf(q: torch.Tensor, dim: int, *, num_nodes: int = 4096) -> torch.Tensor:
    r"""Quantiles of one coordinate :math:`\xi_i` of D-dimensional Radial noise.

    :math:`\xi_i = r\,u_i` with :math:`r \sim \mathcal N(0, 1)` independent of
    :math:`u_i^2 \sim \mathrm{Beta}(\tfrac12, \tfrac{D-1}{2})`, so the marginal CDF is
    :math:`F(t) = E_u[\Phi(t / |u_i|)]`. The expectation uses ``num_nodes`` equal-probability
    nodes of the Beta law (midpoint rule, error far below 1e-3 in t) and F is inverted by
    bisection. For D = 1 this is the standard Normal quantile.

    Usage::

        lo, hi = radial_marginal_icdf(torch.tensor([0.05, 0.95]), dim=1000)

    :param torch.Tensor q: probabilities in (0, 1), any shape.
    :param int dim: D, the number of weights in the site.
    :returns: quantiles of the same shape, dtype and device as ``q``.
    """
    dim = _check_dim("dim", dim)
    q = torch.as_tensor(q)
    if not q.is_floating_point():
        q = q.double()
    normal = torch.distributions.Normal(0.0, 1.0)
    q64 = q.detach().to(torch.float64).cpu()
    if dim == 1:
        return normal.icdf(q64).to(q)
    from scipy.stats import beta  # local: scipy is only needed for quantiles

    probs = (torch.arange(num_nodes, dtype=torch.float64) + 0.5) / num_nodes
    u = torch.from_numpy(beta.ppf(probs.numpy(), 0.5, 0.5 * (dim - 1))).sqrt()
    flat = q64.reshape(-1)
    # |ξ_i| <= |r| and the standard Normal quantile bounds the bracket.
    bound = normal.icdf(torch.tensor([1 - 1e-12], dtype=torch.float64)).item()
    lo = torch.full_like(flat, -bound)
    hi = torch.full_like(flat, bound)
    for _ in range(60):  # bisection halves the bracket: 2·bound/2⁶⁰ is far below float64 eps
        mid = 0.5 * (lo + hi)
        cdf = normal.cdf(mid[:, None] / u[None, :]).mean(-1)
        below = cdf < flat
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return (0.5 * (lo + hi)).reshape(q.shape).to(q)


class Radial(TorchDistribution):
    r"""Radial distribution over a whole weight tensor: :math:`w = \mu + \sigma\odot\xi` with
    :func:`radial_noise` :math:`\xi` (docs/design/variational.md).

    By default every dim of ``loc`` is an event dim (one site); pass ``event_dim`` to keep leading
    dims as batch dims. Under ``pyro.plate`` the distribution is expanded on the left as usual.

    Usage::

        q = Radial(loc, scale)              # event_shape == loc.shape
        w = q.rsample((8,))                 # 8 draws, shape (8, *loc.shape)

    :param torch.Tensor loc: μ, the location.
    :param torch.Tensor scale: σ > 0, broadcastable to ``loc``.
    :param int event_dim: number of trailing dims forming one site (default: all of ``loc``'s).

    References:
        Farquhar, Osborne & Gal, "Radial Bayesian Neural Networks: Beyond Discrete Support in
        Large-Scale Bayesian Deep Learning" (AISTATS 2020).
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    has_rsample = True

    def __init__(self, loc, scale, *, event_dim: int | None = None, validate_args=None):
        loc, scale = broadcast_all(loc, scale)
        event_dim = loc.dim() if event_dim is None else event_dim
        if isinstance(event_dim, bool) or not isinstance(event_dim, int):
            raise TypeError(
                f"event_dim must be an int; got {type(event_dim).__name__} {event_dim!r}. Pass a "
                "Python int, or leave it out for loc.dim()."
            )
        if not 0 <= event_dim <= loc.dim():
            raise ValueError(
                f"event_dim must lie in [0, loc.dim()] = [0, {loc.dim()}]; got {event_dim}. Pass "
                "the number of trailing dims of loc that form one site (loc.dim(), the default, "
                "for the whole tensor)."
            )
        self.loc, self.scale = loc, scale
        split = loc.dim() - event_dim
        super().__init__(loc.shape[:split], loc.shape[split:], validate_args=validate_args)

    @property
    def support(self):  # type: ignore[override]
        return constraints.independent(constraints.real, len(self.event_shape))

    @property
    def _event_dim(self) -> int:
        return len(self.event_shape)

    @property
    def _numel(self) -> int:
        # torch.Size.numel() is a number also under torch.jit.trace, whose sizes are tensors.
        return self.event_shape.numel()

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(Radial, _instance)
        shape = torch.Size(batch_shape) + self.event_shape
        new.loc = self.loc.expand(shape)
        new.scale = self.scale.expand(shape)
        super(Radial, new).__init__(torch.Size(batch_shape), self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def rsample(self, sample_shape=torch.Size()):
        sample_shape = torch.Size(sample_shape)
        xi = radial_noise(
            self.event_shape,
            sample_shape + self.batch_shape,
            dtype=self.loc.dtype,
            device=self.loc.device,
        )
        return self.loc + self.scale * xi

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        xi = (value - self.loc) / self.scale
        log_det = sum_rightmost(self.scale.log(), self._event_dim)
        return radial_log_density(xi, event_dim=self._event_dim) - log_det

    def entropy(self):
        log_det = sum_rightmost(self.scale.log(), self._event_dim)
        return log_det + radial_entropy_constant(self._numel)

    @property
    def mean(self):
        return self.loc

    @property
    def variance(self):
        # E[ξᵢ²] = E[r²] E[εᵢ²/‖ε‖²] = 1/D.
        return self.scale.pow(2) / self._numel


def _unwrap_independent(d) -> tuple[object, int]:
    """(base distribution, total reinterpreted dims) through nested ``Independent`` wrappers."""
    dims = 0
    while isinstance(d, Independent):
        dims += d.reinterpreted_batch_ndims
        d = d.base_dist
    return d, dims


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A prior's parameter expanded from a scalar (all strides 0) as a one-element view, so the
    KL evaluates its log and square once instead of once per weight."""
    if t.dim() and not any(t.stride()):
        return t.as_strided((1,) * t.dim(), (0,) * t.dim())
    return t


def _kl_radial_normal_elementwise(p: Radial, q_loc, q_scale) -> torch.Tensor:
    r"""KL(Radial ‖ ∏ N(m, s²)) = −Σ log σᵢ − H_D + Σᵢ [½ log(2π sᵢ²) + ((μᵢ−mᵢ)² + σᵢ²/D)/(2sᵢ²)]
    (docs/design/variational.md: E[(w−μ)²] = σ²/D, so E_q log N is exact)."""
    q_loc, q_scale = _compact(q_loc), _compact(q_scale)
    event_dim, numel = len(p.event_shape), p._numel
    inv_two_var = 0.5 * q_scale.pow(-2)
    diff = p.loc - q_loc
    # Fused multiply-adds: this runs once per site per step, so every kernel launch counts.
    sq = torch.addcmul(diff * diff, p.scale, p.scale, value=1.0 / numel)
    terms = torch.addcmul(-p.scale.log(), sq, inv_two_var)
    kl = sum_rightmost(terms, event_dim) - radial_entropy_constant(numel)
    # Σᵢ ½ log(2π sᵢ²) over the site: with a scalar prior scale that is D·(½ log 2π + log s).
    log_norm = _HALF_LOG_2PI + q_scale.log()
    if log_norm.numel() == 1 and event_dim:
        return kl + numel * log_norm.reshape(())
    shape = torch.broadcast_shapes(log_norm.shape, p.loc.shape)
    return kl + sum_rightmost(log_norm.expand(shape), event_dim)


@register_kl(Radial, Normal)
def _kl_radial_normal(p: Radial, q: Normal):
    # A bare Normal has no event dims, so it pairs only with a Radial over scalars (D = 1);
    # anything else would silently mix the Radial's event dims with the Normal's batch dims.
    if p._event_dim != 0:
        raise NotImplementedError
    return _kl_radial_normal_elementwise(p, q.loc, q.scale)


@register_kl(Radial, Independent)
def _kl_radial_independent(p: Radial, q: Independent):
    base, dims = _unwrap_independent(q)
    if not isinstance(base, Normal) or dims != p._event_dim:
        raise NotImplementedError
    return _kl_radial_normal_elementwise(p, base.loc, base.scale)
