r"""The Laplace marginal likelihood of a fitted Laplace guide, and the search over the prior
precision λ (one value, per layer or per weight) and the Gaussian noise σ: by gradient or on a
grid of the evidence, or on a grid of the validation log-likelihood (docs/design/laplace.md).

At the MAP :math:`\theta^*` with the GGN :math:`G` (computed at the model's σ₀), a Gaussian prior
of precision :math:`\lambda` per subnetwork weight and noise σ (Gaussian likelihood),

.. math:: \log p(\mathcal D) \approx \log p(\mathcal D\mid\theta^*, \sigma)
          - \tfrac12 \textstyle\sum_i \lambda_i\theta_i^{*2} + \tfrac12\sum_i\log\lambda_i
          - \tfrac12 \log\det(c\,G + \mathrm{diag}\,\lambda), \qquad c = \sigma_0^2/\sigma^2,

where the fit term is re-evaluated at :math:`\theta^*` (for a Gaussian likelihood
:math:`-\tfrac m2\log 2\pi\sigma^2 - \mathrm{SSE}/2\sigma^2` over m outputs; for a
heteroscedastic one, whose GGN is its Fisher, :math:`\sum_n \log N(y_n; \mu_n, \sigma_n^2)`
with c = 1, σ(x) being the network's) and the
:math:`2\pi` of the two Gaussians cancel (Immer et al. 2021, eq. 4 with the GGN). The
log-determinant comes from the posterior structure (:mod:`~pyro_bdl.guides.laplace.posterior`).

:func:`optimize_marglik` maximises it over log λ and log σ with L-BFGS (strong Wolfe line search)
in float64; at the optimum the gradient vanishes, which for one λ and σ are MacKay's fixed-point
conditions :math:`\lambda\lVert\theta^*\rVert^2 = \gamma` and :math:`\sigma^2 =
\mathrm{SSE}/(m-\gamma)`, :math:`\gamma = \sum_k c e_k/(c e_k + \lambda)`.

:func:`tune_grid` searches one λ on a log grid. With :math:`G = U\,\mathrm{diag}(e)\,U^\top`, the
dense posterior covariance at an isotropic λ is :math:`U\,\mathrm{diag}(1/(e+\lambda))U^\top`, so
the variance of a linearized output :math:`J_S\Sigma_S J_S^\top` is
:math:`\sum_k (J_S U)_k^2 / (e_k + \lambda)`: one eigendecomposition (:func:`eigenbasis`) makes
every grid value cost O(n·C·S) for a validation set of n points (:func:`val_ll_score`), and the
evidence O(S) (the eigenvalues as a :class:`~pyro_bdl.guides.laplace.posterior.DiagPosterior`).

Usage::

    evals, evecs = eigenbasis(ggn)
    score = val_ll_score(parts, "categorical", None, evals, evecs, ratio=S / D)
    best = tune_grid(score, default_grid(None))

References:
    Immer et al., "Scalable Marginal Likelihood Estimation for Model Selection in Deep
    Learning", ICML 2021.
    MacKay, "Bayesian Interpolation", Neural Computation 1992.
    Daxberger et al., "Bayesian Deep Learning via Subnetwork Inference", ICML 2021.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import pyro.distributions as dist
import torch

from pyro_bdl._caller import user_stacklevel
from pyro_bdl._validation import check_choice, check_positive, check_positive_int
from pyro_bdl.curvature.ggn import Split, mean_and_log_variance
from pyro_bdl.guides.laplace.predictive import (
    output_variance,
    predictive_log_likelihood,
    standard_draws,
)
from pyro_bdl.layout import SiteLayout

__all__ = [
    "PRIOR_STRUCTURES",
    "SEARCHES",
    "SEARCH_RANGE",
    "PriorPrecisionBoundWarning",
    "default_grid",
    "eigenbasis",
    "evidence",
    "fit_statistics",
    "layer_groups",
    "marglik_score",
    "optimize_marglik",
    "structure_val_ll_score",
    "tune_grid",
    "tuning_search",
    "val_ll_score",
]

#: Granularity of the optimised prior precision.
PRIOR_STRUCTURES = ("scalar", "layerwise", "diagonal")
#: How ``tune_prior_precision`` searches.
SEARCHES = ("gradient", "grid")
#: The prior precisions the gradient search can call a maximum: four decades beyond the default
#: grid on each side. A prior standard deviation of 10⁴ no longer constrains a weight and one of
#: 10⁻⁴ pins it, so a λ past them is the search running off towards 0 or ∞, not an optimum.
SEARCH_RANGE = (1e-8, 1e8)


class PriorPrecisionBoundWarning(UserWarning):
    """A prior precision search ended at a bound (the edge of its grid, or past
    :data:`SEARCH_RANGE` by gradient): the score rises towards it with no maximum inside, so the
    λ returned is where the search stopped, not the data's choice."""


