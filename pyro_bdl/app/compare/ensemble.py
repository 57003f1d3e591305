"""Deep ensembles and MultiSWAG for ``pyro-bdl compare`` and the benchmarks.

``ensemble`` trains M MAP networks exactly as ``map`` trains one, member k under the seed
``problem.seed + k`` (its own initial weights and minibatch order); ``multiswag`` runs ``swag``'s
whole schedule M times the same way, or, given trained members (``starts``, e.g. a deep ensemble's:
``fit_ensemble``'s ``member_values``), only its SWAG phase from each of them, the MultiSWAG of
Wilson & Izmailov (2020): SWAG from several independently trained solutions. Their predictive is
the exact equal-weight mixture of the members' predictives, each member evaluated with its own
network (its own BatchNorm statistics, refreshed per draw for MultiSWAG as ``swag`` does): mean
class probabilities over members for classification, the mixture of N(f(x), σ²) over every member's
draws for regression. The posterior exported to ArviZ is :class:`~pyro_bdl.guides.AutoEnsemble` /
:class:`~pyro_bdl.guides.AutoMultiSWAG` over the first member's model.

References:
    Lakshminarayanan, Pritzel & Blundell, "Simple and Scalable Predictive Uncertainty
    Estimation using Deep Ensembles", NeurIPS 2017.
    Wilson & Izmailov, "Bayesian Deep Learning and a Probabilistic Perspective of
    Generalization", NeurIPS 2020.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from pyro.infer import Predictive

from pyro_bdl._validation import check_positive_int
from pyro_bdl.app.compare.checks import MAX_SEED
from pyro_bdl.app.compare.map import train_map
from pyro_bdl.app.compare.problem import (
    Predictor,
    Problem,
    attach_posterior,
    gaussian_mixture,
    heteroscedastic_draws,
    predictive_probs,
    seed_everything,
)
from pyro_bdl.app.compare.recovery import retry_lower
from pyro_bdl.app.compare.swag import BN_FRACTION, RANK, SGD_LR, SWA_LR, data_scaled, train_swag
from pyro_bdl.guides import AutoEnsemble, AutoMultiSWAG, AutoSWAG
from pyro_bdl.guides.batchnorm import predict_with_bn_refresh
from pyro_bdl.guides.ensemble import MemberGuide

__all__ = ["ENSEMBLE_SIZE", "fit_ensemble", "fit_multiswag"]

#: M, the number of members (the deep-ensembles paper's choice).
ENSEMBLE_SIZE = 5

#: One member: (lifted network, model).
Member = tuple[torch.nn.Module, Callable]


def _member_problems(problem: Problem, num_members: int):
    """Member k's problem (seed ``problem.seed + k``), with Pyro's RNG and parameter store reset
    so every member trains from scratch."""
    check_positive_int("num_members", num_members)
    for k in range(num_members):
        seed = (problem.seed + k) % (MAX_SEED + 1)
        seed_everything(seed)
        yield k, dataclasses.replace(problem, seed=seed)


def _set_up(guide, problem: Problem):
    """Set ``guide`` up on the model's sites (two training rows, as every autoguide needs)."""
    x, y = problem.dataset.x_train[:2], problem.dataset.y_train[:2]
    with torch.no_grad():
        guide(x.to(problem.device), y.to(problem.device))
    return guide


def _regression_outputs(model, guide, x: torch.Tensor, num_samples: int):
    """``(mean, σ)`` of ``num_samples`` draws of one member, each (n, num_samples): σ the
    model's fixed or point σ, or the network's σ(x) for a heteroscedastic regressor."""
    predictive = Predictive(model, guide=guide, num_samples=num_samples, return_sites=["_RETURN"])
    out = predictive(x)["_RETURN"]
    if model.noise == "heteroscedastic":
        return heteroscedastic_draws(model, out)
    f = out.reshape(num_samples, -1).T
    return f, torch.full_like(f, float(model.noise_scale))


def mixture_predictor(
    problem: Problem,
    members: list[Member],
    posterior: MemberGuide,
    num_samples: int,
    member_probs: Callable[[int, torch.Tensor], torch.Tensor],
) -> Predictor:
    """The equal-weight mixture of the members' predictives, marked with ``posterior`` (the
    combined guide, over member 0's model) for the ArviZ export. Member k's draws come from
    ``posterior.use_member(k)`` through member k's own model.

    :param int num_samples: draws per member (regression).
    :param member_probs: member k's mean class probabilities at x (classification).
    """
    model0 = members[0][1]
    if problem.is_regression:

        @torch.no_grad()
        def predict(x):
            means, scales = [], []
            for k, (_, model) in enumerate(members):
                with posterior.use_member(k):
                    mean, scale = _regression_outputs(model, posterior, x, num_samples)
                means.append(mean)
                scales.append(scale)
            # (n, M · num_samples): every member's draws, each its own σ.
            return gaussian_mixture(torch.cat(means, -1), torch.cat(scales, -1))

    else:

        @torch.no_grad()
        def predict(x):
            return torch.stack([member_probs(k, x) for k in range(len(members))]).mean(0)

    return attach_posterior(predict, model0, posterior)


