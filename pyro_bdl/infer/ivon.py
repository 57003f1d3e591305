r"""IVON: Improved Variational Online Newton, natural-gradient VI at the cost of one backward pass.

IVON fits a diagonal Gaussian :math:`q = \mathcal N(m, \operatorname{diag}\sigma^2)` over a lifted
network's weights, under the Gaussian prior :math:`\mathcal N(\mu_0, \operatorname{diag}
(\lambda\delta)^{-1})` declared in :func:`~pyro_bdl.bayesianize` (prior precision
:math:`\lambda\delta`, :math:`\lambda` the effective sample size), with
:math:`\sigma^2 = 1/(\lambda(h+\delta))` and the update of
:func:`~pyro_bdl.infer.ivon_update.ivon_update`. Unlike VOGN it needs no per-example gradients:
the curvature estimate is :math:`\hat h = \hat g\,(\theta - m)/\sigma^2` from the ordinary
minibatch gradient :math:`\hat g` at the sample :math:`\theta \sim q` (docs/design/ivon.md).

It shares VOGN's machinery: the same model reading and checks (:mod:`~pyro_bdl.infer.vogn_setup`),
the same state (:class:`~pyro_bdl.infer.VOGNState`: ``momentum`` holds :math:`g`, ``curvature``
:math:`h`), the same guide (:class:`~pyro_bdl.infer.VOGNGuide`), refusals and rollback.

References:

- Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan, Möllenhoff,
  "Variational Learning is Effective for Large Deep Networks", ICML 2024.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pyro_bdl._validation import check_positive
from pyro_bdl.infer.ivon_passes import IVONPasses
from pyro_bdl.infer.ivon_update import IVONHyperparameters, blocks, ivon_scale, ivon_update
from pyro_bdl.infer.rollback import Rollback, refused
from pyro_bdl.infer.vogn_checks import check_arguments, check_hyperparameters, check_loss
from pyro_bdl.infer.vogn_guide import VOGNGuide
from pyro_bdl.infer.vogn_model import Hidden
from pyro_bdl.infer.vogn_prior import VOGNPrior
from pyro_bdl.infer.vogn_setup import Prepared, prepare
from pyro_bdl.infer.vogn_state_dict import check_state_dict, pack_state_dict, unpack_state_dict
from pyro_bdl.infer.vogn_update import VOGNOptimizer, VOGNState
from pyro_bdl.layout import SiteLayout

__all__ = ["IVON"]

_METHOD = "IVON"


class IVON:
    r"""IVON over a lifted network, shaped like ``SVI`` and :class:`~pyro_bdl.infer.VOGN`.

    Each :meth:`step` draws ``num_particles`` weight samples θ = m + σε, runs the model
    conditioned on each, reads the per-example negative log-likelihoods inside
    ``pyro.plate("data", N, subsample_size=B)`` (without the plate's N/B scaling), takes ĝ, their
    batch mean's gradient at θ, by one backward pass, forms ĥ = ĝ ε/σ, and applies
    :func:`~pyro_bdl.infer.ivon_update.ivon_update`.

    **Prior.** By default the Gaussian prior declared in :func:`~pyro_bdl.bayesianize` (per-weight
    mean μ₀ and precision λδ, so the weight decay is δ = precision/ess); a non-Gaussian one
    raises :class:`~pyro_bdl.priors.NonGaussianPriorError` at the first step.
    ``prior_precision`` replaces it by N(0, prior_precision⁻¹ I).

    **Hidden parameters** (BatchNorm's affine parameters) are point estimates without noise and
    so without ĥ: their h stays at ``hess_init`` and they take the debiased gradient step
    α ĝ/((1 − β₁ᵗ)(h₀ + δ̄)), δ̄ the mean weight decay.

    Usage::

        ivon = bdl.infer.IVON(model, dataset_size=N, lr=0.1)
        for x, y in loader:
            loss = ivon.step(x, y)
        probs = Predictive(model, guide=ivon.guide, num_samples=32)(x_test)

    :param callable model: a Pyro model over a :func:`~pyro_bdl.bayesianize` -d network whose only
        latent sites are its weights and whose observations lie in the data plate.
    :param int dataset_size: N, the number of training examples (the data plate's size).
    :param float lr: learning rate α (> 0); IVON's are far larger than Adam's (0.05 to 0.5).
    :param tuple betas: (β₁, β₂), gradient and curvature averaging rates, each in [0, 1).
    :param float hess_init: h₀ (> 0), the initial curvature: σ starts at 1/√(λ(h₀ + δ)).
    :param float ess: λ (> 0), the effective sample size; ``None`` for N. λ > N tempers the
        posterior (narrower σ), λ < N widens it.
    :param float prior_precision: the precision (> 0) of an N(0, prior_precision⁻¹ I) prior instead
        of the lifted one.
    :param int num_particles: weight samples per step (ĝ and ĥ are averaged over them).
    :param callable reduce_fn: optional ``reduce_fn(tensors)`` called once per step on
        ``[ĝ, ĥ, ĝ of each hidden parameter...]`` to average them in place across data-parallel
        ranks, so every rank applies the same update (docs/design/distributed.md).

    References: Shen et al., "Variational Learning is Effective for Large Deep Networks",
    ICML 2024.
    """

    def __init__(
        self,
        model: Callable,
        *,
        dataset_size: int,
        lr: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.99999),
        hess_init: float = 0.1,
        ess: float | None = None,
        prior_precision: float | None = None,
        num_particles: int = 1,
        reduce_fn: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        check_arguments(  # VOGN's checks; IVON has no temperature, augmentation or damping
            model,
            dataset_size=dataset_size,
            lr=lr,
            betas=betas,
            prior_precision=prior_precision,
            temperature=1.0,
            num_particles=num_particles,
            augmentation_factor=1.0,
            damping=0.0,
            chunk_size=None,
            reduce_fn=reduce_fn,
        )
        check_positive("hess_init", hess_init, fix="Pass h0 > 0, e.g. hess_init=0.1.")
        if ess is not None:
            check_positive("ess", ess, fix="Pass λ > 0, or leave it out to use dataset_size.")
        self.model = model
        self.dataset_size = dataset_size
        self.hess_init = float(hess_init)
        self.effective_size = float(dataset_size if ess is None else ess)
        self.prior_precision = None if prior_precision is None else float(prior_precision)
        self.num_particles = num_particles
        self.reduce_fn = reduce_fn
        self.guide = VOGNGuide(model)
        #: The ``torch.optim.Optimizer`` to hand to ``torch.optim.lr_scheduler`` classes.
        self.optimizer = VOGNOptimizer(lr, (float(betas[0]), float(betas[1])))
        #: Everything the update changes (``momentum`` is g, ``curvature`` h); ``None`` before
        #: IVON has seen the model.
        self.state: VOGNState | None = None
        self.layout: SiteLayout | None = None
        self.prior: VOGNPrior | None = None
        self._hidden: list[Hidden] = []
        self._pending: dict | None = None
        self._var_sums = (0.0, 0.0)

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def step_count(self) -> int:
        return 0 if self.state is None else self.state.step

    @property
    def needs_setup(self) -> bool:
        """Whether IVON has yet to see the model (its first :meth:`step` or :meth:`setup`)."""
        return self.state is None

    def _hyperparameters(self, prior: VOGNPrior) -> IVONHyperparameters:
        ess = self.effective_size
        return IVONHyperparameters(
            lr=self.optimizer.lr,
            betas=self.optimizer.betas,
            weight_decay=prior.tilde(1.0, ess),
            prior_mean=prior.mean,
            hidden_weight_decay=prior.mean_precision / ess,
        )

    # -- set-up --------------------------------------------------------------------------------

    def setup(self, *args, **kwargs) -> None:
        """Read the model on a minibatch and initialise the state (m at the network's weights,
        g = 0, h = h₀) as the first :meth:`step` does, leaving BatchNorm's running statistics as
        they were. Does nothing once IVON has seen the model; a refusal changes nothing."""
        self._setup(args, kwargs, where="IVON.setup")

    def _setup(self, args, kwargs, *, where: str):
        """Set IVON up unless it is already; returns what undoes the set-up (or ``None``)."""
        if self.state is not None:
            return None
        pending = self._pending
        ready = prepare(
            self.model,
            args,
            kwargs,
            dataset_size=self.dataset_size,
            prior_precision=self.prior_precision,
            chunk_size=None,
            check=None
            if pending is None
            else lambda lay, hid: check_state_dict(pending, lay, hid, method=_METHOD),
        )
        ready.tape.clear()  # IVON takes no per-example gradients: free the recorded activations
        ready.restore_statistics()  # a reading pass, not a training one

        def undo() -> None:
            ready.undo()
            self._uninstall(pending)

        try:
            self._install(ready)
            if pending is not None:
                self._pending = None
                self.load_state_dict(pending)
        except BaseException as err:
            refused(err, where)
            undo()
            raise
        return undo

    def _install(self, ready: Prepared) -> None:
        self.layout, self._hidden, self.prior = ready.layout, ready.hidden, ready.prior
        state = ready.initial_state()
        state.curvature.fill_(self.hess_init)
        for h in state.hidden_curvature:
            h.fill_(self.hess_init)
        self.state = state
        self.guide.attach(ready.layout, state.mean, torch.empty_like(state.mean))
        self._passes = IVONPasses(
            self.model, ready.layout, ready.hidden, state.mean, self.guide.scale
        )
        self._passes.rollback = Rollback(ready.statistics.written())
        self._refresh_scale()

    def _uninstall(self, pending: dict | None) -> None:
        self.state, self.layout, self.prior, self._hidden = None, None, None, []
        self._pending = pending
        self._var_sums = (0.0, 0.0)
        self.guide.detach()

    @torch.no_grad()
    def _refresh_scale(self) -> None:
        """σ = 1/√(λ(h + δ)) into the guide, and the KL's sums over σ."""
        assert self.state is not None and self.prior is not None
        scale, h, ess = self.guide.scale, self.state.curvature, self.effective_size
        decay = self.prior.tilde(1.0, ess)
        log_scale = self._passes.noise  # ε is spent once θ is drawn
        for block in blocks(h.numel()):  # in cache: one pass over memory instead of four
            d = decay[block] if isinstance(decay, torch.Tensor) else decay
            ivon_scale(h[block], effective_size=ess, weight_decay=d, out=scale[block])
            torch.log(scale[block], out=log_scale[block])
        self._var_sums = self.prior.variance_sums(scale, log_scale)

    # -- the public step -----------------------------------------------------------------------

    def step(self, *args, **kwargs) -> float:
        """One IVON update on a minibatch; returns the estimated negative ELBO,
        N/B Σᵢ ℓᵢ averaged over the particles plus KL(q ‖ prior), like ``SVI.step``.

        A refused step (bad data or hyperparameters, a non-finite loss or gradient, an error from
        the model or ``reduce_fn``) changes nothing: IVON's state, BatchNorm's running statistics
        and torch's random state stay as they were."""
        step = self.step_count + 1
        check_hyperparameters(self.optimizer, step, method=_METHOD)
        undo_setup = self._setup(args, kwargs, where=f"IVON step {step}")
        assert self.state is not None and self.prior is not None
        rollback = self._passes.rollback
        rollback.save()
        try:
            loss = self._estimate(args, kwargs, step)
        except BaseException as err:
            refused(err, f"IVON step {step}")
            rollback.restore()
            if undo_setup is not None:
                undo_setup()
            raise
        g_hat, (h_hat,) = self._passes.split()
        self.state = ivon_update(self.state, g_hat, h_hat, self._hyperparameters(self.prior))
        self.optimizer.step()  # marks the step for the learning-rate schedulers
        self._refresh_scale()
        return loss

    def _estimate(self, args, kwargs, step: int) -> float:
        passes = self._passes
        nlls, batch = passes.estimate(args, kwargs, num_particles=self.num_particles, step=step)
        nll_total = sum(nll * self.dataset_size / batch for nll in nlls) / self.num_particles
        if self.reduce_fn is not None:
            self.reduce_fn(passes.estimates)
        passes.check_finite(step)
        kl = self._kl()
        check_loss(step, nll_total, kl, method=_METHOD)
        return nll_total + kl

    @torch.no_grad()
    def evaluate_loss(self, *args, **kwargs) -> float:
        """The loss :meth:`step` would report, at the current q, without updating anything."""
        if self.state is None:
            raise RuntimeError("IVON has not seen the model yet; call ivon.step(x, y) first.")
        step, particles = self.step_count + 1, self.num_particles
        nll = self._passes.mean_nll(args, kwargs, num_particles=particles, step=step)
        return nll * self.dataset_size + self._kl()

    def _kl(self) -> float:
        assert self.state is not None and self.prior is not None
        return self.prior.kl(self.state.mean, self._var_sums)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything IVON updates: m, g, h, the hidden parameters and their g and h, the step
        counter and the scheduled hyperparameters (σ follows from h)."""
        if self.state is None or self.layout is None:
            raise RuntimeError("IVON has no state before its first step; call ivon.step(x, y).")
        return pack_state_dict(
            self.state,
            self.layout,
            self._hidden,
            temperature=None,
            optimizer=self.optimizer.state_dict(),
            method=_METHOD,
        )

    def check_state_dict(self, state: Any) -> None:
        """Refuse (``ValueError``) a state that :meth:`load_state_dict` would not restore."""
        hidden = self._hidden if self.layout is not None else None
        check_state_dict(state, self.layout, hidden, method=_METHOD)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (nothing changes if it is refused); before
        IVON has seen the model it is applied at the first :meth:`step` (or :meth:`setup`)."""
        self.check_state_dict(state)
        if self.state is None:
            self._pending = dict(state)
            return
        unpack_state_dict(state, self.state, self._hidden)
        self.optimizer.load_state_dict(state["optimizer"])
        self._refresh_scale()
