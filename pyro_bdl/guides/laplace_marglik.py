r"""The Laplace marginal likelihood of a fitted Laplace guide and its optimisation by gradient
over the prior precision (scalar, per layer or per weight) and the Gaussian noise σ
(docs/design/laplace.md).

At the MAP :math:`\theta^*` with the GGN :math:`G` (computed at the model's σ₀), a Gaussian prior
of precision :math:`\lambda` per subnetwork weight and noise σ (Gaussian likelihood),

.. math:: \log p(\mathcal D) \approx \log p(\mathcal D\mid\theta^*, \sigma)
          - \tfrac12 \textstyle\sum_i \lambda_i\theta_i^{*2} + \tfrac12\sum_i\log\lambda_i
          - \tfrac12 \log\det(c\,G + \mathrm{diag}\,\lambda), \qquad c = \sigma_0^2/\sigma^2,

where the fit term is re-evaluated at :math:`\theta^*` (for a Gaussian likelihood
:math:`-\tfrac m2\log 2\pi\sigma^2 - \mathrm{SSE}/2\sigma^2` over m outputs) and the
:math:`2\pi` of the two Gaussians cancel (Immer et al. 2021, eq. 4 with the GGN). The
log-determinant comes from the posterior structure (:mod:`~pyro_bdl.guides.laplace_structures`).
:func:`optimize_marglik` maximises it over log λ and log σ with L-BFGS (strong Wolfe line search)
in float64; at the optimum the gradient vanishes, which for one λ and σ are MacKay's fixed-point
conditions :math:`\lambda\lVert\theta^*\rVert^2 = \gamma` and :math:`\sigma^2 =
\mathrm{SSE}/(m-\gamma)`, :math:`\gamma = \sum_k c e_k/(c e_k + \lambda)`.

References:
    Immer et al., "Scalable Marginal Likelihood Estimation for Model Selection in Deep
    Learning", ICML 2021.
    MacKay, "Bayesian Interpolation", Neural Computation 1992.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch

__all__ = ["PRIOR_STRUCTURES", "evidence", "fit_statistics", "optimize_marglik"]

#: Granularity of the optimised prior precision.
PRIOR_STRUCTURES = ("scalar", "layerwise", "diagonal")


def fit_statistics(out: torch.Tensor, y: torch.Tensor, likelihood: str, noise) -> torch.Tensor:
    r"""``[rows, outputs, SSE, log-likelihood]`` (float64) of a batch at the MAP, which batches
    and data-parallel ranks add: the outputs ``out`` (B, C) and targets ``y``."""
    out = out.detach().double()
    if likelihood == "gaussian":
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
    return torch.stack([out.new_tensor(rows), out.new_tensor(float(out.numel())), sse, ll])


def evidence(
    structure,
    theta: torch.Tensor,
    lam: torch.Tensor,
    stats: torch.Tensor,
    likelihood: str,
    noise=None,
    sigma: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Laplace log marginal likelihood (module docstring) at prior precisions ``lam`` (one per
    subnetwork weight, or one for all) and, for a Gaussian likelihood, noise ``sigma`` (default
    the model's ``noise``, at which the GGN was computed)."""
    theta = theta.double()
    lam = lam.expand(theta.shape)
    c: float | torch.Tensor = 1.0
    if likelihood == "gaussian":
        sigma = torch.as_tensor(noise, dtype=torch.float64) if sigma is None else sigma
        c = (noise / sigma) ** 2
        fit = -0.5 * stats[1] * torch.log(2 * math.pi * sigma**2) - stats[2] / (2 * sigma**2)
    else:
        fit = stats[3]
    prior = -0.5 * (lam * theta.square()).sum() + 0.5 * lam.log().sum()
    return fit + prior - 0.5 * structure.logdet(lam, c)


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
    return result, (float(sigma) if sigma is not None else None), float(value)
