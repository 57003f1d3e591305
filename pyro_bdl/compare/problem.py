"""The shared set-up of ``pyro-bdl compare``: data, network, minibatches and training loops.

Out-of-distribution inputs for the OOD figures travel in ``Problem.ood_x``. For the ArviZ export,
``compare`` needs the model and guide behind a predictor: a predictor may carry them (see
:func:`attach_posterior`); otherwise the last pair passed to :func:`predictive_probs` while the
predictor runs is used (see :func:`record_posteriors`); a predictor with neither is exported as its
mean predictive only.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import SVI, Predictive
from torch import nn
from tqdm.auto import tqdm

from pyro_bdl import models
from pyro_bdl._validation import check_probability
from pyro_bdl.data import Dataset
from pyro_bdl.nn import bayesianize
from pyro_bdl.priors import Normal, Prior

__all__ = [
    "NETWORKS",
    "Predictor",
    "Problem",
    "attach_posterior",
    "predictive_probs",
    "record_posteriors",
    "split_validation",
    "train_svi",
]

#: Maps test inputs to mean predictive class probabilities, shape (n, C).
Predictor = Callable[[torch.Tensor], torch.Tensor]


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 100) -> nn.Module:
    """Two hidden ReLU layers."""
    d = 1
    for s in input_shape:
        d *= s
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def cnn(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """Two 3×3 convolutions with BatchNorm, global average pooling and a linear head."""
    c = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )


NETWORKS = {"mlp": mlp, "cnn": cnn}


@dataclass
class Problem:
    """Everything a method needs to train on the same data and network as the others."""

    dataset: Dataset
    network: str = "mlp"
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

    @property
    def num_train(self) -> int:
        return len(self.dataset.y_train)

    def net(self) -> nn.Module:
        """A freshly initialised plain network (the same weights for every method)."""
        torch.manual_seed(self.seed)
        assert self.dataset.num_classes is not None
        build = NETWORKS[self.network]
        return build(self.dataset.input_shape, self.dataset.num_classes).to(self.device)

    def bayesian_model(self):
        """``(bnn, model)``: the lifted network and a categorical model over it."""
        bnn = bayesianize(self.net(), self.prior)
        return bnn, models.classifier(bnn, self.num_train)

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


def train_svi(problem: Problem, svi: SVI, desc: str) -> list[float]:
    """Run ``svi`` for ``problem.epochs`` epochs with a progress bar; returns per-epoch losses."""
    losses = []
    bar = problem.epoch_bar(desc)
    for epoch in bar:
        total = 0.0
        for x, y in problem.batches(epoch):
            total += svi.step(x, y)
        losses.append(total / problem.num_train)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


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
    """Collect the ``(model, guide)`` pairs that :func:`predictive_probs` uses inside the block
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
