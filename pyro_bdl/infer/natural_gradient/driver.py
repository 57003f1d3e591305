r"""The natural-gradient driver shared by VOGN and IVON: set-up, the step template, refusal and
rollback, the state_dict and ``reduce_fn``. The Gaussian prior and its KL live in
:mod:`~pyro_bdl.infer.natural_gradient.prior`, the checks in
:mod:`~pyro_bdl.infer.natural_gradient.checks`.

Both methods fit a diagonal Gaussian :math:`q = \mathcal N(\mu, \operatorname{diag}\sigma^2)`
over a lifted network's weights under a diagonal Gaussian prior, and keep the same state
(:class:`~pyro_bdl.infer.natural_gradient.state.NaturalGradientState`: μ, a running average of
ĝ, a running average of ĥ, and the same for the hidden point-estimate parameters). One step of
either is the template :meth:`NaturalGradientVI.step`:

1. read the model on the first minibatch (:func:`~pyro_bdl.infer.natural_gradient.model.prepare`)
   and initialise the state (the method's :meth:`~NaturalGradientVI._initialise`);
2. draw ``num_particles`` weight samples :math:`w = \mu + \sigma\varepsilon`, run the model with
   each written on the layers, and form ĝ and ĥ (the method's
   :meth:`~NaturalGradientVI._estimate_gradients`);
3. average them across data-parallel ranks with ``reduce_fn``, refuse non-finite values, and
   compute the loss N/B Σᵢ ℓᵢ + τ·KL(q ‖ prior);
4. apply the method's update (:meth:`~NaturalGradientVI._update`) and recompute σ
   (:meth:`~NaturalGradientVI._write_scale`).

A refused step (bad data or hyperparameters, a non-finite loss or gradient, an error from the
model or ``reduce_fn``) changes nothing: :class:`~pyro_bdl.infer.rollback.Rollback` puts back
BatchNorm's running statistics and torch's random state, σ is recomputed as it was, and a refused
first step forgets everything it set up. Reading a step: this module and the method's
(:mod:`~pyro_bdl.infer.natural_gradient.vogn`, :mod:`~pyro_bdl.infer.natural_gradient.ivon`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, ClassVar

import pyro
import torch
import torch.distributed as dist

from pyro_bdl._grad_mode import differentiates
from pyro_bdl._validation import (
    all_finite,
    check_positive,
    check_positive_int,
    check_probability,
)
from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.guides.natural_gradient import NaturalGradientGuide
from pyro_bdl.infer.natural_gradient.checks import (
    check_betas_pair,
    check_candidate,
    check_guide_reads,
    check_hyperparameters,
    check_inputs,
    check_loss,
    check_model,
    check_not_meta,
    check_real,
    check_reduce_fn,
    first_non_finite,
    layer_kinds,
    raise_if_moved,
)
from pyro_bdl.infer.natural_gradient.loss_scaling import (
    LossScaling,
    SkippedStep,
    check_grad_scaler,
)
from pyro_bdl.infer.natural_gradient.model import (
    Hidden,
    Prepared,
    per_example_nll,
    prepare,
    run_substituted,
)
from pyro_bdl.infer.natural_gradient.optimizer import NaturalGradientOptimizer
from pyro_bdl.infer.natural_gradient.prior import GaussianPrior
from pyro_bdl.infer.natural_gradient.state import (
    NaturalGradientState,
    StateFormat,
    check_state_dict,
    initial_state,
    map_tensors,
    pack_state_dict,
    state_tensors,
    unpack_state_dict,
    with_hidden,
)
from pyro_bdl.infer.rollback import Rollback, refused
from pyro_bdl.layout import SiteLayout

__all__ = ["NaturalGradientVI"]


class NaturalGradientVI:
    r"""Natural-gradient variational inference over a lifted network, shaped like ``SVI``: the
    base of :class:`~pyro_bdl.infer.VOGN` and :class:`~pyro_bdl.infer.IVON`.

    A method gives its name, its state_dict format, and five pieces of mathematics:
    :meth:`_allocate` (its buffers), :meth:`_initialise` (the first curvature),
    :meth:`_estimate_gradients` (ĝ and ĥ into :attr:`estimates`), :meth:`_update` and
    :meth:`_write_scale` (σ from the curvature). Everything else is here.

    :param callable model: a Pyro model over a :func:`~pyro_bdl.bayesianize` -d network whose only
        latent sites are its weights and whose observations lie in the data plate.
    :param int dataset_size: N, the number of training examples (the data plate's size).
    :param float lr: learning rate α (> 0).
    :param tuple betas: (β₁, β₂), each in [0, 1).
    :param float prior_precision: δ (> 0) of an N(0, δ⁻¹ I) prior instead of the lifted one.
    :param int num_particles: weight samples per step.
    :param int chunk_size: examples per chunk of per-example gradients (methods that take them).
    :param callable reduce_fn: optional ``reduce_fn(tensors)`` called once per step on
        :attr:`estimates` to average them in place across data-parallel ranks, so every rank
        applies the same update (docs/design/distributed.md). With
        :func:`~pyro_bdl.distributed.allreduce_mean` a rank that refuses its step makes every
        rank refuse it with the same error; with any other function, the refusing rank passes it
        NaN tensors (after the first step), which the other ranks refuse.
    :param grad_scaler: a ``torch.amp.GradScaler`` for float16 autocast: what is differentiated
        is scaled by its S, the estimates unscaled, an overflowing step skipped with nothing
        changed (:mod:`~pyro_bdl.infer.natural_gradient.loss_scaling`).
    """

    #: The method's name in messages (``"VOGN"``).
    name: ClassVar[str]
    #: The format of its state_dict.
    state_format: ClassVar[StateFormat]
    #: Whether the pass that reads the model is a training pass whose BatchNorm statistics the
    #: first step keeps (VOGN's first curvature comes from it; IVON's does not).
    reading_pass_trains: ClassVar[bool] = False
    #: How ĥ scales with the loss: 1 if it is linear in the gradient, 2 if quadratic.
    curvature_power: ClassVar[int] = 1

    def __init__(
        self,
        model: Callable,
        *,
        dataset_size: int,
        lr: float,
        betas: tuple[float, float],
        prior_precision: float | None,
        num_particles: int,
        chunk_size: int | None,
        reduce_fn: Callable[[list[torch.Tensor]], None] | None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ):
        check_model(model)
        check_positive_int("dataset_size", dataset_size)
        lr = check_real("lr", lr)
        check_positive("lr", lr, fix="Pass a learning rate > 0, for example lr=1e-3.")
        check_betas_pair(betas)
        for i, name in enumerate(("betas[0] (beta1)", "betas[1] (beta2)")):
            check_probability(name, check_real(name, betas[i]), open_interval=False)
        if prior_precision is not None:
            check_positive(
                "prior_precision",
                check_real("prior_precision", prior_precision),
                fix="Pass δ > 0, e.g. 1.0, or leave it out to use the prior of bayesianize.",
            )
        check_positive_int("num_particles", num_particles)
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        check_reduce_fn(reduce_fn)
        self.model, self.dataset_size = model, dataset_size
        self.num_particles, self.chunk_size = num_particles, chunk_size
        self.reduce_fn = reduce_fn
        scaler = check_grad_scaler(self.name, grad_scaler)
        self._scaling = None if scaler is None else LossScaling(scaler, self.curvature_power)
        self.prior_precision = None if prior_precision is None else float(prior_precision)
        #: Ñ, the dataset size the likelihood stands for (set by the method).
        self.effective_size = float(dataset_size)
        self.guide = NaturalGradientGuide(model, owner=self.name)
        #: The ``torch.optim.Optimizer`` to hand to ``torch.optim.lr_scheduler`` classes.
        self.optimizer = NaturalGradientOptimizer(lr, (float(betas[0]), float(betas[1])))
        #: Everything the update changes; ``None`` until the method has seen the model.
        self.state: NaturalGradientState | None = None
        self.layout: SiteLayout | None = None
        self.prior: GaussianPrior | None = None
        #: The Monte Carlo estimates of a step, the list ``reduce_fn`` receives.
        self.estimates: list[torch.Tensor] = []
        self._hidden: list[Hidden] = []
        self._pending: dict | None = None
        self._temperature = 1.0  # τ of the loss and of σ; only VOGN's changes
        self._scale_temperature: float | None = None  # the τ that σ was computed for
        self._var_sums = (0.0, 0.0)
        self._unreduced: list[torch.Tensor] = []  # a first curvature that ranks must average
        # Where the step stands with its reductions, for a refusal to tell the other ranks.
        self._reductions_done, self._in_reduction = True, False

    # -- what a method provides ------------------------------------------------------------------

    def _check_network(self, ready: Prepared) -> None:
        """Refuse, before anything is installed, a network whose first pass (``ready``) shows
        layers this method cannot train; nothing by default."""

    def _allocate(self) -> None:
        """Allocate :attr:`estimates` and the method's other buffers, like :attr:`state`, once per
        model (and again when :meth:`to` moves the state)."""
        raise NotImplementedError

    def _initialise(self, ready: Prepared) -> None:
        """Initialise the curvature at set-up (not from a state_dict) and compute σ."""
        raise NotImplementedError

    def _estimate_gradients(self, args, kwargs, step: int) -> tuple[list[float], int]:
        """ĝ and ĥ averaged over the particles into :attr:`estimates`; returns Σᵢ ℓᵢ of each
        draw, and the batch size B."""
        raise NotImplementedError

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ĝs, ĥs) in :attr:`estimates`: of μ first, then of each hidden parameter."""
        raise NotImplementedError

    def _update(
        self, state: NaturalGradientState, g_hat: list, h_hat: list, out, tau: float
    ) -> NaturalGradientState:
        """The method's update of ``state`` from the estimates ``g_hat`` and ``h_hat`` (as
        :meth:`_split` gives them, for the hidden parameters of ``state``) at the step's
        temperature ``tau``: the new mean, momentum and curvature into the tensors of ``out``
        (the state's own stay as they were), the hidden parameters and their moments in place;
        returns the new state."""
        raise NotImplementedError

    def _write_scale(
        self, curvature: torch.Tensor, tau: float, scale: torch.Tensor, log_scale: torch.Tensor
    ) -> None:
        """σ from ``curvature`` (the state's, or a state_dict's being checked) into ``scale``,
        and log σ into ``log_scale``."""
        raise NotImplementedError

    def _next_temperature(self, step: int) -> float:
        """The temperature τ of ``step``."""
        return self._temperature

    def _initial_scale_problem(self) -> str:
        """The hyperparameters that set the initial σ, for the message that refuses it."""
        return (
            f"with prior_precision={self.prior_precision!r} (None: the lifted prior) and "
            f"effective dataset size {self.effective_size!r}"
        )

    # -- hyperparameters ---------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by float16 loss scaling (``grad_scaler``) since this object was made."""
        return 0 if self._scaling is None else self._scaling.skipped_steps

    @property
    def step_count(self) -> int:
        return 0 if self.state is None else self.state.step

    @property
    def needs_setup(self) -> bool:
        """Whether the method has yet to see the model (its first :meth:`step` or :meth:`setup`)."""
        return self.state is None

    # -- set-up --------------------------------------------------------------------------------

    @differentiates
    def setup(self, *args, **kwargs) -> None:
        """Read the model on a minibatch and initialise the state as the first :meth:`step` does
        before its update, leaving BatchNorm's running statistics as they were. Does nothing once
        the method has seen the model. A checkpoint loader calls it before checking and restoring
        a state. A refusal leaves the method unset and the network as it was."""
        self._setup(args, kwargs, keep_statistics=False, where=f"{self.name}.setup")

    def _setup(self, args, kwargs, *, keep_statistics: bool, where: str):
        """Set up on this minibatch unless already set up; returns what undoes the set-up
        (``None`` if there was nothing to do)."""
        if self.state is not None:
            return None
        pending = self._pending
        ready = prepare(
            self.model,
            args,
            kwargs,
            dataset_size=self.dataset_size,
            chunk_size=self.chunk_size,
            method=self.name,
        )

        def undo() -> None:
            ready.undo()
            self._uninstall(pending)

        try:
            self._check_network(ready)
            prior = GaussianPrior.read(ready.layout, self.prior_precision)
            self._install(ready, prior)
            if pending is not None:
                self._pending = None
                try:
                    self.load_state_dict(pending)
                except ValueError as err:
                    pending = None  # refused for good: the undo below must not keep it
                    raise ValueError(
                        f"{where}: the state_dict loaded before the first step does not fit this "
                        f"model: {err} It was discarded, and nothing else changed: the next step "
                        f"starts afresh, or load a matching state_dict first."
                    ) from err
            else:
                self._initialise(ready)
                overflow = keep_statistics and getattr(self._scaling, "first_overflowed", False)
                if not (all(map(math.isfinite, self._var_sums)) or overflow):  # a step skips
                    raise ValueError(
                        f"{where}: {self._initial_scale_problem()} the initial posterior scale σ "
                        "is zero or not finite somewhere (float precision exceeded); nothing was "
                        "set up."
                    )
        except BaseException as err:
            refused(err, where)
            undo()
            raise
        if not (keep_statistics and self.reading_pass_trains):
            ready.restore_statistics()
        return undo

    def _install(self, ready: Prepared, prior: GaussianPrior) -> None:
        """Own the state of a freshly read model; allocate the buffers every pass reuses."""
        layout, hidden = ready.layout, ready.hidden
        self.layout, self._hidden, self.prior = layout, hidden, prior
        self.state = initial_state(layout, hidden)
        #: The layers the first pass called (those a method hooks) and the buffers a pass may
        #: change (BatchNorm's running statistics, saved before each step).
        self._layers = list(ready.tape.calls)
        self._buffer_entries = ready.statistics.written()
        self._specs = [site.spec for site in layout if site.spec is not None]
        self._weight_names = frozenset(site.name for site in layout)
        self._attach(torch.zeros_like(self.state.mean))

    def _attach(self, scale: torch.Tensor) -> None:
        """Hand the state's mean and ``scale`` to the guide, and allocate every buffer like the
        state (at set-up, and again after :meth:`to`)."""
        assert self.state is not None and self.layout is not None
        mean = self.state.mean
        self.guide.attach(self.layout, mean, scale)
        #: Where an update writes the new mean, momentum and curvature, kept only if all are
        #: finite (then the storages are swapped with the state's).
        self._spare = NaturalGradientState(
            torch.empty_like(mean), torch.empty_like(mean), torch.empty_like(mean)
        )
        #: ε of the last draw; free once w is drawn (σ's refresh computes log σ into it).
        self._noise = torch.empty_like(mean)
        self._w = torch.empty_like(mean)
        self._weight_views = self.layout.split(self._w)
        # What each pass writes onto the layers: the weight sample's views, and the hidden
        # parameters themselves (what PyroModule's pyro.param statement would return).
        self._values = self._written(self._weight_views)
        self._rollback = Rollback(self._buffer_entries)
        self._kinds = layer_kinds(self._trained_layers().values())  # see raise_if_moved
        self._allocate()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle, and allocate the buffers of the passes afresh: ``pickle`` gives each tensor
        its own storage, so the per-site views a pass writes through would stop being views."""
        self.__dict__.update(state)
        if self.state is not None:
            self._attach(self.guide.scale)

    @torch.no_grad()
    @torch.inference_mode(False)  # moved under inference_mode, the state would not train again
    def to(self, *args, **kwargs) -> NaturalGradientVI:
        """Move the state (μ, the moments, σ, the buffers of every pass) and the network's layers
        that this method trains (the lifted and hidden layers and the layers with running
        statistics) to a device or dtype, with the arguments of ``torch.Tensor.to``; returns
        ``self``, like ``nn.Module.to``. Move the rest of the model yourself.

        Before the first step there is no state: the method reads it at the first step from the
        network, wherever the network then is (move the network with ``net.to(...)``).

        :raises ValueError: a dtype other than float32 or float64 (the state accumulates
            curvature and momentum: never in bf16 or fp16; train under ``torch.autocast``
            instead), or a ``memory_format``. Nothing is moved then.
        """
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{self.name}.to: dtype must be torch.float32 or torch.float64 (the state's "
                f"momentum and curvature accumulate over steps); got {dtype}. Nothing was moved. "
                "For bf16 or fp16 compute, train under torch.autocast and keep the state in "
                "float32."
            )
        if memory_format is not None:
            raise ValueError(
                f"{self.name}.to: memory_format does not apply to the flat state; got "
                f"{memory_format}. Nothing was moved; pass a device and/or a dtype."
            )

        def convert(t: torch.Tensor) -> torch.Tensor:
            cast = dtype if t.is_floating_point() else None
            return t.to(device=device, dtype=cast, non_blocking=non_blocking)

        self.optimizer.param_groups[0]["params"] = [
            convert(p) for p in self.optimizer.param_groups[0]["params"]
        ]
        if self._pending is not None:
            self._pending = map_tensors(self._pending, convert)
        state = self.state
        if state is None or self.layout is None or self.prior is None:
            return self
        # The converted state first (no side effect), then the layers, then the assignments.
        mean, momentum, curvature = map(convert, (state.mean, state.momentum, state.curvature))
        hidden_momentum = [convert(t) for t in state.hidden_momentum]
        hidden_curvature = [convert(t) for t in state.hidden_curvature]
        prior, scale = self.prior, convert(self.guide.scale)
        precision = prior.precision
        prior = GaussianPrior(
            convert(precision) if isinstance(precision, torch.Tensor) else precision,
            None if prior.mean is None else convert(prior.mean),
        )
        self._move_layers(convert)
        self._hidden = [
            Hidden(h.name, h.module._parameters[h.param_name], h.module, h.param_name)  # type: ignore[arg-type]
            for h in self._hidden
        ]
        self.prior = prior
        self.state = NaturalGradientState(
            mean=mean,
            momentum=momentum,
            curvature=curvature,
            hidden=[h.param for h in self._hidden],
            hidden_momentum=hidden_momentum,
            hidden_curvature=hidden_curvature,
            step=state.step,
        )
        if self._unreduced:
            self._unreduced = [curvature, *hidden_curvature]
        # σ converted, not recomputed: the same values, and no read of them (a meta tensor has
        # none); the KL's sums stay as they were.
        self._attach(scale)
        return self

    def _move_layers(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Move the parameters and buffers of the layers this method writes or reads, and point
        the param store at a parameter that the move replaced by a new tensor (as the guides'
        ``.to`` does)."""
        layers = self._trained_layers()
        store = pyro.get_param_store()
        for h in self._hidden:
            before = h.module._parameters[h.param_name]
            h.module._apply(convert, recurse=False)
            layers.pop(id(h.module), None)
            after = h.module._parameters[h.param_name]
            if after is not before and h.name in store and store[h.name] is before:
                del store[h.name]
                store[h.name] = after
        for layer in layers.values():
            layer._apply(convert, recurse=False)

    def _trained_layers(self) -> dict[int, torch.nn.Module]:
        """The layers this method writes or reads, by ``id``."""
        layers: dict[int, torch.nn.Module] = {}
        for spec in self._specs:
            for layer in (spec.module, *(sub for sub, _ in spec.alias_layers)):
                layers.setdefault(id(layer), layer)
        for layer in [h.module for h in self._hidden] + [m for m, _ in self._buffer_entries]:
            layers.setdefault(id(layer), layer)
        return layers

    def _uninstall(self, pending: dict | None) -> None:
        """Back to a method that has not seen the model (a refused first step)."""
        self.state, self.layout, self.prior, self._hidden = None, None, None, []
        self._pending = pending
        self._scale_temperature, self._var_sums, self._unreduced = None, (0.0, 0.0), []
        self.guide.detach()

    @torch.no_grad()
    def _refresh_scale(self, tau: float, state: NaturalGradientState | None = None) -> None:
        """σ of ``state`` (by default :attr:`state`) into the guide, and the KL's Σσ² and
        Σ log σ², kept for the loss of the next steps (only the μ terms change)."""
        assert self.prior is not None
        self._scale_temperature = tau
        scale = self.guide.scale
        curvature = (state or self.state).curvature  # type: ignore[union-attr]
        self._var_sums = self._scale_and_sums(curvature, tau, scale, self._noise)

    def _scale_and_sums(
        self, curvature: torch.Tensor, tau: float, scale: torch.Tensor, work: torch.Tensor
    ) -> tuple[float, float]:
        """σ from ``curvature`` into ``scale`` and the KL's (Σ δσ², Σ log σ²) (``work``: a
        D-long buffer to spend, here on log σ). A method may fuse the three passes."""
        assert self.prior is not None
        self._write_scale(curvature, tau, scale, work)
        return self.prior.variance_sums(scale, work)

    # -- the passes ------------------------------------------------------------------------------

    def _scaled(self, root: torch.Tensor) -> torch.Tensor:
        """``root``, what a method differentiates, times the loss scale S (if ``grad_scaler``)."""
        return root if self._scaling is None else self._scaling.scale(root)

    def _written(self, weights: list[torch.Tensor]) -> list[tuple[Any, str, torch.Tensor]]:
        """(layer, name, value) of every weight site's ``weights`` and every hidden parameter."""
        out = [(spec.module, spec.param_name, w) for spec, w in zip(self._specs, weights)]
        return out + [(hp.module, hp.param_name, hp.param) for hp in self._hidden]

    @torch.no_grad()
    def _sample(self) -> torch.Tensor:
        """w = μ + σ ⊙ ε into the flat sample buffer (whose views the layers read)."""
        assert self.state is not None
        torch.randn(self._noise.shape, out=self._noise)
        return torch.addcmul(self.state.mean, self.guide.scale, self._noise, out=self._w)

    def _run(self, values, args, kwargs, step: int) -> tuple[torch.Tensor, int, float]:
        """One pass with ``values`` written on the layers: the per-example NLL, B and its sum."""
        where = f"{self.name} step {step}"
        sites = run_substituted(self.model, values, args, kwargs, where, self._weight_names)
        return per_example_nll(sites, where)

    def _gradients(self, tape: PerExampleGradients, losses: torch.Tensor, out, add: bool) -> None:
        """Σg and Σg² of each layer's parameters into ``out`` (added to them if ``add``)."""
        raw = tape.compute(losses, out=out, add=add)
        tape.clear()  # free the recorded activations now, not at the next step
        if not add and len(raw) < len(out):
            for key, (g, h) in out.items():
                if key not in raw:  # a layer the model did not call this time: no gradient
                    g.zero_()
                    h.zero_()

    def _check_finite(self, step: int, reduced: bool = False) -> None:
        """Refuse non-finite estimates, naming the first tensor (``reduced``: the ranks' mean,
        which is non-finite if any rank's is, or if the sum overflows)."""
        if all_finite(self.estimates):
            return
        names = ["weights", *(f"{h.name} (hidden)" for h in self._hidden)]
        g_hats, h_hats = self._split()
        labelled = [(f"{n} (ĝ)", t) for n, t in zip(names, g_hats)]
        labelled += [(f"{n} (ĥ)", t) for n, t in zip(names, h_hats)]
        name, tensor = next((n, t) for n, t in labelled if not bool(torch.isfinite(t).all()))
        flat = tensor is g_hats[0] or tensor is h_hats[0]
        where = first_non_finite(tensor, self.layout if flat else None)
        after = " after reduce_fn (on some rank, or by overflow of the sum)" if reduced else ""
        raise ValueError(
            f"{self.name} step {step}: the gradient of the likelihood for {name} is not "
            f"finite{after} (NaN or inf); nothing was updated. The first non-finite entry is "
            f"{where}. Check the batch's scale (standardise the inputs), then lower the "
            "learning rate."
        )

    # -- the public step -----------------------------------------------------------------------

    @differentiates
    def step(self, *args, **kwargs) -> float:
        """One update on a minibatch; returns the estimated (tempered) negative ELBO,
        N/B Σᵢ ℓᵢ averaged over the particles plus τ·KL(q ‖ prior), like ``SVI.step``.

        A refused step (bad data or hyperparameters, a non-finite loss or gradient, an update
        that would leave a non-finite state or σ, an error from the model or ``reduce_fn``)
        changes nothing: the state, τ, σ, BatchNorm's running statistics and torch's random state
        stay as they were, so a retry with good data continues the run as if the bad batch had
        not come. With a ``reduce_fn``, a rank that refuses before its reduction tells the other
        ranks (:meth:`_tell_ranks`), so every rank refuses the step together."""
        step = self.step_count + 1
        where = f"{self.name} step {step}"
        self._reductions_done = self.reduce_fn is None
        self._in_reduction = False
        try:
            check_not_meta(self.state, self.name, where)
            check_guide_reads(self.guide, self.state, self.name, where)
            check_hyperparameters(self.optimizer, step, self.name)
            check_inputs(args, kwargs, where)
            tau = self._next_temperature(step)
            undo_setup = self._setup(args, kwargs, keep_statistics=True, where=where)
        except BaseException as err:
            self._tell_ranks(err)
            raise
        rollback, scale_tau, state = self._rollback, self._scale_temperature, self.state
        unreduced = self._unreduced
        assert state is not None
        # The update writes the D-long mean, momentum and curvature into spare tensors, kept only
        # once checked (:meth:`_commit`); what it writes in place (the hidden parameters and
        # their moments, small) and what the first reduction averages in place are copied.
        rollback.save([*state.hidden, *state.hidden_momentum, *state.hidden_curvature, *unreduced])
        try:
            loss = self._loss(args, kwargs, step, tau)
            candidate = self._update_trainable(state, tau)
            self._refresh_scale(tau, candidate)
            self._check_state(step, candidate)
        except BaseException as err:
            skipped = isinstance(err, SkippedStep)  # float16 overflow: skipped, S shrinks
            if not skipped:
                refused(err, where)
            if self._scaling is not None:
                self._scaling.finish(skipped=True) if skipped else self._scaling.abandon()
            rollback.restore()
            self._unreduced = unreduced
            if scale_tau is not None:
                self._refresh_scale(scale_tau)  # σ back to what it was, bit for bit
            if undo_setup is not None:
                undo_setup()
            if isinstance(err, SkippedStep):
                return err.loss
            self._tell_ranks(err)
            if undo_setup is None:
                raise_if_moved(err, self._trained_layers().values(), self._kinds, self.name, where)
            raise
        self._commit(candidate)
        self._temperature = tau
        self.optimizer.step()  # marks the step for the learning-rate schedulers
        if self._scaling is not None:
            self._scaling.finish(skipped=False)
        return loss

    def _update_trainable(self, state: NaturalGradientState, tau: float) -> NaturalGradientState:
        """The method's update of ``state`` at the step's temperature ``tau`` (that of its loss
        and its new σ) into the spare tensors, leaving out the hidden parameters frozen since
        set-up (``requires_grad=False``) as ``torch.optim`` skips a parameter without a
        gradient: their values and moments stay as they were."""
        g_hat, h_hat = self._split()
        keep = [h.param.requires_grad for h in self._hidden]
        if all(keep):
            return self._update(state, g_hat, h_hat, self._spare, tau)
        # A method without ĥ of the hidden parameters (IVON) gives only the weights' ĥ.
        g_part, h_part = (xs[:1] + [x for x, k in zip(xs[1:], keep) if k] for xs in (g_hat, h_hat))
        new = self._update(with_hidden(state, keep), g_part, h_part, self._spare, tau)
        return with_hidden(new, keep, like=state)

    @torch.no_grad()
    def _commit(self, candidate: NaturalGradientState) -> None:
        """Keep a checked update: the state's mean, momentum and curvature take the storage the
        update wrote, and the spare tensors the old one, so that the state's tensors (and the
        guide's ``loc``, the state's mean) stay the same objects."""
        state = self.state
        assert state is not None
        for own, new in zip(
            (state.mean, state.momentum, state.curvature),
            (candidate.mean, candidate.momentum, candidate.curvature),
        ):
            if own is not new:  # both are contiguous (D,) tensors of one dtype and device
                storage, offset = own.untyped_storage(), own.storage_offset()
                own.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
                new.set_(storage, offset, own.shape, own.stride())
        state.step = candidate.step

    def _reduce(self, tensors: list[torch.Tensor], last: bool) -> None:
        """``reduce_fn(tensors)``, noting whether the step's reductions are done (``last``) and
        that an error raised inside it came from the collective (the other ranks saw it)."""
        assert self.reduce_fn is not None
        self._in_reduction = True
        self.reduce_fn(tensors)
        self._in_reduction = False
        self._reductions_done = last

    def _tell_ranks(self, error: BaseException) -> None:
        """A rank that refuses before its step's last reduction takes part in the other ranks'
        next reduction, so that they refuse too instead of waiting in it (or pairing it with
        this rank's next step). A ``reduce_fn`` with a ``refuse(error)`` method
        (:func:`~pyro_bdl.distributed.allreduce_mean`, ``StepAgreement.wrap``) makes every rank
        raise the same error naming this one; any other ``reduce_fn`` is called on NaN tensors
        of the shapes it expects, so the other ranks refuse the non-finite mean (possible once
        the shapes are known: after the first step's set-up)."""
        if self._reductions_done or self._in_reduction or not isinstance(error, Exception):
            return
        self._reductions_done = True
        refuse = getattr(self.reduce_fn, "refuse", None)
        if refuse is not None:
            refuse(error)  # raises the agreed error on every rank (returns in one process)
            return
        shapes = self._unreduced or self.estimates
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if several and shapes and self.reduce_fn is not None:
            self.reduce_fn([torch.full_like(t, math.nan) for t in shapes])

    def _check_state(self, step: int, candidate: NaturalGradientState) -> None:
        """Refuse an update that would leave a non-finite state or σ, before it is committed."""
        hidden = [h.name for h in self._hidden]
        g_hat = self._split()[0][0]
        args = (self._var_sums, hidden, self.layout, g_hat, self.name, step)
        check_candidate(state_tensors(candidate), *args)

    def _loss(self, args, kwargs, step: int, tau: float) -> float:
        """ĝ, ĥ into :attr:`estimates` and the loss, with every check; changes only what
        :meth:`step` rolls back (σ, the layers' buffers, the random state, what the first
        reduction averages); :class:`SkippedStep` when the scaled estimates overflowed."""
        if self._unreduced and self.reduce_fn is not None:  # the first draw's σ: from the
            self._reduce(self._unreduced, last=False)  # ranks' mean first curvature, as in one
            self._unreduced, self._scale_temperature = [], None  # process
        if self._scaling is not None:  # a scaled set-up's overflow, on any rank: skipped
            self._scaling.check_first(self.state, f"{self.name} step {step}")
        if self._scale_temperature != tau:  # τ or the first curvature changed since σ was set
            self._refresh_scale(tau)
        nlls, batch = self._estimate_gradients(args, kwargs, step)
        nll_total = sum(nll * self.dataset_size / batch for nll in nlls) / self.num_particles
        # This rank's own checks come before the reduction, so that a refusal here reaches the
        # other ranks through it (a mean of finite values can still overflow: checked again).
        # Under loss scaling an overflow is skipped after the reduction, which spreads it.
        scaling = self._scaling
        if scaling is None:
            self._check_finite(step)
        check_loss(step, nll_total, 0.0, self.name)
        if self.reduce_fn is not None:
            self._reduce(self.estimates, last=True)
            if scaling is None:
                self._check_finite(step, reduced=True)
        kl = self._kl()
        check_loss(step, nll_total, kl, self.name)
        if scaling is not None and not scaling.unscale(self.estimates, self._split()[1]):
            scaling.refuse_below_one(lambda: self._check_finite(step, self.reduce_fn is not None))
            raise SkippedStep(nll_total + tau * kl)
        return nll_total + tau * kl

    @torch.no_grad()
    def evaluate_loss(self, *args, **kwargs) -> float:
        """The loss :meth:`step` would report, at the current q, without updating anything (like
        ``SVI.evaluate_loss``; put BatchNorm in eval mode first to keep its statistics). If a pass
        raises, the layers' buffers and the random state are put back."""
        if self.state is None:
            raise RuntimeError(
                f"{self.name} has not seen the model yet; call {self.name.lower()}.step(x, y) "
                "first."
            )
        check_guide_reads(self.guide, self.state, self.name, f"{self.name}.evaluate_loss")
        step = self.step_count + 1
        self._rollback.save()
        try:
            nll = 0.0
            for _ in range(self.num_particles):
                self._sample()
                _, batch, total = self._run(self._values, args, kwargs, step)
                nll += total / batch
        except BaseException as err:
            self._rollback.restore()
            layers, where = self._trained_layers().values(), f"{self.name}.evaluate_loss"
            raise_if_moved(err, layers, self._kinds, self.name, where)
            raise
        nll = nll / self.num_particles
        return nll * self.dataset_size + self._temperature * self._kl()

    def _kl(self) -> float:
        """KL(q ‖ prior) in closed form."""
        assert self.state is not None and self.prior is not None
        return self.prior.kl(self.state.mean, self._var_sums)

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the update changes: μ, the moments, the hidden parameters and their
        moments, the step counter, τ (VOGN) and the scheduled hyperparameters (BatchNorm running
        statistics stay in ``net.state_dict()``; σ follows from the curvature). Before the first
        step, a state given to :meth:`load_state_dict` is the state (a copy)."""
        if self.state is None and self._pending is not None:
            return copy.deepcopy(self._pending)
        if self.state is None or self.layout is None:
            raise RuntimeError(
                f"{self.name} has no state before its first step; call "
                f"{self.name.lower()}.step(x, y)."
            )
        return pack_state_dict(
            self.state,
            self.layout,
            self._hidden,
            temperature=self._temperature,
            optimizer=self.optimizer.state_dict(),
            spec=self.state_format,
        )

    def check_state_dict(self, state: Any) -> None:
        """Refuse (``ValueError``) a state that :meth:`load_state_dict` would not restore: not
        this method's, an earlier format, non-finite values, or (once the model is known)
        another model's, or a curvature that gives a σ that is not finite and > 0."""
        hidden = self._hidden if self.layout is not None else None
        check_state_dict(state, self.layout, hidden, spec=self.state_format)
        if self.state is None:
            return
        check_not_meta(self.state, self.name, f"{self.name}.load_state_dict")
        check_guide_reads(self.guide, self.state, self.name, f"{self.name}.load_state_dict")
        curvature = state["curvature"].to(self.state.curvature)
        tau = float(state["temperature"]) if self.state_format.temperature else 1.0
        scale, log_scale = torch.empty_like(curvature), torch.empty_like(curvature)
        self._write_scale(curvature, tau, scale, log_scale)
        bad = ~torch.isfinite(log_scale)  # log σ is finite only where σ is finite and > 0
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"the {self.name} state_dict's curvature gives a posterior scale σ that is not "
                f"finite and > 0 at {int(bad.sum())} weight(s) (the first at index {first}, "
                f"curvature {float(curvature[first])!r}); it was not loaded and nothing changed. "
                "Load a state_dict saved by this method from a healthy run."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, checked first (nothing changes if it is refused); before
        the method has seen the model it is checked as far as it can be without the model, and
        applied (and checked against the model) at the first :meth:`step` or :meth:`setup`,
        which then skips the initialisation of the curvature; refused there, it is discarded."""
        self.check_state_dict(state)
        if self.state is None:
            self._pending = copy.deepcopy(dict(state))  # as it is now, whatever the caller does
            return
        unpack_state_dict(state, self.state, self._hidden)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.state_format.temperature:
            self._temperature = float(state["temperature"])
        self._refresh_scale(self._temperature)
