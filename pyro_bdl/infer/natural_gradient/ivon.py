r"""IVON: Improved Variational Online Newton, natural-gradient VI at the cost of one backward pass.

IVON fits a diagonal Gaussian :math:`q = \mathcal N(m, \operatorname{diag}\sigma^2)` over a lifted
network's weights, under the Gaussian prior :math:`\mathcal N(\mu_0, \operatorname{diag}
(\lambda\delta)^{-1})` declared in :func:`~pyro_bdl.bayesianize` (prior precision
:math:`\lambda\delta`, :math:`\lambda` the effective sample size). Unlike VOGN it needs no
per-example gradients: for a draw :math:`\theta = m + \sigma\varepsilon` the minibatch-mean
gradient :math:`\hat g` gives, by Price's (Bonnet's) theorem, the diagonal Hessian estimate
:math:`\hat h = \hat g \cdot (\theta - m)/\sigma^2 = \hat g\,\varepsilon/\sigma`, whose expectation
under q is :math:`\mathbb E_q[\operatorname{diag} \nabla^2 \ell]` (docs/design/ivon.md).

IVON keeps the driver's state: the mean :math:`m` (``state.mean``), the gradient average
:math:`g` (``state.momentum``) and the curvature :math:`h` (``state.curvature``). With
:math:`\delta` the weight decay (the prior precision divided by :math:`\lambda`, elementwise when
it differs between weights), :math:`\mu_0` the prior mean and :math:`t` the step number:

.. math::

    g &\leftarrow \beta_1 g + (1-\beta_1)\hat g, \\
    h &\leftarrow \beta_2 h + (1-\beta_2)\hat h
        + \tfrac12 (1-\beta_2)^2 \frac{(h-\hat h)^2}{h+\delta}, \\
    m &\leftarrow m - \alpha\,\frac{g/(1-\beta_1^t) + \delta (m-\mu_0)}{h+\delta}, \qquad
    \sigma = \frac{1}{\sqrt{\lambda (h+\delta)}}.

The correction term keeps :math:`h+\delta` positive whatever :math:`\hat h` is: with
:math:`a = h+\delta` and :math:`x = (h-\hat h)/a` the new :math:`h+\delta` is
:math:`a\,(\tfrac12(1-(1-\beta_2)x)^2 + \tfrac12) \ge a/2`.

Hidden (point-estimate) parameters have no noise, so no :math:`\hat h`: their :math:`h` stays at
its initial value :math:`h_0` and they take the same debiased step without the prior term,
damped by the mean weight decay.

This module holds only IVON's mathematics; the set-up, the step template, refusals and rollback,
the prior, the state and its state_dict are the natural-gradient driver's
(:mod:`pyro_bdl.infer.natural_gradient.driver`).

References:

- Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan, Möllenhoff,
  "Variational Learning is Effective for Large Deep Networks", ICML 2024 (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pyro_bdl.infer.natural_gradient.checks import check_range
from pyro_bdl.infer.natural_gradient.driver import NaturalGradientVI
from pyro_bdl.infer.natural_gradient.model import Prepared
from pyro_bdl.infer.natural_gradient.state import NaturalGradientState, StateFormat

__all__ = ["IVON", "IVONHyperparameters", "ivon_scale", "ivon_update"]


class IVON(NaturalGradientVI):
    r"""IVON over a lifted network, shaped like ``SVI`` and :class:`~pyro_bdl.infer.VOGN`.

    Each :meth:`step` draws ``num_particles`` weight samples θ = m + σε, runs the model
    conditioned on each, reads the per-example negative log-likelihoods inside
    ``pyro.plate("data", N, subsample_size=B)`` (without the plate's N/B scaling), takes ĝ, their
    batch mean's gradient at θ, by one backward pass, forms ĥ = ĝ ε/σ, and applies
    :func:`ivon_update`.

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
    :param float clip_radius: r (> 0, ``inf`` for none): each weight's preconditioned step
        (g/(1 − β₁ᵗ) + δ(m − μ₀))/(h + δ) is clipped to [−r, r] before it is scaled by α, so no
        weight moves by more than α·r per step (hidden parameters too). While h is still near
        h₀ the step is large wherever the gradient is; a small r (IVON-LoRA: 10⁻³) makes the
        first steps sign-like instead. The default keeps Algorithm 1 unchanged.
    :param grad_scaler: a ``torch.amp.GradScaler`` when training under float16 autocast: the
        loss is scaled by its S before the backward pass and ĝ, ĥ divided by it after; a step
        whose scaled gradients overflow is skipped (nothing changes; :attr:`skipped_steps` counts
        it) and S backs off and grows as the scaler says (docs/methods/precision.md).

    References: Shen et al., "Variational Learning is Effective for Large Deep Networks",
    ICML 2024.
    """

    name = "IVON"
    state_format = StateFormat(
        method="IVON", name="pyro_bdl.infer.IVON", version=1, temperature=False
    )

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
        clip_radius: float = math.inf,
        grad_scaler: torch.amp.GradScaler | None = None,
    ):
        super().__init__(
            model,
            dataset_size=dataset_size,
            lr=lr,
            betas=betas,
            prior_precision=prior_precision,
            num_particles=num_particles,
            chunk_size=None,
            reduce_fn=reduce_fn,
            grad_scaler=grad_scaler,
        )
        self.hess_init = check_range(
            "IVON",
            "hess_init",
            hess_init,
            1e-12,
            1e12,
            "h0 is the initial curvature (σ starts at 1/√(λ(h0 + δ))); pass e.g. 0.1.",
        )
        if ess is not None:
            ess = check_range(
                "IVON",
                "ess",
                ess,
                1e-3,
                1e12,
                "ess (λ) is an effective number of examples: the weight decay δ = precision/λ and "
                "σ = 1/√(λ(h + δ)) leave float precision far outside this range. Pass e.g. the "
                "dataset size, or leave it out to use dataset_size.",
            )
        self.effective_size = float(dataset_size if ess is None else ess)
        if clip_radius != math.inf:
            clip_radius = check_range(
                "IVON",
                "clip_radius",
                clip_radius,
                1e-12,
                1e12,
                "it bounds each weight's step to lr·clip_radius; pass e.g. 1e-3, or leave it "
                "out (inf) for no clipping.",
            )
        self.clip_radius = float(clip_radius)

    def _initial_scale_problem(self) -> str:
        return (
            f"with ess={self.effective_size!r}, hess_init={self.hess_init!r} and "
            f"prior_precision={self.prior_precision!r} (None: the lifted prior)"
        )

    # -- ĝ by one backward pass, ĥ = ĝ ε/σ -------------------------------------------------------

    def _allocate(self) -> None:
        assert self.state is not None and self.layout is not None
        mean = self.state.mean
        g, h = torch.empty_like(mean), torch.empty_like(mean)
        #: [ĝ, ĥ, ĝ of each hidden parameter...], the list ``reduce_fn`` receives (no ĥ for the
        #: noiseless hidden parameters).
        self.estimates = [g, h, *(torch.empty_like(hp.param) for hp in self._hidden)]
        self._product = torch.empty_like(mean)  # a later draw's ĝ
        self._g_views = self.layout.split(g)
        self._spare_views = self.layout.split(self._product)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [self.estimates[0], *self.estimates[2:]], [self.estimates[1]]

    def _initialise(self, ready: Prepared) -> None:
        """h = h₀ everywhere (g = 0, m at the network's weights)."""
        assert self.state is not None
        ready.tape.clear()  # no per-example gradients: free the recorded activations
        self.state.curvature.fill_(self.hess_init)
        for h in self.state.hidden_curvature:
            h.fill_(self.hess_init)
        self._refresh_scale(self._temperature)

    def _estimate_gradients(self, args, kwargs, step: int) -> tuple[list[float], int]:
        g, h, *g_hidden = self.estimates
        scale, noise = self.guide.scale, self._noise
        hidden_params = [hp.param for hp in self._hidden]
        nlls, batch = [], 0
        for k in range(self.num_particles):
            self._sample()
            # Leaves per site (sharing the sample's storage) rather than one flat leaf: autograd
            # then returns one gradient per site, as ``loss.backward()`` would for the plain
            # network, not those and their concatenation as well.
            leaves = [v.detach().requires_grad_() for v in self._weight_views]
            losses, batch, nll = self._run(self._written(leaves), args, kwargs, step)
            # A hidden parameter frozen since set-up has no gradient (and takes no update).
            wrt = [*leaves, *(p for p in hidden_params if p.requires_grad)]
            grads: list[torch.Tensor | None] = [None] * (len(leaves) + len(hidden_params))
            if losses.requires_grad:  # else the likelihood depends on no weight
                root = self._scaled(losses.sum() / batch)
                found = iter(torch.autograd.grad(root, wrt, allow_unused=True))
                grads = [next(found) for _ in leaves]
                grads += [next(found) if p.requires_grad else None for p in hidden_params]
            with torch.no_grad():
                # This draw's ĝ into g (the first draw) or the spare buffer (later draws).
                draw = g if k == 0 else self._product
                views = self._g_views if k == 0 else self._spare_views
                hidden = grads[len(views) :]
                if k == 0:
                    copy_or_zero([*views, *g_hidden], grads)
                else:
                    copy_or_zero(views, grads[: len(views)])
                    targets = [out for out, gr in zip(g_hidden, hidden) if gr is not None]
                    if targets:
                        torch._foreach_add_(targets, [gr for gr in hidden if gr is not None])
                if k > 0:
                    g.add_(draw)
                # ĥ of this draw: ĝ ε/σ.
                if k == 0:
                    torch.mul(draw, noise, out=h).div_(scale)
                else:
                    h.addcdiv_(draw.mul_(noise), scale)
            nlls.append(nll)
        if self.num_particles > 1:
            torch._foreach_div_(self.estimates, float(self.num_particles))
        return nlls, batch

    # -- the update ----------------------------------------------------------------------------

    def _hyperparameters(self) -> IVONHyperparameters:
        assert self.prior is not None
        ess, prior = self.effective_size, self.prior
        return IVONHyperparameters(
            lr=self.optimizer.lr,
            betas=self.optimizer.betas,
            weight_decay=prior.tilde(1.0, ess),
            prior_mean=prior.mean,
            hidden_weight_decay=prior.mean_precision / ess,
            clip_radius=self.clip_radius,
        )

    def _update(
        self,
        state: NaturalGradientState,
        g_hat: list[torch.Tensor],
        h_hat: list[torch.Tensor],
        out: NaturalGradientState,
        tau: float,
    ) -> NaturalGradientState:
        """IVON's update (it has no temperature: ``tau`` is 1)."""
        return ivon_update(state, g_hat, h_hat[0], self._hyperparameters(), out)

    def _write_scale(
        self, curvature: torch.Tensor, tau: float, scale: torch.Tensor, log_scale: torch.Tensor
    ) -> None:
        """σ = 1/√(λ(h + δ)) (IVON has no temperature: ``tau`` is 1)."""
        assert self.prior is not None
        h, ess = curvature, self.effective_size
        decay = self.prior.tilde(1.0, ess)
        for block in blocks(h.numel(), h.device):  # in cache: one pass over memory, not four
            d = decay[block] if isinstance(decay, torch.Tensor) else decay
            ivon_scale(h[block], effective_size=ess, weight_decay=d, out=scale[block])
            torch.log(scale[block], out=log_scale[block])

    @torch.no_grad()
    def _scale_and_sums(
        self, curvature: torch.Tensor, tau: float, scale: torch.Tensor, work: torch.Tensor
    ) -> tuple[float, float]:
        """σ = 1/√x with x = λ(h + δ), Σσ² and Σ log σ² = −Σ log x in one pass over memory,
        block by block in cache. Σ log x is the log of products of 16 values taken in float64
        (16 float32 values multiply to within float64's range unless x > 2⁶⁴, where the exact
        sum of logs is taken instead): one logarithm per 16 weights, the costliest part of the
        pass otherwise (a float64 state, or a per-weight prior, takes the plain passes)."""
        assert self.prior is not None
        decay = self.prior.tilde(1.0, self.effective_size)
        if curvature.dtype != torch.float32 or isinstance(decay, torch.Tensor):
            return super()._scale_and_sums(curvature, tau, scale, work)
        parts = blocks(curvature.numel(), curvature.device)
        sums = torch.empty(2, len(parts), dtype=torch.float64, device=curvature.device)
        for i, block in enumerate(parts):
            x = torch.add(curvature[block], decay, out=work[block]).mul_(self.effective_size)
            sigma = torch.rsqrt(x, out=scale[block])  # the operations of ivon_scale
            sums[0, i] = torch.dot(sigma, sigma)
            sums[1, i] = log_sum(x)
        square, log_x = sums.sum(1).tolist()
        if not math.isfinite(log_x):  # a product overflowed, or some σ is not finite and > 0
            log_x = float(torch.log(work.to(torch.float64)).sum())
        return square, -log_x


@dataclass(frozen=True)
class IVONHyperparameters:
    r"""The numbers one IVON update reads.

    :ivar float lr: α.
    :ivar tuple betas: (β₁, β₂); β₁ averages ĝ, β₂ averages ĥ (both weight the *old* value).
    :ivar weight_decay: δ = prior precision / ess, a number or a ``(D,)`` tensor.
    :ivar prior_mean: μ₀, a ``(D,)`` tensor, or ``None`` for zero.
    :ivar float hidden_weight_decay: the δ that damps the hidden parameters' step.
    :ivar float clip_radius: r, each weight's preconditioned step clipped to [−r, r] before
        the factor α (``inf``: no clipping).
    """

    lr: float
    betas: tuple[float, float]
    weight_decay: float | torch.Tensor
    prior_mean: torch.Tensor | None = None
    hidden_weight_decay: float = 0.0
    clip_radius: float = math.inf

    def __post_init__(self) -> None:
        if not self.clip_radius > 0:  # also NaN
            raise ValueError(
                f"IVONHyperparameters: clip_radius must be > 0 (inf for no clipping); got "
                f"{self.clip_radius!r}. It bounds each weight's step to lr·clip_radius."
            )


@torch.no_grad()
def ivon_update(
    state: NaturalGradientState,
    g_hat: Sequence[torch.Tensor],
    h_hat: torch.Tensor,
    hyper: IVONHyperparameters,
    out: NaturalGradientState | None = None,
) -> NaturalGradientState:
    r"""One IVON update: returns the state after the step.

    ``g_hat`` holds ĝ of the mean first, then of each hidden parameter; ``h_hat`` is ĥ of the
    mean. As in :func:`~pyro_bdl.infer.natural_gradient.vogn.vogn_update`, the new mean,
    momentum and curvature go into the tensors of ``out`` (by default the state's own, **in
    place**), the hidden parameters and their moments are updated in place, and the returned
    state holds them with ``step + 1``; nothing else is read or written.
    """
    params = [state.mean, *state.hidden]
    if len(g_hat) != len(params) or h_hat.shape != state.curvature.shape:
        raise ValueError(
            f"ivon_update needs ĝ for the mean and each of the {len(state.hidden)} hidden "
            f"parameters ({len(params)}) and ĥ of shape {tuple(state.curvature.shape)}; got "
            f"{len(g_hat)} and {tuple(h_hat.shape)}."
        )
    beta1, beta2 = hyper.betas
    t = state.step + 1
    debias, c = 1.0 / (1.0 - beta1**t), 1.0 - beta2
    delta, mu0 = hyper.weight_decay, hyper.prior_mean
    radius = hyper.clip_radius
    clip = radius != math.inf
    into = state if out is None else out
    c_tensor = torch.tensor(c, dtype=state.curvature.dtype, device=state.curvature.device)
    # Block by block, so that the dozen element-wise operations of a block run in cache and
    # their temporaries are small (a D-sized temporary costs more in page faults than the
    # arithmetic); each block is one slice of every vector.
    for block in blocks(state.mean.numel(), state.mean.device):
        m, g, h = state.mean[block], state.momentum[block], state.curvature[block]
        m1, g1, h1 = into.mean[block], into.momentum[block], into.curvature[block]
        gh, hh = g_hat[0][block], h_hat[block]
        d = delta[block] if isinstance(delta, torch.Tensor) else delta
        torch.lerp(g, gh, 1.0 - beta1, out=g1)  # β₁g + (1−β₁)ĝ
        # β₂h + (1−β₂)ĥ + ½(1−β₂)²(h−ĥ)²/(h+δ) = h + r(c + ½c² r/(h+δ)), r = ĥ − h, c = 1 − β₂.
        a = torch.add(h, d)
        r = torch.sub(hh, h)
        factor = torch.addcdiv(c_tensor, r, a, value=0.5 * c * c)  # one pass, not three
        torch.addcmul(h, r, factor, out=h1)
        # m ← m − α (g/(1−β₁ᵗ) + δ(m − μ₀))/(h + δ), with the new g and h; the quotient
        # clipped to [−r, r] first when r is finite.
        offset = m if mu0 is None else torch.sub(m, mu0[block], out=r)
        numerator = torch.mul(offset, d, out=factor).add_(g1, alpha=debias)
        damped = torch.add(h1, d, out=a)  # h + δ
        if clip:
            step = numerator.div_(damped).clamp_(-radius, radius)
            torch.add(m, step, alpha=-hyper.lr, out=m1)
        else:
            torch.addcdiv(m, numerator, damped, value=-hyper.lr, out=m1)
    if state.hidden:
        torch._foreach_lerp_(state.hidden_momentum, list(g_hat[1:]), 1.0 - beta1)
        denominator = torch._foreach_add(state.hidden_curvature, hyper.hidden_weight_decay)
        if clip:
            steps = torch._foreach_div(state.hidden_momentum, denominator)
            torch._foreach_mul_(steps, debias)
            torch._foreach_clamp_min_(steps, -radius)
            torch._foreach_clamp_max_(steps, radius)
            torch._foreach_add_(state.hidden, steps, alpha=-hyper.lr)
        else:
            step_size = -hyper.lr * debias
            torch._foreach_addcdiv_(
                state.hidden, state.hidden_momentum, denominator, value=step_size
            )
    return dataclasses.replace(
        state, mean=into.mean, momentum=into.momentum, curvature=into.curvature, step=t
    )


#: Elements per block of :func:`ivon_update`: 512 KiB of float32 per vector, so that a block's
#: vectors and temporaries stay in cache while the Python overhead per block stays small.
BLOCK = 1 << 17


def copy_or_zero(outs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Each gradient into its output, zeros where there is none: one fused copy, not a copy per
    tensor (on CUDA each would be a launch of its own)."""
    targets = [out for out, grad in zip(outs, grads) if grad is not None]
    if targets:
        torch._foreach_copy_(targets, [grad for grad in grads if grad is not None])
    absent = [out for out, grad in zip(outs, grads) if grad is None]
    if absent:
        torch._foreach_zero_(absent)


def blocks(n: int, device: torch.device | None = None) -> list[slice]:
    """Slices of ``range(n)`` of :data:`BLOCK` elements (the last one shorter) on a CPU, where a
    block's dozen element-wise passes then run in cache; one slice on any other device (a GPU),
    where every pass is a kernel launch and a step is bound by the host's launches: blocks of
    11.2M weights would cost 86 times the launches for no gain in bandwidth."""
    if device is not None and device.type != "cpu":
        return [slice(0, n)]
    return [slice(i, min(i + BLOCK, n)) for i in range(0, n, BLOCK)]


def log_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ log x of a float32 vector in float64, as the logs of products of 16 values."""
    whole = x.numel() - x.numel() % 16
    out = x[:whole].view(-1, 16).prod(1, dtype=torch.float64).log_().sum()
    if whole < x.numel():
        out = out + x[whole:].to(torch.float64).log_().sum()
    return out


@torch.no_grad()
def ivon_scale(
    h: torch.Tensor,
    *,
    effective_size: float,
    weight_decay: float | torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\sigma = 1/\sqrt{\lambda (h + \delta)}`: the posterior precision is
    :math:`\lambda h` plus the prior precision :math:`\lambda\delta`. ``out`` receives it."""
    out = torch.add(h, weight_decay, out=out)
    return out.mul_(effective_size).rsqrt_()
