r"""The linearized Laplace predictive: the network :math:`f(x,\theta^*) + J_S(x)(\theta_S -
\theta_S^*)` under the subnetwork Gaussian is :math:`N(f, (J_S L)(J_S L)^\top)` over the
outputs, and a link (probit, Laplace bridge, Monte Carlo) turns it into probabilities
(docs/design/laplace.md).

References:
    MacKay, "The evidence framework applied to classification networks", Neural Computation 1992.
    Lu, Ie & Sha, "Uncertainty estimation with infinitesimal jackknife, its distribution and
    mean-field approximation", 2020.
    Hobbhahn, Kristiadi & Hennig, "Fast predictive uncertainty for classification with Bayesian
    deep networks", UAI 2022.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from pyro_bdl.curvature.jacobian import as_matrix

__all__ = ["LINKS", "laplace_bridge", "linearized_predictive", "predictive", "probit_logits"]

#: The classification links of :func:`linearized_predictive`.
LINKS = ("probit", "bridge", "mc")


def linearized_predictive(
    outputs: torch.Tensor,
    jl: torch.Tensor,
    likelihood: str,
    *,
    link: str = "probit",
    num_samples: int = 1000,
    noise: float | None = None,
):
    r"""Predictive of the linearized network with :math:`f_{lin} \sim N(f, (JL)(JL)^\top)`.

    ``link="probit"``: :func:`probit_logits` of each logit's own variance, through a sigmoid
    (Bernoulli) or softmax (categorical: the binary probit when C = 2 and one logit is a
    constant; not invariant to a shift of all logits, and the MAP argmax may change);
    ``"bridge"`` (categorical only): :func:`laplace_bridge`; ``"mc"``: the mean over
    ``num_samples`` draws of :math:`f_{lin}`.

    :param outputs: the MAP outputs f, (B, C) or (B,).
    :param jl: :math:`J_S L` (B, C, S), with :math:`LL^\top = \Sigma_S`.
    :returns: class probabilities (B, C) (categorical), P(y = 1) (B,) (Bernoulli), or
        ``(mean, variance)`` including σ² (Gaussian; ``link`` unused).
    """
    f = as_matrix(outputs)
    if likelihood == "gaussian":
        assert noise is not None
        var = jl.square().sum(-1) + noise**2
        if outputs.dim() == 1:
            return f.squeeze(-1), var.squeeze(-1)
        return f, var
    if link == "mc":
        z = torch.randn(num_samples, jl.shape[-1], dtype=jl.dtype, device=jl.device)
        samples = f + torch.einsum("bcs,ks->kbc", jl, z)
        if likelihood == "bernoulli":
            return samples.sigmoid().mean(0).squeeze(-1)
        return samples.softmax(-1).mean(0)
    if link == "bridge":
        if likelihood != "categorical":
            raise ValueError(
                f"link='bridge' needs a categorical likelihood; got {likelihood!r}. "
                "Use link='probit' or link='mc'."
            )
        return laplace_bridge(f, jl)
    logits = probit_logits(f, jl.square().sum(-1))
    if likelihood == "bernoulli":
        return logits.sigmoid().squeeze(-1)
    return logits.softmax(-1)


def probit_logits(f: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    r"""The probit logits :math:`f_k / \sqrt{1 + \pi v_k / 8}` of MAP logits ``f`` and the
    linearized variance :math:`v_k` of each logit (same shape).

    A sigmoid of them is MacKay's probit approximation of :math:`E[\mathrm{sigmoid}(f_k)]`
    (Bernoulli, multilabel); a softmax over the classes is the per-class multi-class probit
    (Lu, Ie & Sha, 2020; laplace-torch), the one predictive and one validation score of both
    :meth:`~pyro_bdl.guides.AutoSubnetLaplace.predict` and ``val_ll`` tuning.
    """
    return f * (1 + math.pi / 8 * var).rsqrt()


def laplace_bridge(f: torch.Tensor, jl: torch.Tensor) -> torch.Tensor:
    r"""The Laplace bridge predictive (Hobbhahn, Kristiadi & Hennig, UAI 2022): the mean
    :math:`\alpha_k / \sum_l \alpha_l` of the Dirichlet with
    :math:`\alpha_k = (1 - 2/C + e^{\mu_k} \sum_l e^{-\mu_l} / C^2) / \Sigma_{kk}`, where
    :math:`(\mu, \Sigma)` is :math:`N(f, (JL)(JL)^\top)` conditioned on
    :math:`\sum_k f_k = 0` (softmax ignores that direction, the bridge would not).

    :param f: MAP logits (B, C). :param jl: :math:`J_S L` (B, C, S).
    """
    c = f.shape[-1]
    tiny = torch.finfo(jl.dtype).tiny
    ones = jl.sum(1)  # (B, S): Σ1 = JL (JL)ᵀ 1 = JL · ones
    cov_sum = torch.einsum("bcs,bs->bc", jl, ones)
    total = ones.square().sum(-1, keepdim=True).clamp_min(tiny)  # 1ᵀ Σ 1
    mu = f - cov_sum * f.sum(-1, keepdim=True) / total
    var = (jl.square().sum(-1) - cov_sum.square() / total).clamp_min(tiny)
    # log α_k, so that neither e^{μ_k} Σ_l e^{−μ_l} nor 1/Σ_kk overflows (a class of zero
    # variance has an unbounded α and takes all the mass, as the formula says).
    log_cross = mu + torch.logsumexp(-mu, -1, keepdim=True) - 2 * math.log(c)
    log_num = torch.logaddexp(torch.full_like(mu, math.log(max(1 - 2 / c, tiny))), log_cross)
    return (log_num - var.log()).softmax(-1)


def predictive(
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
    likelihood: str,
    noise: float | None,
    vector: bool,
    link: str,
    num_samples: int,
):
    """The linearized predictive of chunks ``(MAP outputs, J_S L)``, joined: probabilities, or
    ``(mean, variance)`` for a Gaussian likelihood (each ``(n,)`` when ``vector``, the model's
    outputs having shape ``(B,)``); see :func:`linearized_predictive`."""
    parts = [
        linearized_predictive(
            out.to(jl.dtype), jl, likelihood, link=link, num_samples=num_samples, noise=noise
        )
        for out, jl in chunks
    ]
    if likelihood != "gaussian":
        return torch.cat(parts)
    mean, var = torch.cat([m for m, _ in parts]), torch.cat([v for _, v in parts])
    return (mean.squeeze(-1), var.squeeze(-1)) if vector else (mean, var)
