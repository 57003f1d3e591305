"""MC dropout (Gal & Ghahramani 2016), the registry's ``mc_dropout`` baseline.

The problem's network with ``nn.Dropout(p)`` inserted before every ``nn.Linear`` (as in the
MC-dropout UCI code: on the inputs and on each hidden layer), trained as a point estimate with
the paper's weight decay and used for prediction with dropout ON: the predictive is the
equal-weight mixture over S dropout masks (``problem.num_samples``) — N(f_s(x), σ²) for
regression with the problem's known σ (or N(μ_s(x), σ_s(x)²) from the network's log-variance
output on a heteroscedastic problem), mean class probabilities for classification.

The weight decay follows the paper's prior length-scale formula: dropout with rate p and a prior
length-scale l make the per-example objective the NLL plus l²(1 − p)/(2N)·‖θ‖². Here l is the
problem's Normal prior precision, l = 1/scale (the penalty a MAP under the same prior pays,
shrunk by 1 − p for the weights dropout already regularises), so MC dropout and ``map`` share
their prior. Without ``rate`` the rate is chosen from ``RATES`` (the MC-dropout code's grid) by
the held-out log-likelihood (of the targets, or of the true classes) on a validation split of
the training rows (:func:`~pyro_bdl.app.compare.problem.split_validation`), then the network is
retrained on every training row at that rate.

The optimiser is Adam at ``problem.lr``, decayed by ``problem.lr_decay`` over the run when set,
for ``problem.epochs`` epochs of :meth:`Problem.batches`: the same loop as every other method.

References:
    Gal & Ghahramani, "Dropout as a Bayesian Approximation: Representing Model Uncertainty in
    Deep Learning", ICML 2016.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pyro_bdl._validation import check_positive, check_probability
from pyro_bdl.app.compare.problem import (
    Predictor,
    Problem,
    gaussian_mixture,
    split_validation,
    train_loop,
)
from pyro_bdl.models import mean_log_variance

__all__ = ["RATES", "VALIDATION_FRACTION", "fit_mc_dropout", "with_dropout"]

#: The dropout rates tried when none is given (the MC-dropout UCI code's grid).
RATES: tuple[float, ...] = (0.005, 0.01, 0.05, 0.1)
#: The share of training rows held out to choose the rate.
VALIDATION_FRACTION = 0.2


def with_dropout(net: nn.Module, rate: float) -> nn.Module:
    """``net`` with ``nn.Dropout(rate)`` before every ``nn.Linear`` (recursively inside
    ``nn.Sequential`` containers); other containers are left as they are."""
    if isinstance(net, nn.Linear):
        return nn.Sequential(nn.Dropout(rate), net)
    if isinstance(net, nn.Sequential):
        layers: list[nn.Module] = []
        for layer in net:
            if isinstance(layer, nn.Linear):
                layers += [nn.Dropout(rate), layer]
            else:
                layers.append(with_dropout(layer, rate))
        return nn.Sequential(*layers)
    return net


def _prior_precision(problem: Problem, length_scale: float | None) -> float:
    """l²: the given length-scale squared, else the problem's Normal prior precision."""
    if length_scale is not None:
        check_positive("length_scale", length_scale)
        return float(length_scale) ** 2
    scale = getattr(problem.prior, "scale", None)
    if not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(
            f"mc_dropout reads its prior length-scale from a Normal prior's scale, but the "
            f"problem's prior is {problem.prior!r}; pass fit_mc_dropout(..., length_scale=l)."
        )
    return 1.0 / float(scale) ** 2


