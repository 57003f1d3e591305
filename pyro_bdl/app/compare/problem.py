"""The shared set-up of every method in the registry: data, network, minibatches, the optimiser,
the one training loop (:func:`train_loop`) and the predictive.

A :class:`Problem` is a classification problem (``dataset.num_classes`` set: a categorical model,
predictors return mean class probabilities) or a regression problem (``num_classes`` is ``None``:
a Gaussian model with the fixed observation noise ``Problem.noise``, predictors return the
predictive distribution of the targets, a ``torch.distributions.Distribution``).

Out-of-distribution inputs for the OOD figures travel in ``Problem.ood_x``. For the ArviZ export,
``compare`` needs the model and guide behind a predictor: a predictor may carry them (see
:func:`attach_posterior`); otherwise the last pair passed to :func:`predictive_probs` while the
predictor runs is used (see :func:`record_posteriors`); a predictor with neither is exported as its
mean predictive only.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI, Predictive
from pyro.optim.clipped_adam import ClippedAdam
from torch import nn
from torch.distributions import Distribution
from tqdm.auto import tqdm

from pyro_bdl import models
from pyro_bdl._validation import check_probability
from pyro_bdl.app.compare.checks import check_problem
from pyro_bdl.app.compare.networks import NETWORKS, cnn, mlp
from pyro_bdl.app.data import Dataset
from pyro_bdl.infer import FusedOptim
from pyro_bdl.nn import bayesianize, init_to_network
from pyro_bdl.priors import Normal, Prior

__all__ = [
    "NETWORKS",
    "Predictor",
    "Problem",
    "attach_posterior",
    "cnn",
    "gaussian_mixture",
    "heteroscedastic_draws",
    "init_at",
    "mlp",
    "predictive_mixture",
    "predictive_probs",
    "record_posteriors",
    "split_validation",
    "train_loop",
    "train_svi",
]

#: Maps test inputs to mean predictive class probabilities, shape (n, C), for a classification
#: problem; to the predictive distribution of the targets (batch shape (n,)) for a regression one.
Predictor = Callable[[torch.Tensor], torch.Tensor | Distribution]


def init_at(values: Mapping[str, torch.Tensor]):
    """Initialisation at given site values (e.g. a MAP's ``guide.median()``); any other site
    (such as an unobserved ``y`` when a guide traces the model for prediction) falls back to
    :func:`~pyro_bdl.init_to_network`."""

    def init(site):
        name = site["name"]
        return values[name].clone() if name in values else init_to_network(site)

    return init


@dataclass
class Problem:
    """Everything a method needs to train on the same data and network as the others.

    ``network`` names an entry of :data:`NETWORKS` or is a builder ``(input_shape, num_outputs)
    -> nn.Module``. The steps run ``epochs`` passes of ``batch_size`` rows (``batch_size >= N``:
    full batch, so ``epochs`` counts steps).
    """

    dataset: Dataset
    network: str | Callable[[tuple[int, ...], int], nn.Module] = "mlp"
    epochs: int = 30
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    num_samples: int = 32
    num_kl_samples: int = 1000
    prior: Prior = field(default_factory=lambda: Normal(scale=1.0))
    progress: bool = True
    #: Out-of-distribution inputs (same input shape), or None for no OOD figures.
    ood_x: torch.Tensor | None = None
    #: What ``ood_x`` is, for the printed report (e.g. "held-out classes 8, 9").
    ood_name: str = ""
    #: Observation noise σ of a regression problem (required when ``num_classes`` is None): the
    #: known σ under ``sigma="fixed"``, the starting value of a point estimate under ``"own"``.
    noise: float | None = None
    #: How a regression problem's methods treat σ: ``"fixed"`` (every method takes ``noise`` as
    #: known), ``"own"`` (each learns it its own way: see :meth:`bayesian_model`) or
    #: ``"heteroscedastic"`` (the network's second output is log σ²(x); ``noise`` is unused).
    sigma: str = "fixed"
    #: Site values every method starts from (e.g. a trained MAP), or None for the network's own
    #: initial weights.
    init: Mapping[str, torch.Tensor] | None = None
    #: None: Adam at ``lr``. A factor f: Pyro's ``ClippedAdam`` with the rate decayed by f over
    #: the run (for full-batch runs of many steps).
    lr_decay: float | None = None

    def __post_init__(self) -> None:
        check_problem(self)

    @property
    def num_train(self) -> int:
        return len(self.dataset.y_train)

    @property
    def is_regression(self) -> bool:
        return self.dataset.num_classes is None

    @property
    def heteroscedastic(self) -> bool:
        """A regression problem whose network gives the mean and the log-variance."""
        return self.is_regression and self.sigma == "heteroscedastic"

    @property
    def num_steps(self) -> int:
        """Optimisation steps of the whole run: ``epochs · ⌈N / batch_size⌉``."""
        return self.epochs * math.ceil(self.num_train / self.batch_size)

    def net(self) -> nn.Module:
        """A freshly initialised plain network (the same weights for every method)."""
        torch.manual_seed(self.seed)
        build = NETWORKS[self.network] if isinstance(self.network, str) else self.network
        outputs = self.dataset.num_classes or (2 if self.heteroscedastic else 1)
        return build(self.dataset.input_shape, outputs).to(self.device)

    def bayesian_model(self, noise: str = "fixed"):
        """``(bnn, model)``: the lifted network and a categorical (classification) or Gaussian
        (regression) model over it.

        :param str noise: the calling method's own way to learn σ when ``self.sigma == "own"``:
            ``"learned"`` (a latent site with the default ``LogNormal(0, 1)`` prior),
            ``"point"`` (a maximum-likelihood param starting at ``self.noise``) or ``"fixed"``
            (``self.noise`` is known; the methods that cannot learn σ). Under
            ``self.sigma == "fixed"`` every method gets ``"fixed"``.
        """
        if self.heteroscedastic:
            bnn = bayesianize(self.net(), self.prior)
            return bnn, models.heteroscedastic_regressor(bnn, self.num_train)
        if self.is_regression and self.noise is None:
            raise ValueError(
                f"dataset {self.dataset.name!r} is a regression dataset (num_classes=None), so "
                "the Problem needs its observation noise; pass Problem(..., noise=sigma)."
            )
        bnn = bayesianize(self.net(), self.prior)
        if self.noise is not None and self.is_regression:
            if self.sigma == "fixed" or noise == "fixed":
                return bnn, models.regressor(bnn, self.num_train, self.noise)
            if noise == "learned":
                return bnn, models.regressor(bnn, self.num_train, noise="learned")
            return bnn, models.regressor(bnn, self.num_train, self.noise, noise="point")
        return bnn, models.classifier(bnn, self.num_train)

    def init_loc_fn(self):
        """Where guides start: :func:`init_at` ``self.init``, else the network's own weights."""
        return init_to_network if self.init is None else init_at(self.init)

    def optimizer(self) -> pyro.optim.PyroOptim:
        """Adam at ``lr``, or ``ClippedAdam`` decaying it by ``lr_decay`` over ``num_steps``, as
        one torch optimizer over every parameter (:class:`~pyro_bdl.infer.FusedOptim`: the
        trajectory of Pyro's per-parameter optimizers, since every step trains every parameter
        here, with less work per step)."""
        if self.lr_decay is None:
            return FusedOptim(torch.optim.Adam, {"lr": self.lr})
        lrd = self.lr_decay ** (1 / max(self.num_steps, 1))
        return FusedOptim(ClippedAdam, {"lr": self.lr, "lrd": lrd})

    def predictor(self, model, guide, num_samples: int | None = None) -> Predictor:
        """The predictive of ``guide``'s draws (``num_samples``, default ``self.num_samples``):
        mean class probabilities, or the mixture of N(f_s(x), σ²) for regression."""
        s = self.num_samples if num_samples is None else num_samples
        if self.is_regression:
            # A point σ lives in Pyro's param store, which the next method clears: read it now.
            noise = model.noise_scale if model.noise != "heteroscedastic" else None
            predict = attach_posterior(
                lambda x: predictive_mixture(model, guide, x, num_samples=s, noise=noise),
                model,
                guide,
            )
            predict.noise = noise  # type: ignore[attr-defined]
            return predict
        return attach_posterior(
            lambda x: predictive_probs(model, guide, x, num_samples=s), model, guide
        )

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The shuffled minibatches of one epoch (the order depends only on seed and epoch)."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(self.num_train, generator=g)
        x, y = self.dataset.x_train, self.dataset.y_train
        for start in range(0, self.num_train, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield x[idx].to(self.device), y[idx].to(self.device)

    def epoch_bar(self, desc: str):
        return tqdm(
            range(self.epochs),
            desc=f"{desc:>12}",
            disable=not self.progress,
            file=sys.stderr,
            leave=True,
            dynamic_ncols=True,
        )


def train_loop(
    problem: Problem,
    step: Callable[[torch.Tensor, torch.Tensor], float],
    desc: str,
    *,
    on_epoch: Callable[[int], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    status: Callable[[], Mapping[str, object]] | None = None,
) -> list[float]:
    """The training loop of every method: ``problem.epochs`` epochs of ``step(x, y) -> loss``
    over :meth:`Problem.batches`, with a progress bar; returns the per-epoch losses per example.

    :param on_epoch: called with the epoch number before its first step (e.g. to switch phase).
    :param on_step: called with the running step count (from 1) after each step (e.g. to collect
        a snapshot or step a learning-rate schedule).
    :param status: extra figures for the progress bar, read after each epoch.
    """
    losses = []
    bar = problem.epoch_bar(desc)
    count = 0
    for epoch in bar:
        if on_epoch is not None:
            on_epoch(epoch)
        total = 0.0
        for x, y in problem.batches(epoch):
            try:
                loss = float(step(x, y))
            except Exception as err:
                err.add_note(_where_training_failed(problem, desc, epoch, count + 1, err))
                raise
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"{desc.strip()}: the loss is {loss} at step {count + 1} (epoch {epoch + 1} "
                    f"of {problem.epochs}), so training diverged; lower the learning rate "
                    f"(lr={problem.lr:g}; pyro-bdl compare --lr) or check the data."
                )
            total += loss
            count += 1
            if on_step is not None:
                on_step(count)
        losses.append(total / problem.num_train)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", **(status() if status is not None else {}))
    return losses


#: Parameters past this magnitude mean training diverged: network weights stay O(1) to O(100),
#: and float32 products of two weights past 1e19 overflow to inf, giving NaN logits.
_DIVERGED = 1e8
#: The Gaussian likelihood's refusal of a σ that an earlier step made inf, NaN or 0
#: (``pyro_bdl.models.noise.check_likelihood_range``). Raised after the first step it means
#: training diverged even with moderate weights: a heteroscedastic network's log-variance output
#: of a few hundred already overflows exp.
_SIGMA_OUT_OF_RANGE = "drove it out of range"


def _where_training_failed(
    problem: Problem, desc: str, epoch: int, step: int, err: BaseException
) -> str:
    """Where a step raised, and whether training had diverged by then: a huge or NaN parameter
    (it makes Pyro's distribution checks fail with an error that does not say why), or, after
    the first step, a likelihood σ driven out of range."""
    where = f"while training {desc.strip()}: epoch {epoch + 1} of {problem.epochs}, step {step}"
    if step > 1 and isinstance(err, ValueError) and _SIGMA_OUT_OF_RANGE in str(err):
        return where + (
            f"; an earlier step drove the likelihood's σ out of range, so training diverged: "
            f"lower the learning rate (lr={problem.lr:g}; pyro-bdl compare --lr)"
        )
    largest = max(
        (
            float(value.detach().abs().max())
            for value in pyro.get_param_store().values()
            if value.is_floating_point() and value.numel() > 0
        ),
        default=0.0,
    )
    if not largest <= _DIVERGED:  # NaN fails the comparison too
        where += (
            f"; the parameters reach {largest:.3g} in magnitude, so training diverged: lower "
            f"the learning rate (lr={problem.lr:g}; pyro-bdl compare --lr)"
        )
    return where


def train_svi(problem: Problem, svi: SVI, desc: str) -> list[float]:
    """Run ``svi`` for ``problem.epochs`` epochs (:func:`train_loop`); returns per-epoch losses."""
    return train_loop(problem, svi.step, desc)


def attach_posterior(predict: Predictor, model, guide) -> Predictor:
    """Mark ``predict`` as backed by ``model`` and ``guide`` so that ``compare`` exports their
    posterior draws to ArviZ (for predictors that do not go through :func:`predictive_probs`,
    such as a linearized or BatchNorm-refreshing predictive); returns ``predict``.

    Usage::

        return attach_posterior(lambda x: guide.predict(x), model, guide)
    """
    predict.model = model  # type: ignore[attr-defined]
    predict.guide = guide  # type: ignore[attr-defined]
    return predict


#: While :func:`record_posteriors` is active: the (model, guide) pairs predictive_probs saw.
_SEEN: ContextVar[list | None] = ContextVar("pyro_bdl_seen_posteriors", default=None)


@contextmanager
def record_posteriors():
    """Collect the ``(model, guide)`` pairs that :func:`predictive_probs` and
    :func:`predictive_mixture` use inside the block
    (how ``compare`` finds what to export for predictors built on it)."""
    seen: list = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


@torch.no_grad()
def predictive_probs(model, guide, x: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Mean of softmax(logits) over ``num_samples`` posterior draws (``model`` returns logits)."""
    seen = _SEEN.get()
    if seen is not None:
        seen.append((model, guide))
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])
    logits = predictive(x)["_RETURN"]
    return logits.softmax(-1).mean(0)


@torch.no_grad()
def predictive_mixture(model, guide, x: torch.Tensor, num_samples: int, noise=None):
    """The equal-weight mixture of N(f_s(x), σ_s²) over ``num_samples`` posterior draws of a
    :func:`~pyro_bdl.models.regressor`: σ_s is the guide's draw of a learned σ (site
    ``"sigma"``), else ``noise`` (default: the model's fixed or point σ); batch shape (n,)."""
    seen = _SEEN.get()
    if seen is not None:
        seen.append((model, guide))
    learned = getattr(model, "noise", None) == "learned"
    sites = ["_RETURN", "sigma"] if learned else ["_RETURN"]
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=sites)
    draws = predictive(x)
    if getattr(model, "noise", None) == "heteroscedastic":
        return gaussian_mixture(*heteroscedastic_draws(model, draws["_RETURN"]))
    f = draws["_RETURN"].reshape(num_samples, -1).T  # (n, S)
    if learned:
        scale = draws["sigma"].reshape(1, num_samples).expand_as(f)
    else:
        scale = float(model.noise_scale if noise is None else noise)
    return gaussian_mixture(f, scale)


def heteroscedastic_draws(model, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, σ)``, each (n, S), from a heteroscedastic regressor's outputs of S draws,
    ``out`` of shape (S, n, 2) (or whatever the model's ``split`` reads)."""
    split = model.split or models.mean_log_variance
    means, scales = [], []
    for draw in out:
        mean, log_var = split(draw)
        means.append(mean.reshape(-1))
        scales.append((0.5 * log_var.reshape(-1)).exp())
    return torch.stack(means, -1), torch.stack(scales, -1)


def gaussian_mixture(f: torch.Tensor, scale) -> Distribution:
    """The equal-weight mixture of N(f[:, s], scale[:, s]) over the columns s of ``f`` (n, S);
    ``scale`` a number or a tensor like ``f``; batch shape (n,)."""
    components = torch.distributions.Normal(f, scale)
    weights = torch.distributions.Categorical(logits=torch.zeros_like(f))
    return torch.distributions.MixtureSameFamily(weights, components)


def seed_everything(seed: int) -> None:
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()


def split_validation(
    problem: Problem, fraction: float = 0.1
) -> tuple[Problem, torch.Tensor, torch.Tensor]:
    """``(the problem on the other training rows, x_val, y_val)``: a validation subset of
    ``round(fraction · N)`` training rows (at least one), drawn with ``problem.seed``.

    For methods that tune something on held-out data (never the test set). The rows are those
    that ``subnet_laplace`` holds out at the same fraction and seed, so methods tuned this way
    train on the same examples.

    Usage::

        train_problem, x_val, y_val = split_validation(problem)
    """
    check_probability("fraction", fraction)
    data = problem.dataset
    g = torch.Generator().manual_seed(problem.seed)
    order = torch.randperm(len(data.y_train), generator=g)
    n_val = max(1, round(fraction * len(order)))
    if n_val >= len(order):
        raise ValueError(
            f"fraction={fraction} of {len(order)} training rows leaves none to train on; "
            "use a smaller fraction or more training data."
        )
    val, train = order[:n_val], order[n_val:]
    dataset = dataclasses.replace(data, x_train=data.x_train[train], y_train=data.y_train[train])
    return dataclasses.replace(problem, dataset=dataset), data.x_train[val], data.y_train[val]
