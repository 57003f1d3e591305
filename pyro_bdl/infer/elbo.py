r"""``TraceSuffStat_ELBO``: the ELBO with an M-sample KL whose graph does not grow with M.

The likelihood is estimated as in :class:`~pyro.infer.Trace_ELBO` (``num_particles`` draws of the
weights); every latent site enters through KL(q ‖ p), picked per site (DESIGN.md 4.4):

- ``kl="auto"`` (default): the exact KL when one is registered with
  :func:`torch.distributions.kl.register_kl`, else the Monte Carlo estimator registered in
  :data:`~pyro_bdl.infer.kl.KL_ESTIMATORS` for (posterior noise family, prior family) —
  sufficient statistics for Normal priors, streaming for any other element-wise prior;
- ``kl="mc"``: always the registered Monte Carlo estimator (the paper's setting);
- ``kl="exact"``: the closed form, or an error naming the site;
- ``kl="direct"``: the naive M-sample graph (memory linear in M), a reference for experiments.

Scale and mask follow Pyro: the E_q[log q] half takes the guide site's ``scale``/``mask``, the
E_q[log p] half the model site's (for an exact KL with equal scales this is TraceMeanField_ELBO's
``scale * KL``). Weight sites live outside the data plate, so under a subsampled plate the KL is
counted once per step while the likelihood is scaled by N/B.
"""

from __future__ import annotations

from typing import Any

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import Trace_ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape
from torch.distributions import Distribution, Independent, kl_divergence

from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.infer import kl as _kl

__all__ = ["TraceSuffStat_ELBO"]

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


def _noise_family(d: Distribution) -> _kl.NoiseFamily | None:
    for cls in type(d).__mro__:
        family = _kl.NOISE_FAMILIES.get(cls)
        if family is not None:
            return family
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