def _warn_at_bound(where: str, upper: bool, fix: str) -> None:
    """Warn, at the user's line, that a λ search ended at its ``upper`` (else lower) bound, as
    ``where`` says."""
    meaning = (
        "the data prefer the MAP limit (almost no posterior width)"
        if upper
        else "the data prefer the widest posterior the search allows"
    )
    warnings.warn(
        f"{where}: {meaning}; {fix}",
        PriorPrecisionBoundWarning,
        stacklevel=user_stacklevel(),
    )


def tuning_search(
    method: str,
    search: str | None,
    *,
    grid,
    data,
    prior_structure: str,
    tune_noise: bool,
    max_iter: int,
    likelihood: str,
    hessian_structure: str,
) -> str:
    """The search a guide's ``tune_prior_precision`` runs for these arguments (``"grid"`` when
    ``search`` is ``None`` and a grid or ``method="val_ll"`` asks for one, else
    ``"gradient"``), after refusing the combinations it cannot run; ``likelihood`` and
    ``hessian_structure`` are the fitted guide's."""
    check_choice("method", method, ("marglik", "val_ll"))
    search = search or ("grid" if grid is not None or method == "val_ll" else "gradient")
    check_choice("search", search, SEARCHES)
    check_choice("prior_structure", prior_structure, PRIOR_STRUCTURES)
    check_positive_int("max_iter", max_iter)
    if method == "val_ll" and data is None:
        raise ValueError("method='val_ll' needs validation data (x, y); pass data=.")
    if search == "gradient" and method != "marglik":
        raise ValueError(
            "search='gradient' optimises the marginal likelihood; use "
            "method='marglik', or search='grid' for method='val_ll'."
        )
    if search == "grid" and (prior_structure != "scalar" or tune_noise):
        raise ValueError(
            "search='grid' tunes one prior precision; use search='gradient' for "
            f"prior_structure={prior_structure!r} or tune_noise=True."
        )
    if tune_noise and likelihood != "gaussian":
        raise ValueError(
            "tune_noise=True needs a Gaussian likelihood with one σ; this model's is "
            f"{likelihood!r}"
            + (
                ", whose σ(x) comes from the network (its posterior covers it); drop tune_noise."
                if likelihood == "heteroscedastic"
                else "."
            )
        )
    if prior_structure == "diagonal" and hessian_structure == "kron":
        raise ValueError(
            "prior_structure='diagonal' cannot be added exactly to Kronecker factors; use "
            "'scalar' or 'layerwise', or hessian_structure='diag' or 'full'."
        )
    return search