def _nll(net: nn.Module, problem: Problem, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed negative log-likelihood of the rows under one dropout mask."""
    out = net(x)
    if not problem.is_regression:
        return nn.functional.cross_entropy(out, y, reduction="sum")
    mean, scale = _mean_scale(problem, out)
    return -torch.distributions.Normal(mean, scale).log_prob(y).sum()


def _mean_scale(problem: Problem, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian's mean and σ from a regression network's outputs (..., n, outputs): σ(x)
    from the log-variance column of a heteroscedastic problem, else the problem's σ."""
    if problem.heteroscedastic:
        mean, log_var = mean_log_variance(out.reshape(-1, 2))
        shape = out.shape[:-1]
        return mean.reshape(shape), (0.5 * log_var).exp().reshape(shape)
    mean = out.squeeze(-1)
    return mean, torch.full_like(mean, float(problem.noise))  # type: ignore[arg-type]


def train_dropout(problem: Problem, rate: float, length_scale: float | None = None) -> nn.Module:
    """The network of ``problem`` with dropout ``rate``, trained on its training rows."""
    check_probability("rate", rate, open_interval=False)
    if problem.is_regression and not problem.heteroscedastic and problem.noise is None:
        raise ValueError(
            f"dataset {problem.dataset.name!r} is a regression dataset, so mc_dropout needs its "
            "observation noise; pass Problem(..., noise=sigma)."
        )
    decay = _prior_precision(problem, length_scale) * (1.0 - rate) / 2.0
    net = with_dropout(problem.net(), rate)
    optimizer = torch.optim.Adam(net.parameters(), lr=problem.lr)
    gamma = 1.0 if problem.lr_decay is None else problem.lr_decay ** (1 / problem.num_steps)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma)
    scale = problem.num_train

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        # The batch's share of the objective Σ_n NLL_n + l²(1 − p)/2 ‖θ‖² (Gal & Ghahramani).
        penalty = sum(p.square().sum() for p in net.parameters())
        loss = _nll(net, problem, x, y) + decay * penalty * len(y) / scale
        loss.backward()
        optimizer.step()
        schedule.step()
        return float(loss.detach())

    net.train()
    train_loop(problem, step, f"mc_dropout p={rate:g}")
    return net


def _masked(net: nn.Module) -> nn.Module:
    """``net`` in evaluation mode but for its dropout layers (MC dropout's sampling mode)."""
    net.eval()
    for module in net.modules():
        if isinstance(module, nn.Dropout):
            module.train()
    return net


def dropout_predictor(problem: Problem, net: nn.Module, num_samples: int) -> Predictor:
    """The predictive over ``num_samples`` dropout masks of the trained ``net``."""
    _masked(net)

    @torch.no_grad()
    def predict(x: torch.Tensor):
        x = x.to(problem.device)
        outs = torch.stack([net(x) for _ in range(num_samples)])  # (S, n, outputs)
        if not problem.is_regression:
            return outs.softmax(-1).mean(0)
        mean, scale = _mean_scale(problem, outs)  # (S, n) each
        return gaussian_mixture(mean.T, scale.T)

    return predict


def _validation_score(predict: Predictor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean held-out log-likelihood of the predictive (higher is better)."""
    out = predict(x)
    if isinstance(out, torch.distributions.Distribution):
        return float(out.log_prob(y).mean())
    return float(out.clamp_min(1e-12).log().gather(1, y.view(-1, 1)).mean())


def fit_mc_dropout(
    problem: Problem,
    *,
    rate: float | None = None,
    rates: tuple[float, ...] = RATES,
    length_scale: float | None = None,
) -> Predictor:
    """MC dropout at ``rate``, or at the rate of ``rates`` best on a validation split of the
    training rows (then retrained on all of them; a single rate is taken as given); the
    predictor's ``rate`` is the rate used and ``validation`` the held-out log-likelihood per
    rate tried.

    :param rate: the dropout probability, in [0, 1); None to choose it from ``rates``.
    :param rates: the rates tried when ``rate`` is None.
    :param length_scale: the prior length-scale l (default: 1 / the Normal prior's scale).
    """
    tried: dict[float, float] = {}
    if rate is None:
        if not rates:
            raise ValueError("rates must name at least one dropout rate; got an empty tuple.")
        for r in rates:
            check_probability("rates", r, open_interval=False)
    if rate is None and len(rates) == 1:  # nothing to choose between
        rate = rates[0]
    if rate is None:
        held, x_val, y_val = split_validation(problem, VALIDATION_FRACTION)
        for r in rates:
            net = train_dropout(held, r, length_scale)
            score = _validation_score(
                dropout_predictor(held, net, problem.num_samples), x_val, y_val
            )
            tried[r] = score if math.isfinite(score) else -math.inf
        rate = max(tried, key=tried.__getitem__)
    check_probability("rate", rate, open_interval=False)
    net = train_dropout(problem, rate, length_scale)
    predict = dropout_predictor(problem, net, problem.num_samples)
    predict.rate = rate  # type: ignore[attr-defined]
    predict.validation = tried  # type: ignore[attr-defined]
    return predict
