r"""``TraceSuffStat_ELBO``: the ELBO with an M-sample KL whose graph does not grow with M.

The likelihood is estimated as in :class:`~pyro.infer.Trace_ELBO` (``num_particles`` draws of the
weights); every latent site enters through KL(q ‖ p), picked per site (docs/design/variational.md):

- ``kl="auto"`` (default): the exact KL when one is registered with
  :func:`torch.distributions.kl.register_kl`, else the Monte Carlo estimator registered in
  :data:`~pyro_bdl.infer.kl.KL_ESTIMATORS` for (posterior noise family, prior family) —
  sufficient statistics for Normal priors, streaming for any other element-wise prior;
- ``kl="mc"``: always the registered Monte Carlo estimator (the paper's setting);
- ``kl="exact"``: the closed form, or an error naming the site;
- ``kl="direct"``: the naive M-sample graph (memory linear in M), a reference for experiments.

A constrained site (the guide's base pushed through ``biject_to(support)``) is reduced to the
real line first (:mod:`pyro_bdl.infer.kl_transform`): against a prior pushed through the same
bijection (``LogNormal``) the KL is that of the two bases, exact where they have a closed form;
against any other element-wise prior (``Gamma``, ``Uniform``, ``HalfCauchy``) the prior is
pulled back and the streaming estimator applies. A site none of this covers (a non-element-wise
prior, a guide that is not location-scale, AutoNormal's auxiliary sites) enters through
Trace_ELBO's one-sample term, with a :class:`KLFallbackWarning` naming it; a ``Delta`` guide site
(AutoDelta) takes that term silently, as it is exact for a point mass.

The lifted weights' terms (a point mass's log prior, a Normal guide's exact KL, under a prior of
:mod:`pyro_bdl.priors` built from two numbers) are summed in one pass per prior, not evaluated
site by site (:mod:`pyro_bdl.infer.normal_sites`); any site under a handler that changes its term
(scale, mask, a plate) or with another prior or guide takes the per-site path described here.

Scale and mask follow Pyro: the E_q[log q] half takes the guide site's ``scale``/``mask``, the
E_q[log p] half the model site's (for an exact KL with equal scales this is TraceMeanField_ELBO's
``scale * KL``). A prior masked out whole (``.mask(False)``) contributes no KL, as under Pyro's
KL of a masked distribution. Weight sites live outside the data plate, so under a subsampled
plate the KL is counted once per step while the likelihood is scaled by N/B. Under Pyro's
validation every sample site of the model and the guide has its shape checked as under
``Trace_ELBO``: a latent site with batch dims that no plate declares is refused, not summed into
its KL.

A refused step (a non-finite loss, or anything the model or guide raises) changes nothing: the
network's buffers (BatchNorm's running statistics), torch's random state and the parameters'
gradients are put back before the error propagates (:mod:`pyro_bdl.infer.rollback`), so
``SVI.step`` never reaches the optimiser and a retry with good data continues the run as if the
bad batch had not come. The first step learns which buffers a pass writes (a global forward
pre-hook, that step only); later steps copy just those (a few KB) and the generator state before
the passes. A refused first call of an autoguide also undoes its set-up (its parameters and param
store entries), so that the retry initialises it as an uninterrupted first step would.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.distributions import Delta, MaskedDistribution
from pyro.distributions.util import scale_and_mask, sum_rightmost
from pyro.infer import Trace_ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape
from torch.distributions import Distribution, Independent, kl_divergence

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._grad_mode import differentiates
from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.infer.kl import (
    NOISE_FAMILIES,
    RADIAL_NOISE,
    KLTerms,
    NoiseFamily,
    find_kl_estimator,
    kl_direct,
)
from pyro_bdl.infer.kl_transform import reduce_transformed
from pyro_bdl.infer.normal_sites import NormalSites, zero_density
from pyro_bdl.infer.rollback import BufferRecorder, Rollback, refused

__all__ = ["KLFallbackWarning", "TraceSuffStat_ELBO"]

_KL_OPTIONS = ("auto", "mc", "exact", "direct")


def _unwrap(d: Distribution) -> tuple[Distribution, int]:
    """(base distribution, dims reinterpreted as event dims) through ``Independent`` and
    ``ExpandedDistribution`` wrappers (an expanded base broadcasts in every formula we use)."""
    dims = 0
    while True:
        if isinstance(d, Independent):
            dims += d.reinterpreted_batch_ndims
            d = d.base_dist
        elif type(d).__name__ == "ExpandedDistribution" and hasattr(d, "base_dist"):
            d = d.base_dist
        else:
            return d, dims


def _noise_family(d: Distribution) -> NoiseFamily | None:
    for cls in type(d).__mro__:
        family = NOISE_FAMILIES.get(cls)
        if family is not None:
            return family
    return None


def _masked_out(d: Distribution) -> bool:
    """Whether ``d`` is masked out whole (``.mask(False)``, or a mask with no element kept),
    through ``Independent`` and ``ExpandedDistribution`` wrappers."""
    while True:
        if isinstance(d, MaskedDistribution):
            mask = d._mask
            if mask is False or (isinstance(mask, torch.Tensor) and not bool(mask.any())):
                return True
            d = d.base_dist
        elif isinstance(d, Independent) or (
            type(d).__name__ == "ExpandedDistribution" and hasattr(d, "base_dist")
        ):
            d = d.base_dist  # type: ignore[attr-defined]
        else:
            return False


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def _same_scale_and_mask(model_site, guide_site) -> bool:
    return _same(guide_site["scale"], model_site["scale"]) and _same(
        guide_site["mask"], model_site["mask"]
    )


def _exact_kl(q: Distribution, p: Distribution) -> torch.Tensor | None:
    """KL(q ‖ p) in closed form (batch shape), or ``None``. Pairs whose wrappers differ
    (``Independent`` against an expanded prior) are tried element-wise and summed."""
    try:
        return kl_divergence(q, p)
    except NotImplementedError:
        pass
    q_el, _ = _unwrap(q)
    p_el, _ = _unwrap(p)
    if (q_el is q and p_el is p) or q_el.event_shape or p_el.event_shape:
        return None
    try:
        kl = kl_divergence(q_el, p_el)
    except NotImplementedError:
        return None
    return sum_rightmost(kl.expand(q.batch_shape + q.event_shape), len(q.event_shape))


def _refuse_unguided(model_trace, guide_trace) -> None:
    """Refuse latent model sites without a guide site: their KL has no ``q``.

    The usual cause is a model that grew a site after its autoguide was set up. An autoguide
    fixes its sites on its first call and, called alone, never sees the model again, so only
    the step that runs both can notice (Pyro's own ELBOs warn there, "Found vars in model but
    not guide")."""
    missing = [
        name
        for name, site in model_trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name not in guide_trace.nodes
    ]
    if missing:
        raise ValueError(
            f"TraceSuffStat_ELBO: the model samples latent sites {missing} that the guide does "
            "not, so their KL has no guide distribution. If the model grew them after the guide "
            "was set up (an autoguide fixes its sites on its first call), build a new guide over "
            "the model as it is now, after pyro.clear_param_store() (or under another name); "
            "otherwise give the guide a sample site of the same name for each."
        )


def _with_log_prob_shape(site: dict) -> dict:
    """``site`` with a ``log_prob`` of the shape Pyro would compute, for ``check_site_shape``: a
    latent site's density is never evaluated here, so an empty stand-in of that shape (the
    value's batch dims, the distribution's batch shape and a tensor scale or mask broadcast) lets
    Pyro refuse undeclared batch dims as ``Trace_ELBO`` does, at no cost."""
    if "log_prob" in site:
        return site
    value, fn = site["value"], site["fn"]
    shapes = [value.shape[: value.dim() - len(fn.event_shape)], fn.batch_shape]
    shapes += [t.shape for t in (site["scale"], site["mask"]) if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*shapes)
    return {**site, "log_prob": torch.empty(shape, device="meta")}


@dataclass
class _StepGuard:
    """Per-ELBO bookkeeping: the layers to save (known after the first step) and the steps done.

    :ivar int steps: ``loss_and_grads`` calls that completed (SVI steps taken with this ELBO).
    :ivar current: the step under way (``None`` outside ``loss_and_grads``), for error messages.
    """

    rollback: Rollback | None = None
    steps: int = 0
    current: int | None = None


def _leaf(value: torch.Tensor) -> torch.Tensor:
    """The tensor a param site's gradient lands on (a constrained param's unconstrained one)."""
    unconstrained = getattr(value, "unconstrained", None)
    return unconstrained() if callable(unconstrained) else value


class KLFallbackWarning(UserWarning):
    """A latent site of :class:`TraceSuffStat_ELBO` enters through Trace_ELBO's one-sample term
    instead of a KL; emitted once per ELBO instance and site, naming the site and the reason."""


class TraceSuffStat_ELBO(Trace_ELBO):
    r"""A :class:`~pyro.infer.Trace_ELBO` whose KL term uses ``num_kl_samples`` Monte Carlo samples
    at the memory of one.

    Overrides only ``_differentiable_loss_particle`` (and ``loss``), like
    :class:`~pyro.infer.TraceMeanField_ELBO`. The M-sample KL needs a ``Normal`` or
    :class:`~pyro_bdl.distributions.Radial` on each latent site itself
    (:class:`~pyro_bdl.guides.AutoMeanField`, :class:`~pyro_bdl.guides.AutoRadial`), possibly
    pushed through ``biject_to(support)`` for a constrained site, and an element-wise prior (every
    prior of :mod:`pyro_bdl.priors`, and ``LogNormal``, ``Gamma``, ``Uniform``, ... on a
    constrained site). For a constrained site whose prior is the same bijection of a base
    (``LogNormal`` and the guide's ``exp``), the KL is that of the bases, exactly: KL is invariant
    under a bijection applied to both sides.

    Any other site keeps working as under ``Trace_ELBO``: it contributes
    log p(z) − log q(z) at the guide's draw (with the sites' scales and masks), and a
    :class:`KLFallbackWarning` naming the site, the reason and the fix is emitted once per ELBO
    instance and site. Only ``kl="exact"`` without a closed form and guide sites that are not
    reparameterizable (no score-function term here) raise a ``ValueError`` naming the site.
    After each step :attr:`kl_methods` maps site names to the estimator used (``"exact"``,
    ``"suffstat_normal"``, ``"streaming_laplace"``, ``"trace_elbo"`` for the one-sample term,
    ``"delta"`` for a point-mass guide site, ``"masked"`` for a prior masked out whole, ...).

    Usage::

        guide = bdl.guides.AutoRadial(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}),
                  bdl.infer.TraceSuffStat_ELBO(num_kl_samples=1000))

    :param int num_kl_samples: M, the Monte Carlo samples of each site's KL (>= 1).
    :param str kl: ``"auto"``, ``"mc"``, ``"exact"`` or ``"direct"`` (see the module docstring).
    :param int num_particles: draws of the weights for the likelihood term, as in ``Trace_ELBO``.
    :param int chunk_size: samples per chunk when noise is generated (default ≈ 4M numbers).
    :param kwargs: passed to :class:`~pyro.infer.Trace_ELBO` (``max_plate_nesting``,
        ``vectorize_particles``, ...).

    References:
        Nazarovs, Mehta, Lokhande & Singh, "Graph Reparameterizations for Enabling 1000+ Monte
        Carlo Iterations in Bayesian Deep Neural Networks" (UAI 2021).
    """

    def __init__(
        self,
        *,
        num_kl_samples: int = 1000,
        kl: str = "auto",
        num_particles: int = 1,
        chunk_size: int | None = None,
        **kwargs,
    ):
        self.num_kl_samples = check_positive_int("num_kl_samples", num_kl_samples)
        self.kl = check_choice("kl", kl, _KL_OPTIONS)
        check_positive_int("num_particles", num_particles)
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        self.chunk_size = chunk_size
        super().__init__(num_particles=num_particles, **kwargs)
        self.kl_methods: dict[str, str] = {}
        # Off only in tests, for the site-by-site reference of the same loss.
        self._group_normal_sites = True
        self._warned: set[str] = set()
        self._guard = _StepGuard()

    def __getstate__(self) -> dict[str, Any]:
        # The buffers learned on the first step are the layers of the network it ran; a copy
        # (deepcopy, pickle) would hold copies of those layers and, used with the original
        # network, put back the copies' buffers on a refusal. The copy learns them afresh.
        state = dict(self.__dict__)
        state["_guard"] = _StepGuard(steps=self._guard.steps)
        return state

    def _get_trace(self, model, guide, args, kwargs):
        # As pyro.infer.enum.get_importance_trace, minus the log-densities of latent sites in the
        # model and the guide: they enter only through their KL, so computing them is wasted
        # work (and graph) on every weight tensor.
        if isinstance(poutine.unwrap(guide), poutine.messenger.Messenger):
            return super()._get_trace(model, guide, args, kwargs)
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        if is_validation_enabled():
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
            check_if_enumerated(guide_trace)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace = prune_subsample_sites(model_trace)
        model_trace.compute_log_prob(site_filter=lambda name, site: site["is_observed"])
        if is_validation_enabled():
            for trace in (model_trace, guide_trace):
                for site in trace.nodes.values():
                    if site["type"] == "sample":
                        check_site_shape(_with_log_prob_shape(site), self.max_plate_nesting)
        return model_trace, guide_trace

    @differentiates
    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Trace_ELBO's loss and backward pass over ``num_particles`` particles, undone on any
        error: the network's buffers, the random state and the gradients (with several
        particles, those of the earlier ones too) are left as they were."""
        recorder = BufferRecorder() if self._guard.rollback is None else None
        cpu_rng = torch.get_rng_state() if recorder is not None else None
        cuda_rng = (
            torch.cuda.get_rng_state_all()
            if recorder is not None and torch.cuda.is_initialized()
            else None
        )
        if recorder is not None:
            recorder.__enter__()
        else:
            assert self._guard.rollback is not None
            self._guard.rollback.save()
        # An autoguide sets itself up (parameters, param store entries) on its first call; a refused
        # first call undoes that too, so that the retry initialises it as the first call would have.
        fresh_guide = getattr(guide, "prototype_trace", False) is None
        store = pyro.get_param_store()
        known = set(store.keys()) if fresh_guide or recorder is not None else None
        grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._guard.current = self._guard.steps + 1
        loss = 0.0
        try:
            for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
                loss_particle, surrogate = self._differentiable_loss_particle(
                    model_trace, guide_trace
                )
                loss += loss_particle / self.num_particles
                sites = [
                    site
                    for trace in (model_trace, guide_trace)
                    for site in trace.nodes.values()
                    if site["type"] == "param"
                ]
                if sites and getattr(surrogate, "requires_grad", False):
                    if grads is None and self.num_particles > 1:
                        params = [_leaf(site["value"]) for site in sites]
                        grads = [(p, None if p.grad is None else p.grad.clone()) for p in params]
                    if self.num_particles > 1:  # one particle: no division op to launch
                        surrogate = surrogate / self.num_particles
                    surrogate.backward(retain_graph=self.retain_graph)
        except BaseException as err:
            refused(err, f"TraceSuffStat_ELBO step {self._guard.current}")
            if recorder is not None:
                recorder.__exit__()
                recorder.restore()
                if cpu_rng is not None:
                    torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
            else:
                assert self._guard.rollback is not None
                self._guard.rollback.restore()
            for p, g in grads or ():
                p.grad = g
            for name in set(store.keys()) - known if known is not None else ():
                del store[name]
            if fresh_guide:
                guide.prototype_trace = None
            raise
        finally:
            self._guard.current = None
        if recorder is not None:
            recorder.__exit__()
            self._guard.rollback = Rollback(recorder.written())
        self._guard.steps += 1
        return loss

    @differentiates  # a streaming KL takes the prior's score by autograd, chunk by chunk
    def loss(self, model, guide, *args, **kwargs) -> float:
        """An estimate of the negative ELBO (no gradient), averaged over ``num_particles``."""
        loss = 0.0
        with torch.no_grad():
            for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
                loss_particle, _ = self._differentiable_loss_particle(model_trace, guide_trace)
                loss += loss_particle / self.num_particles
        return loss

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        terms: list[tuple[str, Any, torch.Tensor]] = []
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample":
                continue
            if not getattr(site["fn"], "has_rsample", False):
                raise ValueError(
                    f"TraceSuffStat_ELBO: guide site {name!r} ({type(site['fn']).__name__}) is "
                    "not reparameterizable, and this ELBO has no score-function term for it. Use "
                    "pyro.infer.TraceGraph_ELBO (or TraceEnum_ELBO to enumerate a discrete site)."
                )
            if name not in model_trace.nodes and isinstance(_unwrap(site["fn"])[0], Delta):
                # A point-mass auxiliary site (AutoSWAG's packed point estimate): its
                # Trace_ELBO term is exact, as for a Delta on a latent site; a PointMass at its
                # own draw without a Jacobian has the term 0, added as nothing.
                self.kl_methods[name] = "delta"
                if not (zero_density(site) and self._group_normal_sites):
                    terms.append(("KL", name, self._trace_elbo_term(None, site)))
            elif name not in model_trace.nodes:
                reason = (
                    "the guide site has no model site (an auxiliary site, as in AutoNormal's "
                    "Normal + Delta construction); for the M-sample KL use "
                    "pyro_bdl.guides.AutoMeanField or AutoRadial, which sample each site from its "
                    "own distribution"
                )
                terms.append(("KL", name, self._fallback(name, None, site, reason)))
        _refuse_unguided(model_trace, guide_trace)
        # The lifted weights' closed-form terms, summed per prior in one pass
        # (pyro_bdl.infer.normal_sites); every other site is evaluated on its own.
        grouped = NormalSites() if self._group_normal_sites else None
        exact = self.kl in ("auto", "exact")
        place: int | None = None
        for name, site in model_trace.nodes.items():
            if site["type"] != "sample":
                continue
            if site["is_observed"]:
                terms.append(("likelihood", name, site["log_prob_sum"]))
                continue
            guide_site = guide_trace.nodes[name]
            method = (
                None if grouped is None else grouped.add(name, site, guide_site, exact_kl=exact)
            )
            if method is None:
                terms.append(("KL", name, self._site_elbo(name, site, guide_site)))
                continue
            self.kl_methods[name] = method
            if place is None:  # the group's term stands where its first site does
                place = len(terms)
                terms.append(("KL", grouped, 0.0))
        if place is not None:
            assert grouped is not None
            terms[place] = ("KL", grouped, grouped.total())
        # Summed from the first term, not from 0, and negated once: two ops fewer per step.
        elbo = terms[0][2] if terms else 0.0
        for _, _, t in terms[1:]:
            elbo = elbo + t
        negated = -elbo
        loss = torch_item(negated) if isinstance(negated, torch.Tensor) else float(negated)
        if not math.isfinite(loss):
            self._raise_non_finite(terms, loss)
        return loss, negated

    def _raise_non_finite(self, terms, loss: float) -> None:
        where = "" if self._guard.current is None else f" at step {self._guard.current}"
        named: list[tuple[str, str, Any]] = []
        for term, name, value in terms:
            if isinstance(name, NormalSites):
                named += [(term, n, v) for n, v in name.site_terms()]
            else:
                named.append((term, name, value))
        for term, name, value in named:
            value = torch.as_tensor(value).detach().sum()
            if not torch.isfinite(value):
                raise ValueError(
                    f"TraceSuffStat_ELBO{where}: the {term} term of site {name!r} is non-finite "
                    f"({float(value)}); nothing was updated. Lower the learning rate, check the "
                    "data for NaN/inf, or check the initial scales of the guide."
                )
        raise ValueError(
            f"TraceSuffStat_ELBO{where}: the loss overflowed ({loss}), though every term is "
            "finite; nothing was updated. Standardise the data, or lower the learning rate."
        )

    def _site_elbo(self, name: str, model_site, guide_site) -> torch.Tensor:
        """E_q[log p] (model scale/mask) − E_q[log q] (guide scale/mask) for one latent site."""
        q, p = guide_site["fn"], model_site["fn"]
        if _masked_out(p):
            # As Pyro's KL of a masked distribution: a prior masked out whole contributes
            # nothing (and its log-density, zero everywhere, has no gradient to stream).
            self.kl_methods[name] = "masked"
            return guide_site["value"].new_zeros(())
        if isinstance(_unwrap(q)[0], Delta):
            # A point mass (AutoDelta; AutoNormal's Delta, whose log_density carries the
            # Jacobian): Trace_ELBO's term is exact, with no sampling variance of its own.
            self.kl_methods[name] = "delta"
            return self._trace_elbo_term(model_site, guide_site)
        reduced = reduce_transformed(q, p)
        value: torch.Tensor | str
        if reduced is None:
            value = self._kl_elbo(name, q, p, model_site, guide_site)
        elif isinstance(reduced, str):
            value = reduced
        else:
            value = self._kl_elbo(name, reduced.q, reduced.p, model_site, guide_site)
            if not isinstance(value, str) and not _same_scale_and_mask(model_site, guide_site):
                value = value + self._jacobian_term(reduced.transform, model_site, guide_site)
        if isinstance(value, str):
            if self.kl == "exact":
                raise ValueError(
                    f"TraceSuffStat_ELBO(kl='exact'): site {name!r} has no closed-form KL "
                    f"between the guide's {type(q).__name__} and the prior's {type(p).__name__}. "
                    "Use kl='auto' (a Monte Carlo estimate where no closed form exists) or "
                    "register one with torch.distributions.kl.register_kl."
                )
            return self._fallback(name, model_site, guide_site, value)
        return value

    def _kl_elbo(self, name: str, q, p, model_site, guide_site) -> torch.Tensor | str:
        """The site's term from KL(q ‖ p) (exact or M-sample), or why there is none."""
        g_scale, g_mask = guide_site["scale"], guide_site["mask"]
        m_scale, m_mask = model_site["scale"], model_site["mask"]
        if self.kl in ("auto", "exact"):
            exact = _exact_kl(q, p)
            if exact is not None and _same_scale_and_mask(model_site, guide_site):
                self.kl_methods[name] = "exact"
                return -scale_and_mask(exact, g_scale, g_mask).sum()
            if exact is not None:
                # Different scales on the two halves: split KL = −H − E_q[log p] exactly.
                try:
                    entropy = q.entropy()
                except NotImplementedError:
                    entropy = None
                if entropy is not None:
                    self.kl_methods[name] = "exact"
                    return (
                        scale_and_mask(-exact - entropy, m_scale, m_mask).sum()
                        + scale_and_mask(entropy, g_scale, g_mask).sum()
                    )
            if self.kl == "exact":
                return "no closed form"
        terms = self._mc_terms(name, q, p)
        if isinstance(terms, str):
            return terms
        return (
            scale_and_mask(terms.log_p, m_scale, m_mask).sum()
            - scale_and_mask(terms.log_q, g_scale, g_mask).sum()
        )

    @staticmethod
    def _jacobian_term(transform, model_site, guide_site) -> torch.Tensor:
        r"""With z = T(u), log q(z) and log p(z) both carry −log|T'(u)|; it cancels in the KL but
        not when the two halves are scaled differently: (g − m)·E_q[log|T'(u)|], estimated at the
        guide's draw (reparameterized, so unbiased in value and gradient)."""
        z = guide_site["value"]
        u = transform.inv(z)
        ladj = transform.log_abs_det_jacobian(u, z)
        ladj = sum_rightmost(ladj, ladj.dim() - len(guide_site["fn"].batch_shape))
        return (
            scale_and_mask(ladj, guide_site["scale"], guide_site["mask"]).sum()
            - scale_and_mask(ladj, model_site["scale"], model_site["mask"]).sum()
        )

    def _fallback(self, name: str, model_site, guide_site, reason: str) -> torch.Tensor:
        """Trace_ELBO's term for the site: log p(z) − log q(z) at the guide's draw."""
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"TraceSuffStat_ELBO: no M-sample KL for site {name!r}: {reason}. The site "
                "enters through Trace_ELBO's one-sample term log p(z) - log q(z) at the guide's "
                "draw (unbiased, with more variance).",
                KLFallbackWarning,
                stacklevel=user_stacklevel(),
            )
        self.kl_methods[name] = "trace_elbo"
        return self._trace_elbo_term(model_site, guide_site)

    @staticmethod
    def _trace_elbo_term(model_site, guide_site) -> torch.Tensor:
        value = guide_site["value"]
        log_q = guide_site["fn"].log_prob(value)
        elbo = -scale_and_mask(log_q, guide_site["scale"], guide_site["mask"]).sum()
        if model_site is not None:
            log_p = model_site["fn"].log_prob(value)
            elbo = elbo + scale_and_mask(log_p, model_site["scale"], model_site["mask"]).sum()
        return elbo

    def _mc_terms(self, name: str, q: Distribution, p: Distribution) -> KLTerms | str:
        """The registered M-sample estimator's terms, or why none applies (with the fix)."""
        q_base, q_dims = _unwrap(q)
        p_base, p_dims = _unwrap(p)
        family = _noise_family(q_base)
        if family is None:
            known = ", ".join(c.__name__ for c in NOISE_FAMILIES)
            return (
                f"the guide's {type(q_base).__name__} is not a registered location-scale "
                f"posterior (known: {known}); for the M-sample KL use a guide with one of these "
                "on each site, such as pyro_bdl.guides.AutoMeanField or AutoRadial"
            )
        if family is RADIAL_NOISE and q_dims:
            return (
                "a Radial wrapped in Independent normalises over too few dims; use "
                "pyro_bdl.guides.AutoRadial, whose Radial covers the whole site"
            )
        if p_base.event_shape != torch.Size() or p_dims != len(q.event_shape):
            return (
                f"the prior {type(p_base).__name__} is not element-wise over the site's "
                f"{len(q.event_shape)} event dims; the M-sample estimators need an element-wise "
                "prior (or register a closed form with torch.distributions.kl.register_kl)"
            )
        estimator = (
            kl_direct if self.kl == "direct" else find_kl_estimator(family.name, type(p_base))
        )
        if estimator is None:
            return (
                f"nothing is registered for ({family.name!r}, {type(p_base).__name__}); register "
                "an estimator with pyro_bdl.infer.register_kl_estimator(noise, prior_type)"
            )
        loc, scale = q_base.loc, q_base.scale  # type: ignore[attr-defined]
        try:
            terms = estimator(
                loc,
                scale,
                p_base,
                noise=family,
                num_samples=self.num_kl_samples,
                event_dim=len(q.event_shape),
                chunk_size=self.chunk_size,
            )
        except NotImplementedError as err:
            return str(err)
        self.kl_methods[name] = getattr(estimator, "__name__", "custom")
        return terms