def fit_statistics(
    out: torch.Tensor, y: torch.Tensor, likelihood: str, noise, split: Split | None = None
) -> torch.Tensor:
    r"""``[rows, outputs, SSE, log-likelihood]`` (float64) of a batch at the MAP, which batches
    and data-parallel ranks add: the outputs ``out`` (B, C) and targets ``y`` (a heteroscedastic
    Gaussian reads its mean and log-variance from ``out`` by ``split``; its outputs count the
    targets)."""
    out = out.detach().double()
    count = out.numel()
    if likelihood == "heteroscedastic":
        assert split is not None
        mean, log_var = mean_and_log_variance(out, split)
        target = y.double().reshape(mean.shape)
        sse = (target - mean).square().sum()
        ll = dist.Normal(mean, (0.5 * log_var).exp()).log_prob(target).sum()
        count = mean.numel()
    elif likelihood == "gaussian":
        r = out - y.double().reshape(out.shape)
        sse = r.square().sum()
        ll = -0.5 * out.numel() * math.log(2 * math.pi * noise**2) - sse / (2 * noise**2)
    elif likelihood == "bernoulli":
        sse = out.new_zeros(())
        ll = dist.Bernoulli(logits=out).log_prob(y.double().reshape(out.shape)).sum()
    else:
        sse = out.new_zeros(())
        ll = dist.Categorical(logits=out).log_prob(y.reshape(-1)).sum()
    rows = float(out.shape[0])
    return torch.stack([out.new_tensor(rows), out.new_tensor(float(count)), sse, ll])


