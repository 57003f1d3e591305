r"""VOGN: Variational Online Gauss-Newton, natural-gradient VI that trains like Adam.

The algorithm is DESIGN.md 4.5.

VOGN fits a diagonal Gaussian :math:`q = \mathcal N(\mu, \operatorname{diag}\sigma^2)` over a lifted
network's weights with the update

.. math::

    m &\leftarrow \beta_1 m + (\hat g + \tilde\delta\mu), \qquad
    s \leftarrow (1-\beta_2) s + \beta_2 \hat h, \qquad
    \mu \leftarrow \mu - \alpha\, m / (s + \tilde\delta), \\
    \sigma &= \sqrt{\tau / (\tilde N (s + \tilde\delta))}, \qquad
    \tilde\delta = \tau\delta/\tilde N, \qquad \tilde N = \rho N,

where :math:`\hat g` averages the per-example gradients of the negative log-likelihood at a
weight sample :math:`w \sim q` and :math:`\hat h` averages their **squares** (the Gauss-Newton /
empirical-Fisher diagonal, from :class:`~pyro_bdl.curvature.PerExampleGradients`). Note the
convention of DESIGN.md 4.5: :math:`\beta_2` weights the *new* estimate :math:`\hat h`.

Because it samples the weights before the forward pass and needs per-example losses, VOGN is its
own inference object with an ``SVI``-shaped :meth:`VOGN.step`, not a ``pyro.optim`` wrapper. Its
posterior is an ordinary Pyro guide, :attr:`VOGN.guide`.

References:

- Khan, Nielsen, Tangkaratt, Lin, Gal, Srivastava, "Fast and Scalable Bayesian Deep Learning by
  Weight-Perturbation in Adam", ICML 2018.
- Osawa, Swaroop, Jain, Eschenhagen, Turner, Yokota, Khan, "Practical Deep Learning with Bayesian
  Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide.initialization import InitMessenger
from torch import nn

from pyro_bdl._validation import check_positive, check_positive_int, check_probability
from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.vogn_guide import VOGNGuide
from pyro_bdl.infer.vogn_model import (
    Hidden,
    Site,
    inspect_model,
    observed_sites,
    per_example_nll,
    run_substituted,
)
from pyro_bdl.infer.vogn_update import VOGNOptimizer, vogn_scale, vogn_update
from pyro_bdl.nn.lift import init_to_network

__all__ = ["VOGN", "VOGNGuide", "VOGNOptimizer", "vogn_scale", "vogn_update"]


# -- the inference object --------------------------------------------------------------------


class VOGN:
    r"""Natural-gradient variational inference over a lifted network, shaped like ``SVI``.

    Each :meth:`step` draws ``num_particles`` weight samples from N(μ, σ²), runs the model
    conditioned on them, reads the per-example negative log-likelihoods of the observed sites
    inside ``pyro.plate("data", N, subsample_size=B)`` (without the plate's N/B scaling; any other
    ``poutine.scale`` is kept), forms ĝ and ĥ with hooks, and applies the update of DESIGN.md 4.5.
    The first step initialises s from the first minibatch at w = μ (then steps as usual).

    The first step also reads the model's structure (its weight sites, observed sites and
    layers, checked there); later steps write the weight sample straight onto the lifted layers
    and record only the observations (see :mod:`pyro_bdl.infer.vogn_model`), so the model must
    have the same sample sites at every step; a latent site that appears later is refused.

    VOGN's prior is N(0, δ⁻¹ I) on every weight (``prior_precision`` δ); the prior declared in
    :func:`~pyro_bdl.bayesianize` is not read, so declare ``priors.Normal(scale=δ**-0.5)`` there
    to keep ELBO-based diagnostics consistent.

    **Hidden parameters** (the ``pyro.param`` sites of the network, BatchNorm's affine parameters
    by default) are point estimates: they are used as they are (no noise) and updated with the
    same preconditioned momentum step but without the prior term, m ← β₁m + ĝ,
    s ← (1−β₂)s + β₂ĥ, θ ← θ − α m/(s + δ̃ + damping) (δ̃ only damps the step). BatchNorm running
    statistics are updated by every forward pass, as in training with Adam.

    Learning-rate schedulers: pass :attr:`optimizer` (a ``torch.optim.Optimizer``) to any
    ``torch.optim.lr_scheduler``. Temperature: a number, or a callable ``step -> τ`` (step counts
    from 1), or set :attr:`temperature` between steps.

    Usage::

        vogn = bdl.infer.VOGN(model, dataset_size=N, lr=1e-3, prior_precision=1.0)
        for x, y in loader:
            loss = vogn.step(x, y)
        probs = Predictive(model, guide=vogn.guide, num_samples=32)(x_test)

    :param callable model: a Pyro model over a :func:`~pyro_bdl.bayesianize` -d network whose only
        latent sites are its weights and whose observations lie in the data plate.
    :param int dataset_size: N, the number of training examples (must equal the data plate's size).
    :param float lr: learning rate α (> 0).
    :param tuple betas: (β₁, β₂), momentum and curvature averaging rates, each in [0, 1).
    :param float prior_precision: δ (> 0).
    :param temperature: τ (> 0; τ = 1 is standard Bayes), or a callable ``step -> τ``.
    :param int num_particles: K, weight samples per step.
    :param float augmentation_factor: ρ (> 0); the effective dataset size is Ñ = ρN.
    :param float damping: γ ≥ 0 added to the denominator of the mean's step (not to the
        posterior precision).
    :param int chunk_size: examples per chunk of the per-example gradients (default automatic).
    :param callable reduce_fn: optional ``reduce_fn(tensors)`` called once per step on the list
        ``[ĝ, ĥ, ĝ and ĥ of each hidden parameter...]`` before the update, to average them in
        place across data-parallel ranks (for example ``dist.all_reduce`` then division by the
        world size); every rank then applies the same update (DESIGN.md 4.8).

    References:

    - Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019.
    """

    def __init__(
        self,
        model: Callable,
        *,
        dataset_size: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        prior_precision: float = 1.0,
        temperature: float | Callable[[int], float] = 1.0,
        num_particles: int = 1,
        augmentation_factor: float = 1.0,
        damping: float = 0.0,
        chunk_size: int | None = None,
        reduce_fn: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        if not callable(model):
            raise TypeError(f"model must be a callable Pyro model; got {type(model).__name__}.")
        check_positive_int("dataset_size", dataset_size)
        check_positive("lr", lr, fix="Pass a learning rate > 0, for example lr=1e-3.")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2); got {betas!r}.")
        check_probability("betas[0] (beta1)", betas[0], open_interval=False)
        check_probability("betas[1] (beta2)", betas[1], open_interval=False)
        check_positive("prior_precision", prior_precision, fix="Pass δ > 0, e.g. 1.0.")
        if not callable(temperature):
            check_positive("temperature", temperature, fix="Pass τ > 0 (τ = 1 is standard Bayes).")
        check_positive_int("num_particles", num_particles)
        check_positive("augmentation_factor", augmentation_factor, fix="Pass ρ > 0, e.g. 1.0.")
        if isinstance(damping, bool) or not math.isfinite(float(damping)) or damping < 0:
            raise ValueError(f"damping must be a finite number >= 0; got {damping!r}.")
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        self.model = model
        self.dataset_size = dataset_size
        self.num_particles = num_particles
        self.chunk_size = chunk_size
        if reduce_fn is not None and not callable(reduce_fn):
            raise TypeError(f"reduce_fn must be callable or None; got {type(reduce_fn).__name__}.")
        self.reduce_fn = reduce_fn
        self._schedule = temperature if callable(temperature) else None
        self._defaults = {
            "lr": float(lr),
            "betas": (float(betas[0]), float(betas[1])),
            "prior_precision": float(prior_precision),
            "temperature": 1.0 if callable(temperature) else float(temperature),
            "effective_size": float(augmentation_factor) * dataset_size,
            "damping": float(damping),
        }
        self.guide = VOGNGuide(model)
        #: The optimizer to hand to ``torch.optim.lr_scheduler`` classes.
        self.optimizer = VOGNOptimizer(self._defaults)
        self._ready = False
        self.step_count = 0
        self._sites: list[Site] = []
        self._hidden: list[Hidden] = []
        self._estimates: list[torch.Tensor] = []
        self._pending: dict | None = None
        self._scale_key: tuple | None = None
        self._var_sums = (0.0, 0.0)

    # -- hyperparameters ---------------------------------------------------------------------

    def _groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def lr(self) -> float:
        return float(self._groups()[0]["lr"])

    @property
    def temperature(self) -> float:
        return float(self._groups()[0]["temperature"])

    @temperature.setter
    def temperature(self, value: float) -> None:
        check_positive("temperature", value, fix="Pass τ > 0 (τ = 1 is standard Bayes).")
        self._schedule = None
        for group in self._groups():
            group["temperature"] = float(value)

    def _delta_tilde(self) -> float:
        g = self._groups()[0]
        return g["temperature"] * g["prior_precision"] / g["effective_size"]

    # -- set-up --------------------------------------------------------------------------------

    def _trace(self, args, kwargs):
        """Trace the model at the weights' initial values while a tape records every layer."""
        tape = PerExampleGradients(None, chunk_size=self.chunk_size)
        with tape:
            trace = poutine.trace(InitMessenger(init_to_network)(self.model)).get_trace(
                *args, **kwargs
            )
        return trace, tape

    def _setup(self, args, kwargs) -> None:
        snapshots: dict[nn.Module, dict[str, torch.Tensor]] = {}

        def snapshot(module, inputs):
            if module not in snapshots:
                snapshots[module] = {
                    k: b.clone() for k, b in module._buffers.items() if b is not None
                }

        handle = nn.modules.module.register_module_forward_pre_hook(snapshot)
        # The set-up pass leaves the random streams as it found them (a subsampling plate draws
        # indices), so that a run resumed from a state_dict continues bit for bit.
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            trace, tape = self._trace(args, kwargs)
        finally:
            handle.remove()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        try:
            specs, self._sites, self._hidden = inspect_model(trace, tape, self.dataset_size)
        except (ValueError, TypeError):
            with torch.no_grad():  # fail before any state changes: undo BatchNorm statistics
                for module, buffers in snapshots.items():
                    for k, b in buffers.items():
                        module._buffers[k].copy_(b)  # type: ignore[union-attr]
            raise
        loc = torch.cat([spec.init_value.detach().reshape(-1) for _, spec in specs]).clone()
        self.guide._install(trace, [s[:4] for s in self._sites], loc, torch.zeros_like(loc))
        self.optimizer._install(self.guide.loc, [p for _, p, _ in self._hidden])
        self._buffers(tape)
        self._ready = True
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)
            return
        # s starts at ĥ on the first minibatch at w = μ (Algorithm 1, line 1).
        weights = {s[0] for s in self._sites}
        losses, batch, _ = per_example_nll(observed_sites(trace, weights), 1)
        self._gradients(tape, losses, add=False)
        for p, h in zip(self._params(), self._split(self._estimates)[1]):
            self.optimizer.state[p]["m"] = torch.zeros_like(p)
            self.optimizer.state[p]["s"] = h / batch
        self._refresh_scale()

    def _buffers(self, tape: PerExampleGradients) -> None:
        """Allocate, once, the flat weight sample and the flat ĝ, ĥ that the tape writes into."""
        loc = self.guide.loc
        self._noise, self._w = torch.empty_like(loc), torch.empty_like(loc)
        g, h = torch.empty_like(loc), torch.empty_like(loc)
        g_hidden = [torch.empty_like(p) for _, p, _ in self._hidden]
        h_hidden = [torch.empty_like(p) for _, p, _ in self._hidden]
        self._estimates = [g, h, *g_hidden, *h_hidden]
        self._out = {
            key: (g[a:b].view(shape), h[a:b].view(shape)) for _, a, b, shape, key in self._sites
        }
        for (_, _, key), gp, hp in zip(self._hidden, g_hidden, h_hidden):
            self._out[key] = (gp, hp)
        # What each pass writes onto the layers: the weight sample's views, and the hidden
        # parameters themselves (what PyroModule's pyro.param statement would return).
        self._values = [
            (module, pname, self._w[a:b].view(shape))
            for _, a, b, shape, (module, pname) in self._sites
        ]
        self._values += [(module, pname, p) for _, p, (module, pname) in self._hidden]
        # The tape is kept across steps and hooks only the layers the first pass met.
        self._tape = PerExampleGradients(None, chunk_size=self.chunk_size)
        self._tape._layers = list(tape.calls)

    def _split(self, estimates: list[torch.Tensor]) -> tuple[list, list]:
        """[ĝ, ĥ, ĝ of each hidden parameter..., ĥ of each...] -> (ĝs, ĥs), μ's first."""
        k = len(self._hidden)
        return [estimates[0], *estimates[2 : 2 + k]], [estimates[1], *estimates[2 + k :]]

    def _params(self) -> list[torch.Tensor]:
        return [self.guide.loc, *(p for _, p, _ in self._hidden)]

    # -- one pass ------------------------------------------------------------------------------

    def _sample(self) -> torch.Tensor:
        """w = μ + σ ⊙ ε into the flat sample buffer (whose views the layers read)."""
        torch.randn(self._noise.shape, out=self._noise)
        return torch.addcmul(self.guide.loc, self.guide.scale, self._noise, out=self._w)

    def _run(self, args, kwargs) -> tuple[torch.Tensor, int, float]:
        """One conditioned pass at the current sample: the per-example NLL, B and its sum."""
        sites = run_substituted(self.model, self._values, args, kwargs, self.step_count + 1)
        return per_example_nll(sites, self.step_count + 1)

    def _gradients(self, tape: PerExampleGradients, losses: torch.Tensor, add: bool) -> None:
        """Σg and Σg² into the flat estimates (added to them if ``add``)."""
        raw = tape.compute(losses, out=self._out, add=add)
        tape.calls = {}  # free the recorded activations now, not at the next step
        if not add and len(raw) < len(self._out):
            for key, (g, h) in self._out.items():
                if key not in raw:  # a layer the model did not call this time: no gradient
                    g.zero_()
                    h.zero_()

    def _hyper_key(self) -> tuple:
        g = self._groups()[0]
        return (g["temperature"], g["prior_precision"], g["effective_size"])

    @torch.no_grad()
    def _refresh_scale(self) -> None:
        self._scale_key = self._hyper_key()
        s = self.optimizer.state[self.guide.loc]["s"]
        scale = self.guide.scale
        vogn_scale(
            s,
            temperature=self.temperature,
            effective_size=self._groups()[0]["effective_size"],
            prior_precision_tilde=self._delta_tilde(),
            out=scale,
        )
        # KL's Σσ² and Σ log σ², kept for the loss of the next steps (only Σμ² changes).
        log_scale = torch.log(scale, out=self._noise)  # ε is spent once w is drawn
        self._var_sums = (float(torch.dot(scale, scale)), 2.0 * float(log_scale.sum()))

    # -- the public step -----------------------------------------------------------------------

    def step(self, *args, **kwargs) -> float:
        """One VOGN update on a minibatch; returns the estimated (tempered) negative ELBO,
        N/B Σᵢ ℓᵢ averaged over the particles plus τ·KL(q ‖ N(0, δ⁻¹I)), like ``SVI.step``."""
        if not self._ready:
            self._setup(args, kwargs)
        if self._schedule is not None:
            tau = float(self._schedule(self.step_count + 1))
            check_positive("temperature (from the schedule)", tau)
            for group in self.optimizer.param_groups:
                group["temperature"] = tau
        if self._scale_key != self._hyper_key():
            self._refresh_scale()  # τ (or another hyperparameter of σ) changed since the last step
        nll_total, batch = 0.0, 0
        for k in range(self.num_particles):
            self._sample()
            with self._tape:
                losses, batch, nll = self._run(args, kwargs)
            self._gradients(self._tape, losses, add=k > 0)
            nll_total += nll * self.dataset_size / batch
        estimates = self._estimates  # [ĝ, ĥ, ĝ and ĥ of each hidden parameter...]
        torch._foreach_div_(estimates, float(self.num_particles * batch))
        if self.reduce_fn is not None:
            self.reduce_fn(estimates)
        # One reduction per tensor: a sum is finite only if every element is.
        if not bool(torch.isfinite(torch.stack([t.sum() for t in estimates])).all()):
            g_hats, h_hats = self._split(estimates)
            names = ["weights", *(f"{p[0]} (hidden)" for p in self._hidden)]
            labelled = [(f"{n} (ĝ)", t) for n, t in zip(names, g_hats)]
            labelled += [(f"{n} (ĥ)", t) for n, t in zip(names, h_hats)]
            name = next(n for n, t in labelled if not bool(torch.isfinite(t).all()))
            raise ValueError(
                f"VOGN step {self.step_count + 1}: the gradient of the likelihood for {name} "
                "is not finite (NaN or inf); nothing was updated. Lower the learning rate."
            )
        loss = nll_total / self.num_particles + self.temperature * self._kl()
        state = self.optimizer.state
        for p, g, h in zip(self._params(), *self._split(estimates)):
            state[p]["g_hat"] = g
            state[p]["h_hat"] = h
        self.optimizer.step()
        self.step_count += 1
        self._refresh_scale()
        return loss

    @torch.no_grad()
    def evaluate_loss(self, *args, **kwargs) -> float:
        """The loss :meth:`step` would report, at the current q, without updating anything (like
        ``SVI.evaluate_loss``; put BatchNorm in eval mode first to keep its statistics)."""
        if not self._ready:
            raise RuntimeError("VOGN has not seen the model yet; call vogn.step(x, y) first.")
        nll = 0.0
        for _ in range(self.num_particles):
            self._sample()
            _, batch, total = self._run(args, kwargs)
            nll += total * self.dataset_size / batch
        return nll / self.num_particles + self.temperature * self._kl()

    @torch.no_grad()
    def _kl(self) -> float:
        """KL(q ‖ N(0, δ⁻¹ I)) in closed form."""
        # Σσ² and Σ log σ² are kept by _refresh_scale; only Σμ² is new.
        delta = self._groups()[0]["prior_precision"]
        loc = self.guide.loc
        sum_var, sum_log_var = self._var_sums
        dim = loc.numel()
        quad = delta * (sum_var + float(torch.dot(loc, loc)))
        return 0.5 * (quad - dim - dim * math.log(delta) - sum_log_var)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything VOGN updates: μ, σ, the optimizer (m, s, hyperparameters), hidden parameters
        and the step counter (BatchNorm running statistics stay in ``net.state_dict()``)."""
        if not self._ready:
            raise RuntimeError("VOGN has no state before its first step; call vogn.step(x, y).")
        return {
            "step": self.step_count,
            "sites": [(name, tuple(shape)) for name, _, _, shape, _ in self._sites],
            "hidden": {name: p.detach().clone() for name, p, _ in self._hidden},
            "guide": {k: v.clone() for k, v in self.guide.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; before the first step it is applied when the model is
        first seen (the first :meth:`step` then skips the initialisation of s)."""
        keys = {"step", "sites", "hidden", "guide", "optimizer"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(
                f"not a VOGN state_dict: expected keys {sorted(keys)}; got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}."
            )
        if not self._ready:
            self._pending = state
            return
        ours = [(name, tuple(shape)) for name, _, _, shape, _ in self._sites]
        theirs = [(n, tuple(s)) for n, s in state["sites"]]
        hidden = sorted(name for name, _, _ in self._hidden)
        if ours != theirs or sorted(state["hidden"]) != hidden:
            mismatch = sorted(set(ours) ^ set(theirs)) + sorted(set(hidden) ^ set(state["hidden"]))
            raise ValueError(
                f"the state_dict is from a different model: mismatching sites {mismatch}."
            )
        with torch.no_grad():
            self.guide.load_state_dict(state["guide"])
            for name, p, _ in self._hidden:
                p.copy_(state["hidden"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self._scale_key = None  # σ is recomputed from the loaded s before the next draw
