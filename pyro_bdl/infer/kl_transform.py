r"""Constrained latent sites: reduce KL(q ‖ p) on a support to a KL between unconstrained bases.

An autoguide puts a constrained site's posterior on the real line and pushes it through
:math:`T = ` ``biject_to(support)``: :math:`q = T_\# q_0`. The KL is invariant under a bijection
applied to both arguments, so

- when the prior is itself :math:`T_\# p_0` (``LogNormal`` is the exp-transformed ``Normal``),
  :math:`KL(q\,\|\,p) = KL(q_0\,\|\,p_0)`, exact in closed form where that pair has one;
- otherwise, for an element-wise :math:`T` and an element-wise prior, :math:`p` is pulled back:
  :math:`KL(q\,\|\,p) = KL(q_0\,\|\,T^{-1}_\# p)` with
  :math:`\log (T^{-1}_\# p)(u) = \log p(T(u)) + \log|T'(u)|` (:class:`PulledBack`), an
  element-wise prior on the real line that the streaming estimator handles.

Transforms are compared after flattening ``ComposeTransform``, unwrapping ``IndependentTransform``
and dropping identity affine maps (``biject_to(positive)`` is ``exp`` followed by ``x + 0``), with
the transforms' own ``==``. See docs/design/variational.md.

Usage::

    reduced = reduce_transformed(q, p)  # None: nothing to reduce
    if reduced is not None:
        q0, p0 = reduced.q, reduced.p

References:
    Kullback, "Information Theory and Statistics" (1959), invariance of the divergence under
    one-to-one maps; Kucukelbir, Tran, Ranganath, Gelman & Blei, "Automatic Differentiation
    Variational Inference" (JMLR 2017), the transformed posterior.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributions import Distribution, Independent, TransformedDistribution, constraints
from torch.distributions.transforms import (
    AffineTransform,
    ComposeTransform,
    IndependentTransform,
    Transform,
)

__all__ = ["PulledBack", "Reduced", "reduce_transformed", "same_transforms"]


class Reduced(NamedTuple):
    """A site's KL problem moved to the real line.

    :ivar q: the guide's base distribution, with the site's event dims.
    :ivar p: the prior's base (``pulled=False``) or its pull-back :class:`PulledBack`.
    :ivar transform: the guide's transform :math:`T`, mapping the base onto the site's support.
    :ivar bool pulled: whether ``p`` is a pull-back (never a closed form) or the prior's own base.
    """

    q: Distribution
    p: Distribution
    transform: Transform
    pulled: bool


def _is_identity(t: Transform) -> bool:
    if not isinstance(t, AffineTransform):
        return False
    for value, target in ((t.loc, 0.0), (t.scale, 1.0)):
        if isinstance(value, torch.Tensor):
            if value.requires_grad or not bool((value == target).all()):
                return False
        elif value != target:
            return False
    return True


def transform_parts(t: Transform) -> list[Transform]:
    """The element-level maps of ``t``: compositions flattened, ``IndependentTransform``
    unwrapped (it only reinterprets dims), identity affine maps dropped."""
    if isinstance(t, ComposeTransform):
        return [part for inner in t.parts for part in transform_parts(inner)]
    if isinstance(t, IndependentTransform):
        return transform_parts(t.base_transform)
    return [] if _is_identity(t) else [t]


def same_transforms(a: list[Transform], b: list[Transform]) -> bool:
    """Whether two flattened transform lists are the same map (by the transforms' ``==``;
    torch falls back to identity for transforms that do not define it)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        try:
            if not bool(x == y):
                return False
        except RuntimeError:  # parameters of shapes that do not broadcast
            return False
    return True


def _split(d: Distribution) -> tuple[Distribution, list[Transform]]:
    """(base, transforms applied to it, innermost first) through Independent wrappers."""
    if isinstance(d, Independent):
        base, ts = _split(d.base_dist)
        if not ts:
            return d, []
        return Independent(base, d.reinterpreted_batch_ndims, validate_args=False), ts
    if isinstance(d, TransformedDistribution):
        base, ts = _split(d.base_dist)
        return base, ts + list(d.transforms)
    return d, []


def _shape(d: Distribution) -> torch.Size:
    return d.batch_shape + d.event_shape