def evidence(
    structure,
    theta: torch.Tensor,
    lam: torch.Tensor,
    stats: torch.Tensor | None = None,
    likelihood: str = "categorical",
    noise=None,
    sigma: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Laplace log marginal likelihood (module docstring) at prior precisions ``lam`` (one per
    subnetwork weight, or one for all) and, for a Gaussian likelihood, noise ``sigma`` (default
    the model's ``noise``, at which the GGN was computed).

    :param structure: a posterior structure (:mod:`~pyro_bdl.guides.laplace.posterior`); only
        its ``logdet`` is used.
    :param stats: the fit statistics (:func:`fit_statistics`); ``None`` leaves out the fit term,
        which is constant in λ, giving the λ-dependent part (then σ is the model's).
    """
    theta = theta.double()
    lam = lam.expand(theta.shape)
    c: float | torch.Tensor = 1.0
    fit: float | torch.Tensor = 0.0
    if stats is not None and likelihood == "gaussian":
        sigma = torch.as_tensor(noise, dtype=torch.float64) if sigma is None else sigma
        c = (noise / sigma) ** 2
        fit = -0.5 * stats[1] * torch.log(2 * math.pi * sigma**2) - stats[2] / (2 * sigma**2)
    elif stats is not None:
        fit = stats[3]
    prior = -0.5 * (lam * theta.square()).sum() + 0.5 * lam.log().sum()
    return fit + prior - 0.5 * structure.logdet(lam, c)


def layer_groups(layout: SiteLayout, index: torch.Tensor) -> torch.Tensor:
    """A layer id (0, 1, …) per subnetwork weight ``index``: the sites of one layer share it."""
    ids = torch.empty(index.numel(), dtype=torch.long)
    keys: dict[object, int] = {}
    index = index.cpu()
    for site in layout:
        mask = (index >= site.start) & (index < site.stop)
        key = id(site.module) if site.module is not None else site.name
        ids[mask] = keys.setdefault(key, len(keys))
    return ids.unique(return_inverse=True)[1]


def optimize_marglik(
    structure,
    theta: torch.Tensor,
    groups: torch.Tensor,
    lam: torch.Tensor,
    stats: torch.Tensor,
    likelihood: str,
    noise=None,
    *,
    prior_structure: str = "scalar",
    tune_noise: bool = False,
    max_iter: int = 200,
) -> tuple[torch.Tensor, float | None, float]:
    """Maximise :func:`evidence` over log λ (``prior_structure``: one value, one per group of
    ``groups`` (a layer id per subnetwork weight), or one per weight) and, with ``tune_noise``,
    log σ, from the current ``lam`` (one per weight) and the model's σ.

    :returns: ``(λ per subnetwork weight, σ or None, log marginal likelihood)``.
    """
    lam = lam.double().expand(theta.shape)
    if prior_structure == "scalar":
        init = lam.log().mean().reshape(1)
        expand = lambda p: p.expand(theta.shape)  # noqa: E731
    elif prior_structure == "layerwise":
        count = int(groups.max()) + 1
        sums = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, lam.log())
        sizes = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, torch.ones_like(lam))
        init = sums / sizes
        expand = lambda p: p[groups]  # noqa: E731
    else:
        init = lam.log().clone()
        expand = lambda p: p  # noqa: E731
    log_lam = init.clone().requires_grad_(True)
    params = [log_lam]
    log_sigma = None
    if tune_noise:
        log_sigma = torch.tensor(math.log(noise), dtype=torch.float64, requires_grad=True)
        params.append(log_sigma)
    optim = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optim.zero_grad()
        sigma = log_sigma.exp() if log_sigma is not None else None
        loss = -evidence(structure, theta, expand(log_lam).exp(), stats, likelihood, noise, sigma)
        loss.backward()
        return loss

    optim.step(closure)
    with torch.no_grad():
        sigma = log_sigma.exp() if log_sigma is not None else None
        value = evidence(structure, theta, expand(log_lam).exp(), stats, likelihood, noise, sigma)
        result = expand(log_lam).exp().detach()
    if not torch.isfinite(value):
        raise ValueError(
            "the marginal-likelihood optimisation diverged (non-finite evidence); start from "
            "another prior_precision or use search='grid'."
        )
    _warn_outside_range(log_lam.detach().exp(), prior_structure)
    return result, (float(sigma) if sigma is not None else None), float(value)


def _warn_outside_range(lam: torch.Tensor, prior_structure: str) -> None:
    """Warn where the gradient search ran a prior precision ``lam`` (its own parameters: one,
    one per layer or one per weight) past :data:`SEARCH_RANGE`."""
    low, high = SEARCH_RANGE
    for upper, past in ((True, lam > high), (False, lam < low)):
        if bool(past.any()):
            extreme = float(lam.max() if upper else lam.min())
            why = (
                "weights at 0 (dead units, pruned weights), whose evidence keeps rising with λ"
                if upper
                else "weights the data do not bend the loss for (zero curvature, such as those "
                "of an input that is always 0), whose evidence keeps rising as λ falls"
            )
            _warn_at_bound(
                f"the gradient search (prior_structure={prior_structure!r}) ran "
                f"{int(past.sum())} of {lam.numel()} prior precisions past the "
                f"{'upper' if upper else 'lower'} end of its range [{low:.0e}, {high:.0e}] (to "
                f"{extreme:.3g})",
                upper,
                f"there is no maximum in between, so λ is where L-BFGS stopped. This comes of "
                f"{why}: leave them out of the subnetwork, fix λ instead (prior_precision=), "
                "or use a coarser prior_structure or search='grid'.",
            )


def tune_grid(
    score: Callable[[torch.Tensor], torch.Tensor], grid: torch.Tensor, *, refine: bool = True
) -> float:
    """The grid value maximising ``score``, refined on a finer log grid between its neighbours;
    warns when the best value sits at the edge of a grid of two or more values (one value just
    sets λ)."""
    values = torch.stack([score(v) for v in grid])
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, -math.inf))
    i = int(values.argmax())
    if len(grid) > 1 and i in (0, len(grid) - 1):
        _warn_at_bound(
            f"the best prior precision {float(grid[i]):.3g} sits at the edge of the grid "
            f"[{float(grid[0]):.3g}, {float(grid[-1]):.3g}]",
            i == len(grid) - 1,
            "widen the grid to look further.",
        )
    if not refine or len(grid) < 3:
        return float(grid[i])
    lo, hi = grid[max(i - 1, 0)].log(), grid[min(i + 1, len(grid) - 1)].log()
    fine = torch.linspace(float(lo), float(hi), 21, dtype=torch.float64).exp()
    fine_values = torch.stack([score(v) for v in fine])
    return float(fine[int(fine_values.argmax())])


def default_grid(grid) -> torch.Tensor:
    """``grid`` as a positive 1-d float64 tensor; ``None`` gives :math:`10^{-4} … 10^{4}` (17
    values)."""
    grid = torch.logspace(-4, 4, 17, dtype=torch.float64) if grid is None else grid
    grid = torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    check_positive(
        "grid",
        grid,
        fix="Pass a 1-d tensor of prior precisions λ > 0, for example "
        "torch.logspace(-4, 4, 17), or grid=None for that default.",
    )
    return grid


def eigenbasis(ggn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(eigenvalues ≥ 0, eigenvectors)`` of a dense GGN, in float64: the basis in which every
    isotropic λ of a grid costs O(S) (module docstring)."""
    evals, evecs = torch.linalg.eigh(ggn.double())
    return evals.clamp_min(0), evecs


def marglik_score(
    structure, theta: torch.Tensor, ratio: float, **kwargs
) -> Callable[[torch.Tensor], torch.Tensor]:
    """λ ↦ :func:`evidence` with λ_S = ``ratio`` · λ (``kwargs``: its statistics, likelihood and
    noise)."""
    return lambda lam: evidence(structure, theta, lam * ratio, **kwargs)


def val_ll_score(
    parts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    likelihood: str,
    noise: float | None,
    evals: torch.Tensor,
    evecs: torch.Tensor,
    ratio: float,
    *,
    split: Split | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """λ ↦ the validation log-likelihood of the linearized predictive of a dense posterior in its
    eigenbasis (:func:`eigenbasis`; the probit for classification, closed form with the noise σ
    for regression, for a heteroscedastic Gaussian with outputs ``split`` the mixture of
    :func:`~pyro_bdl.guides.laplace.posterior.heteroscedastic_mixture`), from chunks
    ``(outputs (b, C), J_S (b, C, S), targets (b,))`` at the MAP values."""
    fs, qs, ys = [], [], []
    het = likelihood == "heteroscedastic"
    for out, jac, y in parts:
        fs.append(out.double())
        projected = jac.double() @ evecs
        if het:  # the outputs' covariance needs the projections themselves
            qs.append(projected)
        else:  # one variance per logit (class or label), as in linearized_predictive
            projected = projected.square()
            qs.append(projected.sum(1, keepdim=True) if likelihood == "gaussian" else projected)
        ys.append(y)
    f, q, y = torch.cat(fs), torch.cat(qs), torch.cat(ys)
    z = _validation_draws(likelihood, f.shape[-1])

    def score(lam: torch.Tensor) -> torch.Tensor:
        weights = 1.0 / (evals + lam * ratio)
        var = output_variance(q * weights.sqrt(), likelihood) if het else q @ weights
        return predictive_log_likelihood(f, var, y, likelihood, noise, split=split, z=z)

    return score


#: Draws of a heteroscedastic Gaussian's predictive in ``val_ll`` tuning: the density's relative
#: Monte Carlo error is about 1/√M for a coefficient of variation 1 across the draws
#: (:func:`~pyro_bdl.guides.laplace.posterior.heteroscedastic_mixture`), 3% per validation
#: point, and, the same draws scoring every λ, the comparison between two λ errs far less.
VALIDATION_DRAWS = 1000


def _validation_draws(likelihood: str, k: int) -> torch.Tensor | None:
    """The standard draws that score every λ of a search (seeded: a search is repeatable and
    compares the λ on common draws), or ``None`` where the predictive is closed-form."""
    if likelihood != "heteroscedastic":
        return None
    return standard_draws(VALIDATION_DRAWS, k, torch.Generator().manual_seed(0))


def structure_val_ll_score(
    structure,
    parts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    likelihood: str,
    noise: float | None,
    c: float,
    ratio: float,
    *,
    split: Split | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`val_ll_score` for any posterior structure: λ ↦ the validation log-likelihood of
    the linearized predictive under ``structure.with_prior(λ·ratio, c)``."""
    parts = list(parts)
    count, device = parts[0][1].shape[-1], parts[0][1].device
    z = _validation_draws(likelihood, parts[0][0].shape[-1])

    def score(lam: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(count, dtype=torch.float64, device=device)
        trial = structure.with_prior(lam.to(device) * ratio * ones, c)
        total: float | torch.Tensor = 0.0
        for out, jac, y in parts:
            var = output_variance(trial.apply_scale(jac), likelihood)
            total += predictive_log_likelihood(
                out.double(), var, y, likelihood, noise, split=split, z=z
            )
        return torch.as_tensor(total)

    return score
