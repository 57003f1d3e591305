r"""Data-parallel stochastic variational inference: :class:`DataParallelSVI`.

With R ranks each holding B_local examples, rank r minimises

.. math::

    L_r = \mathrm{KL}(q \,\|\, p)
          + \frac{N}{B_\text{local}} \sum_{i \in \text{batch}_r} \ell_i(w_r),

(the model's ``pyro.plate("data", N, subsample_size=B_local)`` applies the N/B_local scale and
the KL is counted once per rank). Averaging the gradients over ranks gives
∇KL + (N / (R·B_local)) Σ over all R·B_local examples, which is exactly the single-process
estimator on the concatenated batch of B = R·B_local examples (docs/design/distributed.md).
When every rank draws the same weights (``shared_noise=True``) the two agree to rounding; by
default each rank draws its own weights w_r, which averages R Monte Carlo samples of the
likelihood term for free.

Usage::

    guide(x[:2], y[:2])                       # the guide creates its parameters first
    svi = DataParallelSVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    for batch in shard_indices(N, epoch=epoch).split(batch_size):
        loss = svi.step(x[batch], y[batch])  # loss averaged over ranks

References:

- Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017.
- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019 (independent
  weight noise per worker).
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable

import pyro
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoGuide
from pyro.infer.util import zero_grads
from pyro.optim import PyroOptim
from torch import nn

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._grad_mode import differentiates
from pyro_bdl._validation import check_positive
from pyro_bdl.distributed.comm import (
    all_gather_scalars,
    all_reduce_,
    broadcast_,
    comm_device,
    get_rank,
    get_world_size,
)
from pyro_bdl.distributed.errors import BatchNormWarning, GuideNotInitializedError
from pyro_bdl.distributed.overlap import GradientBuckets
from pyro_bdl.distributed.refusal import (
    agree_on_refusal,
    nonfinite_refusal,
    refusal_status,
    settle_refusal,
)
from pyro_bdl.distributed.svi_parts import (
    SEED_RANGE,
    ParamRecorder,
    backward_passes,
    check_seed,
    crc,
    grads_of,
    item,
    module_buffers,
    modules,
    optimizer_state,
    unsynced_batchnorms,
)
from pyro_bdl.infer.rollback import Rollback, norm_layer_buffers

__all__ = ["BatchNormWarning", "DataParallelSVI", "GuideNotInitializedError"]


_HOW_TO_INIT = (
    "Call the guide once on an example batch on every rank first, for example "
    "`guide(x[:2], y[:2])` (or run one plain `SVI(...).step(x_batch, y_batch)`), then build "
    "DataParallelSVI: rank 0's parameters are broadcast to every rank when it is built, so a "
    "parameter created later would start from a different value on each rank."
)


class DataParallelSVI(SVI):
    r"""Like :class:`pyro.infer.SVI`, with gradients averaged over the ranks of a
    ``torch.distributed`` process group after every step.

    Each :meth:`step` computes the loss and gradients of ``loss`` on this rank's batch, averages
    the gradients of every parameter over the ranks (one flattened all-reduce per device and
    dtype), applies the Pyro optimizer and returns the loss averaged over the ranks. Every rank
    then holds identical parameters. Without an initialised process group it behaves like
    ``SVI`` on one process, so the same script runs on a laptop.

    Rules (docs/design/distributed.md):

    - **Build it after the guide has created its parameters** (call ``guide(*example_batch)``);
      otherwise :class:`GuideNotInitializedError` says so. Building it broadcasts rank 0's
      parameters, the modules' buffers (frozen weights included) and the optimizer's state
      (:meth:`broadcast_parameters`), so all ranks start from the same point.
    - **Every rank passes a batch of the same size**, and the model scales its data plate by
      N/B_local (:func:`pyro_bdl.models.classifier` does); :func:`shard_indices` gives equal
      shards. A step whose subsampled plates differ in size across ranks raises ``ValueError``
      on every rank. The ranks must take the same number of steps.
    - **Weight noise is independent per rank** by default: the RNG of rank r is seeded with
      ``seed + r``. ``shared_noise=True`` seeds every rank with ``seed`` (tests compare with one
      process this way). ``seed=None`` draws the base seed on rank 0 from the current RNG.
      After restoring a checkpoint written by rank 0, call :meth:`seed_noise` again.
    - **BatchNorm** layers found in the guide, in the model (if it is a module) or in
      ``model.net`` trigger a :class:`BatchNormWarning`: each rank normalises with its own local
      batch, and the running statistics are taken from rank 0 (broadcast after every step).
      ``torch.nn.SyncBatchNorm`` (CUDA) layers are synchronised and do not warn.
    - **Refusals are agreed.** If any rank's step fails (the model refuses its batch, or its
      loss or a gradient is not finite), every rank raises the same error at the same step, in
      the all-gather that precedes the gradients' all-reduce, naming the refusing rank and its
      reason; no rank changes parameters, optimizer state, torch random generators or BatchNorm
      statistics, and the ranks stay in step for the next batch. A non-finite averaged loss or
      gradient raises ``FloatingPointError`` on every rank, also before anything changes.
    - Checkpoints: write them on one rank, ``if is_main_process(): ...``.

    Usage::

        guide(x[:2], y[:2])
        svi = DataParallelSVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        loss = svi.step(x_local, y_local)

    :param callable model: the Pyro model.
    :param callable guide: the guide, whose parameters already exist.
    :param pyro.optim.PyroOptim optim: a Pyro optimizer (``pyro.optim.Adam({...})``).
    :param loss: an ELBO (``Trace_ELBO()``, ``TraceMeanField_ELBO()``, ...) or a loss callable, as
        for ``SVI``.
    :param process_group: the ``torch.distributed`` group (default: the default group).
    :param bool shared_noise: draw the same weight noise on every rank (default ``False``).
    :param int seed: the base seed of the weight noise (default: drawn on rank 0).
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim: PyroOptim,
        loss,
        *,
        process_group=None,
        shared_noise: bool = False,
        seed: int | None = None,
        overlap: bool = True,
        bucket_cap_mb: float = 25.0,
    ):
        if not isinstance(optim, PyroOptim):
            raise TypeError(
                f"optim must be a pyro.optim.PyroOptim; got {type(optim).__name__}. Wrap the "
                "torch optimizer, for example pyro.optim.Adam({'lr': 1e-3})."
            )
        if not callable(loss) and not hasattr(loss, "loss_and_grads"):
            raise TypeError(
                f"loss must be a Pyro ELBO or a callable loss; got {type(loss).__name__}. Pass "
                "for example pyro.infer.Trace_ELBO()."
            )
        check_seed(seed)
        check_positive("bucket_cap_mb", bucket_cap_mb)
        if isinstance(guide, AutoGuide) and guide.prototype_trace is None:
            raise GuideNotInitializedError(
                f"the guide {type(guide).__name__} has not created its parameters yet. "
                + _HOW_TO_INIT
            )
        if not self._collect(guide):
            raise GuideNotInitializedError(
                "there are no parameters to train: the guide has not created any yet. "
                + _HOW_TO_INIT
            )
        super().__init__(model, guide, optim, loss)
        self.process_group = process_group
        self.shared_noise = bool(shared_noise)
        self.num_steps_taken = 0
        batchnorms = unsynced_batchnorms(list(modules(model, guide)))
        if batchnorms and get_world_size(process_group) > 1:
            warnings.warn(
                f"the data-parallel model has BatchNorm layers ({', '.join(batchnorms)}): each "
                "rank normalises with its own local batch, and the running statistics are "
                "taken from rank 0 (broadcast after every step). Convert them with "
                "torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) on GPUs for statistics "
                "over the whole batch, or use LayerNorm/GroupNorm.",
                BatchNormWarning,
                stacklevel=user_stacklevel(),
            )
        self._buffers = [b for m in batchnorms.values() for b in m.buffers()]
        self._norm_modules = list(modules(model, guide))
        self._world = get_world_size(process_group)
        self._snapshot = Rollback([])  # set in broadcast_parameters
        self._params: dict[str, torch.Tensor] = {}
        self._known: set[int] = set()
        self._overlap = bool(overlap) and self._world > 1
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._buckets: GradientBuckets | None = None
        self.broadcast_parameters()
        self.seed_noise(seed)

    # -- set-up -----------------------------------------------------------------------------

    @staticmethod
    def _collect(guide: Callable) -> dict[str, torch.Tensor]:
        """Every trainable tensor, by name: the param store (model and guide ``pyro.param``
        sites, including those of ``PyroModule`` s) plus any guide parameter kept outside it.
        A tensor under several names (a ``PyroModule``'s tied weights) is listed once, under the
        first in sorted order: the optimizer steps it once per step, as SVI does."""
        named = dict(pyro.get_param_store().named_parameters())
        seen = {id(p) for p in named.values()}
        if isinstance(guide, nn.Module):
            for name, p in guide.named_parameters():
                if id(p) not in seen:
                    named[f"{type(guide).__name__}.{name}"] = p
        unique: dict[str, torch.Tensor] = {}
        listed: set[int] = set()
        for name, p in sorted(named.items()):
            if id(p) not in listed:
                listed.add(id(p))
                unique[name] = p
        return unique

    def broadcast_parameters(self) -> None:
        """Overwrite every parameter, every buffer of the modules (frozen weights, BatchNorm
        statistics) and the optimizer's state with their values on rank 0.

        Called when the object is built; call it again after loading a checkpoint (load it on
        every rank when it holds optimizer state). Raises ``RuntimeError`` if the ranks hold
        different sets of parameter or buffer names, or optimizer state for different parameters.
        """
        named = self._collect(self.guide)
        buffers = module_buffers(self._norm_modules)
        described, optim_tensors = optimizer_state(self.optim, named)
        # Names, shapes and dtypes must agree: the buckets of every step follow this list.
        names = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named.items()]
        numel = sum(p.numel() for p in named.values())
        buffer_names = [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in buffers.items()]
        stats = all_gather_scalars(
            [crc(names), numel, crc(buffer_names), crc(described)], self.process_group
        )
        rank = get_rank(self.process_group)
        if not bool((stats[:, :2] == stats[0, :2]).all()):
            raise RuntimeError(
                f"the ranks hold different parameters (rank {rank} has "
                f"{len(names)} named parameters with {numel} numbers; per rank [checksum of the "
                f"names, shapes and dtypes, "
                f"numbers]: {stats[:, :2].tolist()}). Build the same model and guide, call the "
                "guide on the same kind of batch on every rank, and clear stale parameters with "
                "pyro.clear_param_store() before setting up."
            )
        if not bool((stats[:, 2] == stats[0, 2]).all()):
            raise RuntimeError(
                f"the ranks' modules hold different buffers (rank {rank} has "
                f"{len(buffer_names)}); build the same network and guide on every rank."
            )
        if not bool((stats[:, 3] == stats[0, 3]).all()):
            raise RuntimeError(
                f"the optimizer holds state for different parameters on the ranks (rank {rank}: "
                f"{len(described)} entries), as after a checkpoint loaded on some ranks only. "
                "Load the checkpoint on every rank, or pass a fresh optimizer."
            )
        broadcast_(
            list(named.values()) + list(buffers.values()) + optim_tensors, self.process_group
        )
        # What a step may change outside the optimizer, saved before every step into storage
        # kept between steps: the normalisation layers' statistics and the random streams.
        self._snapshot = Rollback(norm_layer_buffers(self._norm_modules))
        self._params = named
        self._known = {id(p) for p in named.values()}
        if self._buckets is not None:
            self._buckets.close()
        if self._overlap:
            self._buckets = GradientBuckets(
                list(named.values()),
                self.process_group,
                bucket_cap_mb=self._bucket_cap_mb,
                passes=backward_passes(self.loss),
                control=8,  # refusal_status (2) and the 6 values of step()
            )

    def seed_noise(self, seed: int | None = None) -> None:
        """Re-seed the weight noise of every rank: ``seed + rank`` (``seed`` when the noise is
        shared). Called when the object is built; call it again after restoring a checkpoint
        written by rank 0, whose RNG state would otherwise give every rank the same noise.

        :param int seed: the base seed (default: drawn on rank 0 from its current RNG and
            broadcast, so a script seeded with ``pyro.set_rng_seed`` stays reproducible).
        """
        check_seed(seed)
        if seed is None:
            base = torch.randint(SEED_RANGE, (1,), device=comm_device(self.process_group))
            broadcast_([base], self.process_group)
            seed = int(base.item())
        offset = 0 if self.shared_noise else get_rank(self.process_group)
        self.seed = seed
        # seed + rank stays below 2**32, the largest seed NumPy accepts.
        pyro.set_rng_seed(seed + offset)

    # -- training ---------------------------------------------------------------------------

    @differentiates
    def step(self, *args, **kwargs) -> float:
        """One data-parallel gradient step on this rank's batch.

        If any rank refuses its batch (the model's checks raise, or its loss or gradient is not
        finite), every rank raises the same error at this step, before any gradient is exchanged,
        and no rank changes its parameters, optimizer state, torch random generators or BatchNorm
        statistics (see :func:`~pyro_bdl.distributed.agree_on_refusal`).

        :returns: the loss averaged over the ranks.
        """
        self._snapshot.save()
        trained: list[tuple[str, torch.Tensor]] = []
        traced_params: list[torch.Tensor] = []
        traced: dict[int, str] = {}
        buckets = self._buckets
        try:
            if buckets is not None:
                # Every .grad becomes a view of its bucket; the gradient hooks start the
                # buckets' all-reduces during backward.
                buckets.arm()
            error, loss, traced, traced_params, batch = self._local_step(args, kwargs)
            unknown = [name for key, name in traced.items() if key not in self._known]
            # The buckets follow the list fixed (and checked equal on every rank) by
            # broadcast_parameters, so they line up even when ranks trace different parameters.
            # Like SVI, only parameters this step traced and differentiated are trained.
            stale = float(buckets is not None and buckets.stale)
            grads = (
                buckets.has_grad()
                if buckets is not None
                else [p.grad is not None for p in self._params.values()]
            )
            has_grad = [id(p) in traced and g for p, g in zip(self._params.values(), grads)]
            # Every rank's refusal status, loss and checksums, exchanged before any gradient is
            # used: in the last gradient bucket (overlap), else in one all-gather. A refusal on
            # any rank raises here, on every rank.
            values = [loss, len(unknown), zlib.crc32(bytes(has_grad)), stale, *batch]
            step = self.num_steps_taken
            if buckets is not None:
                # Every rank starts every bucket, even on a refusal.
                buckets.launch_remaining([*refusal_status(error), *values])
                stats = settle_refusal(
                    error, buckets.gathered(), step=step, process_group=self.process_group
                )
            else:
                stats = agree_on_refusal(error, values, step=step, process_group=self.process_group)
            rows = stats.tolist()
            if any(row[1] > 0 for row in rows):
                where = f"here: {', '.join(unknown[:5])}" if unknown else "on another rank"
                raise GuideNotInitializedError(
                    f"step {self.num_steps_taken}: parameters were created after "
                    f"DataParallelSVI was built ({where}), so the ranks did not start from the "
                    "same values. " + _HOW_TO_INIT
                )
            if any(row[4] != rows[0][4] for row in rows):
                raise ValueError(
                    f"step {step}: the ranks passed batches of different sizes (subsample size "
                    f"per rank: {[int(row[5]) for row in rows]}). Each rank scales its likelihood "
                    "by N/B_local, so the average over ranks is the estimator on the whole batch "
                    "only when every rank passes as many examples: split equal shards "
                    "(shard_indices) by the same batch size on every rank. Nothing was updated."
                )
            if any(row[2] != rows[0][2] for row in rows):
                # Data-dependent control flow left some parameters without a gradient on some
                # ranks only: a gradient on any rank makes the parameter trainable everywhere
                # (the others contribute zeros to the average).
                device = comm_device(self.process_group)
                mask = torch.tensor(has_grad, dtype=torch.float64, device=device)
                all_reduce_([mask], self.process_group)
                has_grad = (mask > 0).tolist()
            trained = [(n, p) for (n, p), g in zip(self._params.items(), has_grad) if g]
            if buckets is not None:
                # A rank that ran more backward passes than its hooks expected re-reduces.
                finite = buckets.finish(rereduce=any(row[3] > 0 for row in rows))
            else:
                finite = all_reduce_(grads_of(trained), self.process_group)
            mean_loss = float(stats[:, 0].mean())
            if not finite or not math.isfinite(mean_loss):
                self._raise_nonfinite(mean_loss, trained)
            self.optim([p for _, p in trained])
        except BaseException:
            self._snapshot.restore()
            raise
        finally:
            # Gradients never outlive the step, also when it raised: zeros where SVI leaves a
            # gradient (the parameters that have one, and the trained ones), else None.
            if buckets is None:
                zero_grads(traced_params + [p for _, p in trained])
            else:
                buckets.wait()  # no all-reduce outlives the step
                buckets.release([p for _, p in trained])
                zero_grads([p for p in traced_params if id(p) not in self._known])
        if self._buffers:
            broadcast_(self._buffers, self.process_group)
        self.num_steps_taken += 1
        if buckets is not None and not buckets.ordered:
            buckets.reorder()  # once, after the first step every rank completed
        return mean_loss

    def _local_step(self, args, kwargs):
        """This rank's loss and gradients, and its refusal (an exception, or ``None``)."""
        capture = ParamRecorder()
        try:
            with capture:
                loss = item(self.loss_and_grads(self.model, self.guide, *args, **kwargs))
            if self._buckets is not None:
                self._buckets.end_backward()  # a .grad the loss replaced is in its bucket now
        except Exception as refusal:
            # The parameters read before the loss raised: a backward pass (an earlier particle)
            # may have given them gradients, which step() zeroes.
            return refusal, float("nan"), *self._traced(capture), capture.batch()
        traced, traced_params = self._traced(capture)
        nonfinite = None
        if self._world > 1:
            # One process keeps SVI's errors; across ranks, name the rank whose values broke.
            finite = None if self._buckets is None else self._buckets.local_finite()
            named = [(traced[id(p)], p) for p in traced_params]
            nonfinite = nonfinite_refusal(loss, named, grads_finite=finite)
        return nonfinite, loss, traced, traced_params, capture.batch()

    @staticmethod
    def _traced(capture: ParamRecorder) -> tuple[dict[int, str], list[torch.Tensor]]:
        params = capture.params
        return {id(p): name for name, p in params.items()}, list(params.values())

    def _raise_nonfinite(self, mean_loss: float, named: list[tuple[str, torch.Tensor]]) -> None:
        bad = next(
            (n for n, p in named if p.grad is not None and not torch.isfinite(p.grad).all()),
            None,
        )
        where = f"; the first parameter with a non-finite gradient is {bad!r}" if bad else ""
        raise FloatingPointError(
            f"step {self.num_steps_taken}: the loss averaged over ranks is {mean_loss}{where}. "
            "Nothing was updated. Lower the learning rate, check the data for NaN/inf, or start "
            "from a smaller initial scale."
        )

    def evaluate_loss(self, *args, **kwargs) -> float:
        """The loss on this rank's batch, without gradients, averaged over the ranks. A batch
        refused on any rank raises on every rank, as in :meth:`step`."""
        self._snapshot.save()
        error, loss = None, float("nan")
        try:
            with torch.no_grad():
                loss = item(self.loss(self.model, self.guide, *args, **kwargs))
        except Exception as refusal:
            error = refusal
        try:
            stats = agree_on_refusal(
                error, [loss], step=self.num_steps_taken, process_group=self.process_group
            )
        except BaseException:
            self._snapshot.restore()
            raise
        return float(stats[:, 0].mean())