def fit_ensemble(
    problem: Problem, *, num_members: int = ENSEMBLE_SIZE, adversarial: float | None = None
) -> Predictor:
    """A deep ensemble of ``num_members`` MAP networks (each trained as ``map`` trains one, from
    its own initial weights and minibatch order); ``adversarial`` = ε adds the paper's
    adversarial training (:func:`~pyro_bdl.app.compare.map.train_map`; ε = 0.01 there). On a
    heteroscedastic problem this is the deep-ensembles recipe: M mean-and-variance networks
    trained by the Gaussian NLL, a proper scoring rule. The predictor's ``member_values`` are
    the members' trained site values (``starts`` of :func:`fit_multiswag`)."""
    members: list[Member] = []
    values = []
    for k, member in _member_problems(problem, num_members):
        desc = f"ensemble {k + 1}/{num_members}"
        bnn, model, guide = train_map(member, desc=desc, adversarial=adversarial)
        members.append((bnn, model))
        values.append(guide.median())  # now: the next member's training reuses the store names
    posterior = _set_up(AutoEnsemble(members[0][1], values), problem)

    def member_probs(k: int, x: torch.Tensor) -> torch.Tensor:
        with posterior.use_member(k):
            return predictive_probs(members[k][1], posterior, x, num_samples=1)

    predict = mixture_predictor(problem, members, posterior, 1, member_probs)
    predict.member_values = values  # type: ignore[attr-defined]
    return predict


def fit_multiswag(
    problem: Problem,
    *,
    num_members: int = ENSEMBLE_SIZE,
    swa_lr: float = SWA_LR,
    sgd_lr: float = SGD_LR,
    optimizer: str = "sgd",
    starts: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> Predictor:
    """MultiSWAG: ``num_members`` SWAG runs (``swag``'s schedule each, SGD-phase per-example rate
    ``sgd_lr`` and SWAG-phase rate ``swa_lr`` with ``optimizer``), drawing
    ⌈``problem.num_samples`` / M⌉ weights from every member.

    :param starts: member k's trained site values (one mapping per member, e.g. a deep
        ensemble's ``member_values``): member k then runs only the SWAG phase, every epoch,
        from ``starts[k]``, as ``swag`` does from a trained point estimate (``Problem.init``);
        None: every member trains from its own initial weights first.

    The SGD rates are scaled to the data (:func:`~pyro_bdl.app.compare.swag.data_scaled`), and a
    member that diverges is trained again from scratch at a lower rate
    (:func:`~pyro_bdl.app.compare.recovery.retry_lower`); the predictor's ``notes`` list every
    such retry and ``rates`` each member's SGD rate (none when no step reads it: Adam from
    ``starts``)."""
    members: list[Member] = []
    guides: list[AutoSWAG] = []
    notes: list[str] = []
    rates: list[float] = []
    if starts is not None and len(starts) != num_members:
        raise ValueError(
            f"starts holds {len(starts)} members' values but num_members={num_members}; pass "
            "one trained member per MultiSWAG member (or num_members=len(starts))."
        )
    sgd = data_scaled(problem, sgd_lr)
    for k, member in _member_problems(problem, num_members):
        desc = f"multiswag {k + 1}/{num_members}"
        if starts is not None:  # the SWAG phase only, from the trained member
            member = dataclasses.replace(member, init=starts[k])

        def attempt(rate: float, member: Problem = member, desc: str = desc):
            seed_everything(member.seed)
            bnn, model = member.bayesian_model(noise="point")  # σ as swag learns it
            guide = AutoSWAG(model, rank=RANK, init_loc_fn=member.init_loc_fn())
            # The SWAG phase's rate follows the SGD phase's down (an SGD rate is per example).
            swa = swa_lr * rate / sgd_lr if optimizer == "sgd" else swa_lr
            train_swag(member, guide, model, desc, swa_lr=swa, optimizer=optimizer, sgd_lr=rate)
            return bnn, model, guide

        (bnn, model, guide), rate = retry_lower(attempt, sgd, desc, notes)
        members.append((bnn, model))
        guides.append(guide)
        if starts is None or optimizer == "sgd":  # else no step reads the SGD rate
            rates.append(rate)
    per_member = math.ceil(problem.num_samples / num_members)
    x_train = problem.dataset.x_train.to(problem.device)

    def member_probs(k: int, x: torch.Tensor) -> torch.Tensor:
        # The SWAG draws read the member's statistics (buffers, not the parameter store).
        return predict_with_bn_refresh(
            guides[k],
            members[k][0],
            x,
            num_samples=per_member,
            bn_data=x_train,
            bn_fraction=BN_FRACTION,
        )

    posterior = _set_up(AutoMultiSWAG(members[0][1], guides), problem)
    predict = mixture_predictor(problem, members, posterior, per_member, member_probs)
    predict.notes = notes  # type: ignore[attr-defined]
    predict.rates = rates  # type: ignore[attr-defined]
    return predict
