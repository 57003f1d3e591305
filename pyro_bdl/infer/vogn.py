r"""VOGN: Variational Online Gauss-Newton, natural-gradient VI that trains like Adam.

VOGN fits a diagonal Gaussian :math:`q = \mathcal N(\mu, \operatorname{diag}\sigma^2)` over a lifted
network's weights, under the Gaussian prior
:math:`\mathcal N(\mu_0, \operatorname{diag}\delta^{-1})` declared in
:func:`~pyro_bdl.bayesianize`, with the update

.. math::

    m &\leftarrow \beta_1 m + \hat g + \tilde\delta(\mu - \mu_0), \qquad
    s \leftarrow (1-\beta_2) s + \beta_2 \hat h, \qquad
    \mu \leftarrow \mu - \alpha\, m / (s + \tilde\delta), \\
    \sigma &= \sqrt{\tau / (\tilde N (s + \tilde\delta))}, \qquad
    \tilde\delta = \tau\delta/\tilde N, \qquad \tilde N = \rho N,

where :math:`\hat g` averages the per-example gradients of the negative log-likelihood at a
weight sample :math:`w \sim q` and :math:`\hat h` averages their **squares** (the Gauss-Newton /
empirical-Fisher diagonal, from :class:`~pyro_bdl.curvature.PerExampleGradients`). Note the
convention (docs/design/vogn.md): :math:`\beta_2` weights the *new* estimate :math:`\hat h`.

The state is one :class:`~pyro_bdl.infer.vogn_update.VOGNState`, changed only by the pure
:func:`~pyro_bdl.infer.vogn_update.vogn_update`. VOGN samples the weights before the forward pass
and needs per-example losses, so it is its own object with an ``SVI``-shaped :meth:`VOGN.step`,
not a ``pyro.optim`` wrapper; its posterior is an ordinary Pyro guide, :attr:`VOGN.guide`.

References:

- Khan, Nielsen, Tangkaratt, Lin, Gal, Srivastava, "Fast and Scalable Bayesian Deep Learning by
  Weight-Perturbation in Adam", ICML 2018.
- Osawa, Swaroop, Jain, Eschenhagen, Turner, Yokota, Khan, "Practical Deep Learning with Bayesian
  Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pyro_bdl._validation import check_positive
from pyro_bdl.infer.rollback import Rollback, refused
from pyro_bdl.infer.vogn_checks import (
    check_arguments,
    check_hyperparameters,
    check_loss,
    read_temperature,
)
from pyro_bdl.infer.vogn_guide import VOGNGuide
from pyro_bdl.infer.vogn_model import Hidden, per_example_nll
from pyro_bdl.infer.vogn_passes import Passes
from pyro_bdl.infer.vogn_prior import VOGNPrior
from pyro_bdl.infer.vogn_setup import Prepared, prepare
from pyro_bdl.infer.vogn_state_dict import check_state_dict, pack_state_dict, unpack_state_dict
from pyro_bdl.infer.vogn_update import (
    VOGNHyperparameters,
    VOGNOptimizer,
    VOGNState,
    vogn_scale,
    vogn_update,
)
from pyro_bdl.layout import SiteLayout

__all__ = ["VOGN", "VOGNGuide", "VOGNOptimizer", "VOGNState", "vogn_scale", "vogn_update"]


class VOGN:
    r"""Natural-gradient variational inference over a lifted network, shaped like ``SVI``.

    Each :meth:`step` draws ``num_particles`` weight samples from N(μ, σ²), runs the model
    conditioned on them, reads the per-example negative log-likelihoods of the observed sites
    inside ``pyro.plate("data", N, subsample_size=B)`` (without the plate's N/B scaling; any other
    ``poutine.scale`` is kept), forms ĝ and ĥ with hooks, and applies
    :func:`~pyro_bdl.infer.vogn_update.vogn_update`.

    The first step (or :meth:`setup`) reads the model's structure (its weight sites, observed
    sites and layers, checked there) and its prior, and initialises s from the first minibatch at
    w = μ; later steps write the weight sample straight onto the lifted layers and record only the
    observations (see :mod:`pyro_bdl.infer.vogn_model`), so the model must have the same sample
    sites at every step; a latent site that appears later is refused.

    **Prior.** By default the Gaussian prior declared in :func:`~pyro_bdl.bayesianize` (per-weight
    mean μ₀ and precision δ); a non-Gaussian one raises
    :class:`~pyro_bdl.priors.NonGaussianPriorError` at the first step, before anything changes.
    ``prior_precision=δ`` replaces it by N(0, δ⁻¹ I).

    **Hidden parameters** (the ``pyro.param`` sites of the network, BatchNorm's affine parameters
    by default) are point estimates: they are used as they are (no noise) and updated with the
    same preconditioned momentum step but without the prior term (δ̃, from the mean prior
    precision, only damps their step). BatchNorm running statistics are updated by every forward
    pass, as in training with Adam, and put back if the step is refused (see :meth:`step`).

    Learning-rate schedulers: pass :attr:`optimizer` (a ``torch.optim.Optimizer`` holding ``lr``
    and ``betas``) to any ``torch.optim.lr_scheduler``. Temperature: a number, or a callable
    ``step -> τ`` (step counts from 1), or set :attr:`temperature` between steps.

    Usage::

        vogn = bdl.infer.VOGN(model, dataset_size=N, lr=1e-3)
        for x, y in loader:
            loss = vogn.step(x, y)
        probs = Predictive(model, guide=vogn.guide, num_samples=32)(x_test)

    :param callable model: a Pyro model over a :func:`~pyro_bdl.bayesianize` -d network whose only
        latent sites are its weights and whose observations lie in the data plate.
    :param int dataset_size: N, the number of training examples (must equal the data plate's size).
    :param float lr: learning rate α (> 0).
    :param tuple betas: (β₁, β₂), momentum and curvature averaging rates, each in [0, 1).
    :param float prior_precision: δ (> 0) of an N(0, δ⁻¹ I) prior instead of the lifted one.
    :param temperature: τ (> 0; τ = 1 is standard Bayes), or a callable ``step -> τ``.
    :param int num_particles: K, weight samples per step.
    :param float augmentation_factor: ρ (> 0); effective dataset size Ñ = ρN.
    :param float damping: γ ≥ 0 added to the mean step's denominator (not to the precision).
    :param int chunk_size: examples per chunk of the per-example gradients (default automatic).
    :param callable reduce_fn: optional ``reduce_fn(tensors)`` called once per step on the list
        ``[ĝ, ĥ, ĝ and ĥ of each hidden parameter...]``, to average them in place across
        data-parallel ranks (``dist.all_reduce`` then division by the world size), so every rank
        applies the same update (docs/design/distributed.md). The first step calls it once more,
        before drawing the weights, on the initial s of μ and of each hidden parameter, so every
        rank draws with the σ one process would use on the concatenated batch.

    References: Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019.
    """

    def __init__(
        self,
        model: Callable,
        *,
        dataset_size: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        prior_precision: float | None = None,
        temperature: float | Callable[[int], float] = 1.0,
        num_particles: int = 1,
        augmentation_factor: float = 1.0,
        damping: float = 0.0,
        chunk_size: int | None = None,
        reduce_fn: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        check_arguments(
            model,
            dataset_size=dataset_size,
            lr=lr,
            betas=betas,
            prior_precision=prior_precision,
            temperature=temperature,
            num_particles=num_particles,
            augmentation_factor=augmentation_factor,
            damping=damping,
            chunk_size=chunk_size,
            reduce_fn=reduce_fn,
        )
        self.model, self.dataset_size = model, dataset_size
        self.num_particles, self.chunk_size = num_particles, chunk_size
        self.reduce_fn = reduce_fn
        self._unreduced: list[torch.Tensor] = []  # s₀ until the first step averages it
        self.prior_precision = None if prior_precision is None else float(prior_precision)
        self.effective_size = float(augmentation_factor) * dataset_size
        self.damping = float(damping)
        self._schedule = temperature if callable(temperature) else None
        self._temperature = 1.0 if callable(temperature) else float(temperature)
        self.guide = VOGNGuide(model)
        #: The ``torch.optim.Optimizer`` to hand to ``torch.optim.lr_scheduler`` classes.
        self.optimizer = VOGNOptimizer(lr, (float(betas[0]), float(betas[1])))
        #: Everything the update changes; ``None`` until VOGN has seen the model.
        self.state: VOGNState | None = None
        self.layout: SiteLayout | None = None
        self.prior: VOGNPrior | None = None
        self._hidden: list[Hidden] = []
        self._pending: dict | None = None
        self._scale_temperature: float | None = None
        self._var_sums = (0.0, 0.0)

    # -- hyperparameters ---------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        check_positive("temperature", value, fix="Pass τ > 0 (τ = 1 is standard Bayes).")
        self._schedule = None
        self._temperature = float(value)

    @property
    def step_count(self) -> int:
        return 0 if self.state is None else self.state.step

    def _hyperparameters(self, prior: VOGNPrior) -> VOGNHyperparameters:
        tau, n_tilde = self._temperature, self.effective_size
        return VOGNHyperparameters(
            lr=self.optimizer.lr,
            betas=self.optimizer.betas,
            prior_precision_tilde=prior.tilde(tau, n_tilde),
            prior_mean=prior.mean,
            hidden_precision_tilde=tau * prior.mean_precision / n_tilde,
            damping=self.damping,
        )

    # -- set-up --------------------------------------------------------------------------------

    @property
    def needs_setup(self) -> bool:
        """Whether VOGN has yet to see the model (its first :meth:`step` or :meth:`setup`)."""
        return self.state is None

    def setup(self, *args, **kwargs) -> None:
        """Read the model on a minibatch and initialise the state, as the first :meth:`step` does
        before its update (s starts at ĥ of this minibatch at w = μ, Algorithm 1 line 1), but
        leaving BatchNorm's running statistics as they were. Does nothing once VOGN has seen the
        model. A checkpoint loader calls it before checking and restoring a state. A refusal
        leaves VOGN unset and the network as it was."""
        self._setup(args, kwargs, keep_statistics=False)

    def _setup(self, args, kwargs, *, keep_statistics: bool, where: str = "VOGN.setup"):
        """Set VOGN up on this minibatch unless it is already; returns what undoes the set-up
        (``None`` if there was nothing to do)."""
        if self.state is not None:
            return None
        pending = self._pending
        ready = prepare(
            self.model,
            args,
            kwargs,
            dataset_size=self.dataset_size,
            prior_precision=self.prior_precision,
            chunk_size=self.chunk_size,
            check=None if pending is None else lambda lay, hid: check_state_dict(pending, lay, hid),
        )

        def undo() -> None:
            ready.undo()
            self._uninstall(pending)

        try:
            self._install(ready)
            if pending is not None:
                self._pending = None
                self.load_state_dict(pending)
            else:
                losses, batch, _ = per_example_nll(ready.observed, 1)
                self._passes.gradients(ready.tape, losses, add=False)
                self._passes.check_finite(1)
                _, h = self._passes.split()
                assert self.state is not None
                self.state.curvature = h[0] / batch
                self.state.hidden_curvature = [t / batch for t in h[1:]]
                if self.reduce_fn is not None:  # averaged across ranks by the first step
                    self._unreduced = [self.state.curvature, *self.state.hidden_curvature]
                self._refresh_scale(self._temperature)
        except BaseException as err:
            refused(err, where)
            undo()
            raise
        if not keep_statistics:
            ready.restore_statistics()
        return undo

    def _install(self, ready: Prepared) -> None:
        """Own the state of a freshly read model; allocate the buffers every pass reuses."""
        layout, hidden = ready.layout, ready.hidden
        self.layout, self._hidden, self.prior = layout, hidden, ready.prior
        self.state = ready.initial_state()
        mean = self.state.mean
        self.guide.attach(layout, mean, torch.zeros_like(mean))
        layers, scale = list(ready.tape.calls), self.guide.scale
        self._passes = Passes(self.model, layout, hidden, mean, scale, layers, self.chunk_size)
        # The buffers a pass may change (BatchNorm's running statistics), saved before each step.
        self._passes.rollback = Rollback(ready.statistics.written())

    def _uninstall(self, pending: dict | None) -> None:
        """Back to a VOGN that has not seen the model (a refused first step)."""
        self.state, self.layout, self.prior, self._hidden = None, None, None, []
        self._pending = pending
        self._scale_temperature, self._var_sums = None, (0.0, 0.0)
        self.guide.detach()

    @torch.no_grad()
    def _refresh_scale(self, tau: float) -> None:
        assert self.state is not None and self.prior is not None
        self._scale_temperature = tau
        scale = self.guide.scale
        vogn_scale(
            self.state.curvature,
            temperature=tau,
            effective_size=self.effective_size,
            prior_precision_tilde=self.prior.tilde(tau, self.effective_size),
            out=scale,
        )
        # KL's Σσ² and Σ log σ², kept for the loss of the next steps (only the μ terms change).
        log_scale = torch.log(scale, out=self._passes.noise)  # ε is spent once w is drawn
        self._var_sums = self.prior.variance_sums(scale, log_scale)

    # -- the public step -----------------------------------------------------------------------

    def step(self, *args, **kwargs) -> float:
        """One VOGN update on a minibatch; returns the estimated (tempered) negative ELBO,
        N/B Σᵢ ℓᵢ averaged over the particles plus τ·KL(q ‖ prior), like ``SVI.step``.

        A refused step (bad data or hyperparameters, a non-finite loss or gradient, an error from
        the model or ``reduce_fn``) changes nothing: VOGN's state, τ, BatchNorm's running
        statistics and torch's random state stay as they were, so a retry with good data
        continues the run as if the bad batch had not come."""
        step = self.step_count + 1
        check_hyperparameters(self.optimizer, step)
        tau = self._temperature
        if self._schedule is not None:
            tau = read_temperature(self._schedule(step), step)
        undo_setup = self._setup(args, kwargs, keep_statistics=True, where=f"VOGN step {step}")
        assert self.state is not None and self.prior is not None
        rollback, scale_tau = self._passes.rollback, self._scale_temperature
        rollback.save()
        try:
            loss = self._estimate(args, kwargs, step, tau)
        except BaseException as err:
            refused(err, f"VOGN step {step}")
            rollback.restore()
            if scale_tau is not None and self._scale_temperature != scale_tau:
                self._refresh_scale(scale_tau)  # σ back to what it was, bit for bit
            if undo_setup is not None:
                undo_setup()
            raise
        self._temperature = tau
        hyper = self._hyperparameters(self.prior)
        self.state = vogn_update(self.state, *self._passes.split(), hyper)
        self.optimizer.step()  # marks the step for the learning-rate schedulers
        self._refresh_scale(tau)
        return loss

    def _estimate(self, args, kwargs, step: int, tau: float) -> float:
        """ĝ, ĥ into the pass buffers and the loss, with every check; changes only what
        :meth:`step` rolls back on a refusal (σ, the buffers of the layers, the random state)."""
        if self._unreduced and self.reduce_fn is not None:  # the first draw's σ: from the
            self.reduce_fn(self._unreduced)  # ranks' mean s₀, as in one process
            self._unreduced, self._scale_temperature = [], None
        if self._scale_temperature != tau:  # τ or s₀ changed since σ was last computed
            self._refresh_scale(tau)
        passes = self._passes
        nlls, batch = passes.estimate(args, kwargs, num_particles=self.num_particles, step=step)
        nll_total = sum(nll * self.dataset_size / batch for nll in nlls) / self.num_particles
        if self.reduce_fn is not None:
            self.reduce_fn(passes.estimates)
        passes.check_finite(step)
        kl = self._kl()
        check_loss(step, nll_total, kl)
        return nll_total + tau * kl

    @torch.no_grad()
    def evaluate_loss(self, *args, **kwargs) -> float:
        """The loss :meth:`step` would report, at the current q, without updating anything (like
        ``SVI.evaluate_loss``; put BatchNorm in eval mode first to keep its statistics)."""
        if self.state is None:
            raise RuntimeError("VOGN has not seen the model yet; call vogn.step(x, y) first.")
        step, particles = self.step_count + 1, self.num_particles
        nll = self._passes.mean_nll(args, kwargs, num_particles=particles, step=step)
        return nll * self.dataset_size + self._temperature * self._kl()

    def _kl(self) -> float:
        """KL(q ‖ prior) in closed form."""
        assert self.state is not None and self.prior is not None
        return self.prior.kl(self.state.mean, self._var_sums)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything VOGN updates: μ, m, s, the hidden parameters and their moments, the step
        counter, τ and the scheduled hyperparameters (BatchNorm running statistics stay in
        ``net.state_dict()``; σ follows from s)."""
        if self.state is None or self.layout is None:
            raise RuntimeError("VOGN has no state before its first step; call vogn.step(x, y).")
        return pack_state_dict(
            self.state,
            self.layout,
            self._hidden,
            temperature=self._temperature,
            optimizer=self.optimizer.state_dict(),
        )

    def check_state_dict(self, state: Any) -> None:
        """Refuse (``ValueError``) a state that :meth:`load_state_dict` would not restore: not a
        VOGN state, an earlier format, or (once VOGN has seen the model) another model's."""
        check_state_dict(state, self.layout, self._hidden if self.layout is not None else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (nothing changes if it is refused); before
        VOGN has seen the model it is applied then (and checked against the model there), and the
        first :meth:`step` skips the initialisation of s."""
        self.check_state_dict(state)
        if self.state is None:
            self._pending = dict(state)
            return
        unpack_state_dict(state, self.state, self._hidden)
        self.optimizer.load_state_dict(state["optimizer"])
        self._temperature = float(state["temperature"])
        self._refresh_scale(self._temperature)