def _with_event_dims(d: Distribution, event_dims: int) -> Distribution | None:
    """``d`` with ``event_dims`` event dims, or ``None`` when it has more, or too few batch dims
    to make up the rest (a transform that adds dims, as ``CorrCholeskyTransform`` does)."""
    extra = event_dims - len(d.event_shape)
    if extra < 0 or extra > len(d.batch_shape):
        return None
    return Independent(d, extra, validate_args=False) if extra else d


def _elementwise(d: Distribution) -> Distribution | None:
    """The element-wise distribution inside ``Independent``/``ExpandedDistribution`` wrappers."""
    while True:
        if isinstance(d, Independent):
            d = d.base_dist
        elif type(d).__name__ == "ExpandedDistribution" and hasattr(d, "base_dist"):
            d = d.base_dist
        else:
            return d if d.event_shape == torch.Size() else None


class PulledBack(Distribution):
    r"""The element-wise prior :math:`p` pulled back to the real line through an element-wise
    bijection :math:`T`: :math:`\log p_0(u) = \log p(T(u)) + \log|T'(u)|`.

    The prior's parameters stay reachable as attributes (and ``arg_constraints`` is the prior's),
    so the streaming estimator's refusal of learnable prior parameters applies to it too.

    :param prior: an element-wise distribution on :math:`T`'s codomain.
    :param transform: an element-wise bijection from the real line onto its support.
    :param batch_shape: the site's shape (the prior broadcasts to it).
    """

    support = constraints.real

    def __init__(self, prior: Distribution, transform: Transform, batch_shape: torch.Size):
        self.prior, self.transform = prior, transform
        super().__init__(batch_shape, validate_args=False)

    @property
    def arg_constraints(self) -> dict:  # type: ignore[override]
        return self.prior.arg_constraints

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the instance lacks: the prior's parameters (loc, scale, ...).
        prior = self.__dict__.get("prior")
        if prior is not None and name in prior.arg_constraints:
            return getattr(prior, name)
        raise AttributeError(name)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        x = self.transform(value)
        return self.prior.log_prob(x) + self.transform.log_abs_det_jacobian(value, x)


def reduce_transformed(q: Distribution, p: Distribution) -> Reduced | str | None:
    """KL(q ‖ p) as a KL between distributions on the real line (see the module docstring):
    ``None`` when ``q`` is not a transformed distribution, a reason when it cannot be reduced."""
    q_base, q_ts = _split(q)
    if not q_ts:
        return None
    event_dims = len(q.event_shape)
    transform = ComposeTransform(q_ts) if len(q_ts) > 1 else q_ts[0]
    q0 = _with_event_dims(q_base, event_dims)
    if q0 is None or _shape(q0) != _shape(q):
        return (
            f"the guide's transform {type(transform).__name__} changes the site's shape, and "
            f"the prior {type(p).__name__} is not the same transform of a base; register a "
            f"closed form with torch.distributions.kl.register_kl({type(q).__name__}, "
            f"{type(p).__name__})"
        )
    q_parts = [part for t in q_ts for part in transform_parts(t)]
    p_base, p_ts = _split(p)
    if p_ts and same_transforms(q_parts, [part for t in p_ts for part in transform_parts(t)]):
        p0 = _with_event_dims(p_base, len(p.event_shape))
        if p0 is not None and _shape(p0) == _shape(p):
            return Reduced(q0, p0, transform, pulled=False)
    p_el = _elementwise(p)
    if p_el is None or len(p.event_shape) != event_dims:
        return (
            f"the prior {type(p).__name__} is not element-wise over the site's {event_dims} "
            "event dims, so it cannot be pulled back through the guide's transform; register a "
            f"closed form with torch.distributions.kl.register_kl({type(q).__name__}, "
            f"{type(p).__name__})"
        )
    if any(part.domain.event_dim or part.codomain.event_dim for part in q_parts):
        return (
            f"the guide's transform {type(transform).__name__} is not element-wise; register a "
            f"closed form with torch.distributions.kl.register_kl({type(q).__name__}, "
            f"{type(p).__name__})"
        )
    part = ComposeTransform(q_parts) if len(q_parts) != 1 else q_parts[0]
    p0 = _with_event_dims(PulledBack(p_el, part, _shape(p)), event_dims)
    assert p0 is not None
    return Reduced(q0, p0, transform, pulled=True)