class TraceSuffStat_ELBO(Trace_ELBO):
    r"""A :class:`~pyro.infer.Trace_ELBO` whose KL term uses ``num_kl_samples`` Monte Carlo samples
    at the memory of one.

    Overrides only ``_differentiable_loss_particle`` (and ``loss``), like
    :class:`~pyro.infer.TraceMeanField_ELBO`. The guide must put a ``Normal`` or
    :class:`~pyro_bdl.distributions.Radial` on each latent site itself
    (:class:`~pyro_bdl.guides.AutoMeanField`, :class:`~pyro_bdl.guides.AutoRadial`), and the prior
    must be element-wise (every prior of :mod:`pyro_bdl.priors`); any other pair raises a
    ``ValueError`` naming the site. After each step :attr:`kl_methods` maps site names to the
    estimator used (``"exact"``, ``"suffstat_normal"``, ``"streaming_laplace"``, ...).

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
            for site in model_trace.nodes.values():
                if site["type"] == "sample" and site["is_observed"]:
                    check_site_shape(site, self.max_plate_nesting)
        return model_trace, guide_trace

    def loss(self, model, guide, *args, **kwargs) -> float:
        """An estimate of the negative ELBO (no gradient), averaged over ``num_particles``."""
        loss = 0.0
        with torch.no_grad():
            for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
                loss_particle, _ = self._differentiable_loss_particle(model_trace, guide_trace)
                loss += loss_particle / self.num_particles
        return loss

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        for name, site in guide_trace.nodes.items():
            if site["type"] == "sample" and name not in model_trace.nodes:
                raise ValueError(
                    f"TraceSuffStat_ELBO: guide site {name!r} has no model site (an auxiliary "
                    "site, as in AutoNormal's Normal + Delta construction); its KL cannot be "
                    "formed. Use pyro_bdl.guides.AutoMeanField or AutoRadial, which sample each "
                    "weight site from its own distribution."
                )
        terms: list[tuple[str, str, torch.Tensor]] = []
        for name, site in model_trace.nodes.items():
            if site["type"] != "sample":
                continue
            if site["is_observed"]:
                terms.append(("likelihood", name, site["log_prob_sum"]))
            else:
                terms.append(("KL", name, self._site_elbo(name, site, guide_trace.nodes[name])))
        elbo = sum(t for _, _, t in terms)
        loss = torch_item(-elbo) if isinstance(elbo, torch.Tensor) else -float(elbo)
        if not torch.isfinite(torch.as_tensor(loss)):
            self._raise_non_finite(terms)
        return loss, -elbo

    @staticmethod
    def _raise_non_finite(terms) -> None:
        for term, name, value in terms:
            if not torch.isfinite(torch.as_tensor(value)).all():
                raise ValueError(
                    f"TraceSuffStat_ELBO: the {term} term of site {name!r} is non-finite "
                    f"({float(value)}). Lower the learning rate, check the data for NaN/inf, or "
                    "check the initial scales of the guide."
                )

    def _site_elbo(self, name: str, model_site, guide_site) -> torch.Tensor:
        """E_q[log p] (model scale/mask) − E_q[log q] (guide scale/mask) for one latent site."""
        q, p = guide_site["fn"], model_site["fn"]
        g_scale, g_mask = guide_site["scale"], guide_site["mask"]
        m_scale, m_mask = model_site["scale"], model_site["mask"]
        if self.kl in ("auto", "exact"):
            try:
                exact = kl_divergence(q, p)
            except NotImplementedError:
                if self.kl == "exact":
                    raise ValueError(
                        f"TraceSuffStat_ELBO(kl='exact'): site {name!r} has no closed-form KL "
                        f"between the guide's {type(q).__name__} and the prior's "
                        f"{type(p).__name__}. Use kl='auto' (Monte Carlo where no closed form "
                        "exists) or register one with torch.distributions.kl.register_kl."
                    ) from None
            else:
                self.kl_methods[name] = "exact"
                if _same(g_scale, m_scale) and _same(g_mask, m_mask):
                    return -scale_and_mask(exact, g_scale, g_mask).sum()
                # Different scales on the two halves: split KL = −H − E_q[log p] exactly.
                entropy = q.entropy()
                return (
                    scale_and_mask(-exact - entropy, m_scale, m_mask).sum()
                    + scale_and_mask(entropy, g_scale, g_mask).sum()
                )
        terms = self._mc_terms(name, q, p)
        return (
            scale_and_mask(terms.log_p, m_scale, m_mask).sum()
            - scale_and_mask(terms.log_q, g_scale, g_mask).sum()
        )

    def _mc_terms(self, name: str, q: Distribution, p: Distribution) -> _kl.KLTerms:
        q_base, q_dims = _unwrap(q)
        p_base, p_dims = _unwrap(p)
        family = _noise_family(q_base)
        reason = ""
        estimator = None
        if family is None:
            reason = (
                f"the guide's {type(q_base).__name__} is not a registered location-scale "
                f"posterior (known: {', '.join(c.__name__ for c in _kl.NOISE_FAMILIES)})"
            )
        elif family is _kl.RADIAL_NOISE and q_dims:
            reason = "a Radial wrapped in Independent normalises over too few dims"
        elif p_base.event_shape != torch.Size() or p_dims != len(q.event_shape):
            reason = (
                f"the prior {type(p_base).__name__} is not element-wise over the site's "
                f"{len(q.event_shape)} event dims"
            )
        else:
            estimator = (
                _kl.kl_direct
                if self.kl == "direct"
                else _kl.find_kl_estimator(family.name, type(p_base))
            )
            if estimator is None:
                reason = f"nothing is registered for ({family.name!r}, {type(p_base).__name__})"
        if estimator is not None:
            assert family is not None
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
                reason = str(err)
            else:
                self.kl_methods[name] = getattr(estimator, "__name__", "custom")
                return terms
        raise ValueError(
            f"TraceSuffStat_ELBO: no KL estimator for site {name!r}: posterior "
            f"{type(q_base).__name__}, prior {type(p_base).__name__} ({reason}). Use "
            "pyro_bdl.guides.AutoMeanField or AutoRadial with a prior from pyro_bdl.priors, or "
            "register an estimator with pyro_bdl.infer.register_kl_estimator(noise, prior_type)."
        )
