r"""VOGN: Variational Online Gauss-Newton, natural-gradient VI that trains like Adam.

VOGN fits a diagonal Gaussian :math:`q = \mathcal N(\mu, \operatorname{diag}\sigma^2)` over a lifted
network's weights, under the Gaussian prior
:math:`\mathcal N(\mu_0, \operatorname{diag}\delta^{-1})` declared in
:func:`~pyro_bdl.bayesianize`, with the update

.. math::

    m &\leftarrow \beta_1 m + \hat g + \tilde\delta(\mu - \mu_0), \qquad
    s \leftarrow (1-\beta_2) s + \beta_2 \hat h, \qquad
    \mu \leftarrow \mu - \alpha\, m / (s + \tilde\delta + \gamma), \\
    \sigma &= \sqrt{\tau / (\tilde N (s + \tilde\delta))}, \qquad
    \tilde\delta = \tau\delta/\tilde N, \qquad \tilde N = \rho N,

where :math:`\hat g` averages the per-example gradients of the negative log-likelihood at a
weight sample :math:`w \sim q` and :math:`\hat h` averages their **squares** (the Gauss-Newton /
empirical-Fisher diagonal, from :class:`~pyro_bdl.curvature.PerExampleGradients`); :math:`\delta`
is elementwise when the prior precision differs between weights. Note the convention
(docs/design/vogn.md): :math:`\beta_2` weights the *new* estimate :math:`\hat h`. Hidden
parameters (point estimates) take the same step without the prior term. The first step
initialises :math:`s` with :math:`\hat h` of its minibatch at :math:`w = \mu` (Algorithm 1, line 1).

This module holds only VOGN's mathematics: its hyperparameters, its estimate of ĝ and ĥ, and the
pure update :func:`vogn_update`. The set-up, the step template, refusals and rollback, the prior,
the state and its state_dict are the natural-gradient driver's
(:mod:`pyro_bdl.infer.natural_gradient.driver`).

References:

- Khan, Nielsen, Tangkaratt, Lin, Gal, Srivastava, "Fast and Scalable Bayesian Deep Learning by
  Weight-Perturbation in Adam", ICML 2018.
- Osawa, Swaroop, Jain, Eschenhagen, Turner, Yokota, Khan, "Practical Deep Learning with Bayesian
  Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._validation import check_positive
from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.natural_gradient.checks import as_float, check_range, check_real
from pyro_bdl.infer.natural_gradient.driver import NaturalGradientVI
from pyro_bdl.infer.natural_gradient.model import Prepared, per_example_nll
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState, StateFormat

__all__ = ["VOGN", "VOGNHyperparameters", "vogn_scale", "vogn_update"]


class VOGN(NaturalGradientVI):
    r"""Natural-gradient variational inference over a lifted network, shaped like ``SVI``.

    Each :meth:`step` draws ``num_particles`` weight samples from N(μ, σ²), runs the model
    conditioned on them, reads the per-example negative log-likelihoods of the observed sites
    inside ``pyro.plate("data", N, subsample_size=B)`` (without the plate's N/B scaling; any other
    ``poutine.scale`` is kept), forms ĝ and ĥ with hooks, and applies
    :func:`vogn_update`.

    The first step (or :meth:`setup`) reads the model's structure (its weight sites, observed
    sites and layers, checked there) and its prior, and initialises s from the first minibatch at
    w = μ; later steps write the weight sample straight onto the lifted layers and record only the
    observations (see :mod:`pyro_bdl.infer.natural_gradient.model`), so the model must have the
    same sample sites at every step; a latent site, or a parameter of a layer that the first step
    did not call, that appears later is refused. The weights must be float32 or float64 (the state
    takes their dtype; for bf16 compute, train under ``torch.autocast``).

    **Prior.** By default the Gaussian prior declared in :func:`~pyro_bdl.bayesianize` (per-weight
    mean μ₀ and precision δ); a non-Gaussian one raises
    :class:`~pyro_bdl.priors.NonGaussianPriorError` at the first step, before anything changes.
    ``prior_precision=δ`` replaces it by N(0, δ⁻¹ I).

    **Hidden parameters** (the ``pyro.param`` sites of the network, BatchNorm's affine parameters
    by default) are point estimates: they are used as they are (no noise) and updated with the
    same preconditioned momentum step but without the prior term (δ̃, from the mean prior
    precision, only damps their step); one frozen after the first step (``requires_grad=False``)
    keeps its value and moments, as ``torch.optim`` skips it. BatchNorm running statistics are
    updated by every forward pass, as in training with Adam, and put back if the step is refused
    (see :meth:`step`).

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
    :param tuple betas: (β₁, β₂), momentum and curvature averaging rates, each in [0, 1). β₂
        weights the *new* ĥ (s ← (1 − β₂)s + β₂ĥ), the reverse of Adam's habit: the default
        0.01 averages about 100 steps; Osawa et al.'s tables' 0.999 is our 0.001.
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
    :param grad_scaler: a ``torch.amp.GradScaler`` when training under float16 autocast: the
        loss is scaled by its S before the backward pass and ĝ, ĥ divided by it after; a step
        whose scaled gradients overflow is skipped (nothing changes; :attr:`skipped_steps` counts
        it) and S backs off and grows as the scaler says (docs/methods/precision.md).

    References: Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019.
    """

    name = "VOGN"
    state_format = StateFormat(
        method="VOGN",
        name="pyro_bdl.infer.VOGN",
        version=2,
        temperature=True,
        # The layout VOGN wrote when its state was spread over a guide and an optimizer.
        earlier_keys=frozenset({"step", "sites", "hidden", "guide", "optimizer"}),
        nonnegative_curvature=True,
    )
    reading_pass_trains = True
    curvature_power = 2  # ĥ sums squared per-example gradients: S² under loss scaling

    def __init__(
        self,
        model: Callable,
        *,
        dataset_size: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.01),
        prior_precision: float | None = None,
        temperature: float | Callable[[int], float] = 1.0,
        num_particles: int = 1,
        augmentation_factor: float = 1.0,
        damping: float = 0.0,
        chunk_size: int | None = None,
        reduce_fn: Callable[[list[torch.Tensor]], None] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ):
        super().__init__(
            model,
            dataset_size=dataset_size,
            lr=lr,
            betas=betas,
            prior_precision=prior_precision,
            num_particles=num_particles,
            chunk_size=chunk_size,
            reduce_fn=reduce_fn,
            grad_scaler=grad_scaler,
        )
        if not callable(temperature):
            temperature = check_real("temperature", temperature)
            check_positive("temperature", temperature, fix="Pass τ > 0 (τ = 1 is standard Bayes).")
        check_range(
            "VOGN",
            "augmentation_factor",
            augmentation_factor,
            1e-3,
            1e6,
            "ρ scales the dataset size (Ñ = ρN) for data augmentation; pass e.g. 1.0.",
        )
        if not math.isfinite(check_real("damping", damping)) or damping < 0:
            raise ValueError(
                f"damping must be a finite number >= 0; got {damping!r}. Pass 0.0 (the default) "
                "or a small positive number."
            )
        self.effective_size = float(augmentation_factor) * dataset_size
        self.damping = float(damping)
        self._schedule = temperature if callable(temperature) else None
        self._warned_average = False
        self._temperature = 1.0 if callable(temperature) else float(temperature)

    def _initial_scale_problem(self) -> str:
        if self._scaling is None or not self._scaling.first_overflowed:
            return super()._initial_scale_problem()
        return (
            f"with grad_scaler's scale S = {self._scaling.scaler.get_scale()!r} too large for "
            "the first pass (its float16 gradients overflow at w = μ: lower init_scale, or let "
            "the first step set up, which skips an overflowing step and backs S off),"
        )

    # -- the temperature -----------------------------------------------------------------------

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        check_positive(
            "temperature",
            check_real("temperature", value),
            fix="Pass τ > 0 (τ = 1 is standard Bayes).",
        )
        self._schedule = None
        self._temperature = float(value)

    def _next_temperature(self, step: int) -> float:
        if self._schedule is None:
            return self._temperature
        value = self._schedule(step)
        tau = as_float(value)
        if tau is None or not math.isfinite(tau) or tau <= 0:
            raise ValueError(
                f"VOGN step {step}: the temperature schedule returned {value!r}; it must return "
                "a finite number > 0 (τ = 1 is standard Bayes). Nothing was updated."
            )
        return tau

    # -- ĝ and ĥ: per-example gradients and their squares ---------------------------------------

    def _check_network(self, ready: Prepared) -> None:
        # Layers without a per-example form (recurrent, attention) would get no curvature.
        specs = [site.spec for site in ready.layout if site.spec is not None]
        ready.tape.require_forms([(s.name, s.module) for s in specs], self.name)

    def _allocate(self) -> None:
        assert self.state is not None and self.layout is not None
        mean, hidden = self.state.mean, self._hidden
        g, h = torch.empty_like(mean), torch.empty_like(mean)
        g_hidden = [torch.empty_like(hp.param) for hp in hidden]
        h_hidden = [torch.empty_like(hp.param) for hp in hidden]
        #: [ĝ, ĥ, ĝ of each hidden parameter..., ĥ of each...], the list ``reduce_fn`` receives.
        self.estimates = [g, h, *g_hidden, *h_hidden]
        self._out = {
            (spec.module, spec.param_name): (gs, hs)
            for spec, gs, hs in zip(self._specs, self.layout.split(g), self.layout.split(h))
        }
        for hp, gp, hh in zip(hidden, g_hidden, h_hidden):
            self._out[(hp.module, hp.param_name)] = (gp, hh)
        # The layers to hook: those the first pass called.
        self._tape = PerExampleGradients(layers=self._layers, chunk_size=self.chunk_size)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        k, e = len(self._hidden), self.estimates
        return [e[0], *e[2 : 2 + k]], [e[1], *e[2 + k :]]

    def _initialise(self, ready: Prepared) -> None:
        """s from ĥ of the first minibatch at w = μ (Algorithm 1, line 1). Under loss scaling
        this pass is scaled as every later one (unscaled, its float16 gradients would flush to
        zero where the scaled ones do not); its overflow skips the first step once the ranks
        have averaged s (``LossScaling.check_first``)."""
        assert self.state is not None
        losses, batch, _ = per_example_nll(ready.observed, "VOGN step 1")
        self._gradients(ready.tape, self._scaled(losses), self._out, add=False)
        _, h = self._split()
        if self._scaling is None:
            self._check_finite(1)
        else:
            self._scaling.unscale_first(self.estimates, h)
        self.state.curvature = h[0] / batch
        self.state.hidden_curvature = [t / batch for t in h[1:]]
        if self.reduce_fn is not None:  # averaged across ranks by the first step
            self._unreduced = [self.state.curvature, *self.state.hidden_curvature]
        self._refresh_scale(self._temperature)

    def _estimate_gradients(self, args, kwargs, step: int) -> tuple[list[float], int]:
        nlls, batch = [], 0
        for k in range(self.num_particles):
            self._sample()
            with self._tape:
                losses, batch, nll = self._run(self._values, args, kwargs, step)
            self._gradients(self._tape, self._scaled(losses), self._out, add=k > 0)
            nlls.append(nll)
        torch._foreach_div_(self.estimates, float(self.num_particles * batch))
        self._check_average(batch, step)
        return nlls, batch

    def _check_average(self, batch: int, step: int) -> None:
        """Warn (once) when s averages fewer than two examples' squared gradients: s ← (1 − β₂)s
        + β₂ĥ keeps about B/β₂ examples' worth, and one example's squared gradient is exactly 0
        wherever that example does not reach, where the step α m/(s + δ̃) becomes α m/δ̃."""
        beta2 = self.optimizer.betas[1]
        if self._warned_average or beta2 == 0 or batch / beta2 >= 2:
            return
        self._warned_average = True
        warnings.warn(
            f"VOGN step {step}: batch size {batch} with betas[1] = {beta2}: the curvature "
            f"s ← (1 − β₂)s + β₂ĥ holds about B/β₂ = {batch / beta2:.2g} example(s) of squared "
            "gradients, mostly the last minibatch's. One example's squared gradient is exactly 0 "
            "for every weight it does not reach (a ReLU unit it switches off, a zero input), and "
            "there the step α·m/(s + δ̃) becomes α·m/δ̃ = α·Ñ·m/(τδ), so training diverges. "
            "Average over more examples: a batch size of 16 or more, or a smaller betas[1] "
            "(betas=(0.9, 0.01) averages over about 100 steps).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )

    # -- the update ----------------------------------------------------------------------------

    def _hyperparameters(self, tau: float) -> VOGNHyperparameters:
        """The update's numbers at temperature ``tau``: the step's own τ, which a schedule may
        change from step to step (δ̃ = τδ/Ñ, as in the step's σ and loss)."""
        assert self.prior is not None
        n_tilde, prior = self.effective_size, self.prior
        return VOGNHyperparameters(
            lr=self.optimizer.lr,
            betas=self.optimizer.betas,
            prior_precision_tilde=prior.tilde(tau, n_tilde),
            prior_mean=prior.mean,
            hidden_precision_tilde=tau * prior.mean_precision / n_tilde,
            damping=self.damping,
        )

    def _update(
        self,
        state: NaturalGradientState,
        g_hat: list[torch.Tensor],
        h_hat: list[torch.Tensor],
        out: NaturalGradientState,
        tau: float,
    ) -> NaturalGradientState:
        return vogn_update(state, g_hat, h_hat, self._hyperparameters(tau), out)

    def _write_scale(
        self, curvature: torch.Tensor, tau: float, scale: torch.Tensor, log_scale: torch.Tensor
    ) -> None:
        assert self.prior is not None
        vogn_scale(
            curvature,
            temperature=tau,
            effective_size=self.effective_size,
            prior_precision_tilde=self.prior.tilde(tau, self.effective_size),
            out=scale,
        )
        torch.log(scale, out=log_scale)


@dataclass(frozen=True)
class VOGNHyperparameters:
    r"""The numbers one update reads.

    :ivar float lr: α.
    :ivar tuple betas: (β₁, β₂); β₂ weights the new ĥ.
    :ivar prior_precision_tilde: δ̃ = τδ/Ñ, a number or a ``(D,)`` tensor.
    :ivar prior_mean: μ₀, a ``(D,)`` tensor, or ``None`` for zero.
    :ivar float hidden_precision_tilde: the δ̃ that damps the hidden parameters' step.
    :ivar float damping: γ, added to the denominator of the step only.
    """

    lr: float
    betas: tuple[float, float]
    prior_precision_tilde: float | torch.Tensor
    prior_mean: torch.Tensor | None = None
    hidden_precision_tilde: float = 0.0
    damping: float = 0.0


@torch.no_grad()
def vogn_update(
    state: NaturalGradientState,
    g_hat: Sequence[torch.Tensor],
    h_hat: Sequence[torch.Tensor],
    hyper: VOGNHyperparameters,
    out: NaturalGradientState | None = None,
) -> NaturalGradientState:
    r"""One VOGN update: returns the state after the step.

    ``g_hat`` and ``h_hat`` hold ĝ and ĥ of μ first, then of each hidden parameter. For speed no
    tensor is allocated for the state: the new μ, m and s go into the tensors of ``out`` (by
    default the state's own, **in place**; another state's, so that the caller can check them
    before it keeps them), the hidden parameters and their moments are updated in place
    (``torch._foreach_*`` calls), and the returned state holds these tensors with ``step + 1``;
    the function reads nothing but its arguments and writes nothing but those tensors.
    """
    count = 1 + len(state.hidden)
    if not len(g_hat) == len(h_hat) == count:
        raise ValueError(
            f"vogn_update needs ĝ and ĥ for μ and each of the {len(state.hidden)} hidden "
            f"parameters ({count} each); got {len(g_hat)} and {len(h_hat)}."
        )
    beta1, beta2 = hyper.betas
    d_tilde = hyper.prior_precision_tilde
    into = state if out is None else out
    mean, momentum, curvature = into.mean, into.momentum, into.curvature
    # μ's moments out of place into ``into``; the hidden parameters' (small) in place.
    torch.mul(state.momentum, beta1, out=momentum)
    momentum.add_(g_hat[0])
    if state.hidden:
        torch._foreach_mul_(state.hidden_momentum, beta1)
        torch._foreach_add_(state.hidden_momentum, list(g_hat[1:]))
    # The prior's gradient δ̃(μ − μ₀), on μ only (at the μ before the step).
    offset = state.mean if hyper.prior_mean is None else state.mean - hyper.prior_mean
    if isinstance(d_tilde, torch.Tensor):
        momentum.addcmul_(d_tilde, offset)
    else:
        momentum.add_(offset, alpha=d_tilde)
    torch.mul(state.curvature, 1.0 - beta2, out=curvature)
    curvature.add_(h_hat[0], alpha=beta2)
    if state.hidden:
        torch._foreach_mul_(state.hidden_curvature, 1.0 - beta2)
        torch._foreach_add_(state.hidden_curvature, list(h_hat[1:]), alpha=beta2)
    if isinstance(d_tilde, torch.Tensor) or d_tilde != hyper.hidden_precision_tilde:
        denominator = torch.add(curvature, d_tilde).add_(hyper.damping)
        hidden_denominator = hyper.hidden_precision_tilde + hyper.damping
    else:
        denominator = torch.add(curvature, d_tilde + hyper.damping)
        hidden_denominator = d_tilde + hyper.damping
    torch.addcdiv(state.mean, momentum, denominator, value=-hyper.lr, out=mean)
    if state.hidden:
        hidden_den = torch._foreach_add(state.hidden_curvature, hidden_denominator)
        torch._foreach_addcdiv_(state.hidden, state.hidden_momentum, hidden_den, value=-hyper.lr)
    return dataclasses.replace(
        state, mean=mean, momentum=momentum, curvature=curvature, step=state.step + 1
    )


@torch.no_grad()
def vogn_scale(
    s: torch.Tensor,
    *,
    temperature: float,
    effective_size: float,
    prior_precision_tilde: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\sigma = \sqrt{\tau / (\tilde N (s + \tilde\delta))}`; the posterior precision is
    :math:`\tilde N s/\tau + \delta`. ``out`` receives the result if given."""
    out = torch.add(s, prior_precision_tilde, out=out)
    return out.mul_(effective_size / temperature).sqrt_().reciprocal_()
