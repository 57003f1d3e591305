r"""The linearized (GLM) predictive of a subnetwork Laplace posterior and its links
(docs/design/laplace.md).

The linearized network :math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)` turns the posterior
:math:`N(\theta_S^*, LL^\top)` (:mod:`~pyro_bdl.guides.laplace.posterior`) into
:math:`N(f, (J_S L)(J_S L)^\top)` over the outputs, and a link (probit, Laplace bridge, Monte
Carlo) into probabilities (:func:`predictive`). Under a heteroscedastic Gaussian the outputs carry
the mean and the variance, and the predictive is the mixture of :math:`N(\mu(f), \sigma^2(f))`
over that Gaussian (:func:`heteroscedastic_mixture`). Everything here takes the rows
:math:`J_S L` a structure's ``apply_scale`` gives, never an S × S matrix.

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

import pyro.distributions as dist
import torch
import torch.nn.functional as F

from pyro_bdl.curvature.ggn import Split, mean_and_log_variance
from pyro_bdl.curvature.jacobian import as_matrix

__all__ = [
    "LINKS",
    "heteroscedastic_mixture",
    "jacobian_transform",
    "laplace_bridge",
    "linearized_predictive",
    "logit_difference",
    "output_variance",
    "predictive",
    "predictive_log_likelihood",
    "probit_logits",
    "standard_draws",
]


#: The classification links of :func:`linearized_predictive`.
LINKS = ("probit", "bridge", "mc")


def logit_difference(outputs: torch.Tensor) -> torch.Tensor:
    r"""``outputs[:, 1:] - outputs[:, :1]``, the logit difference :math:`d = f_1 - f_0` (B, 1),
    for two classes; any other number of outputs unchanged. A two-class softmax depends on
    :math:`d` alone, so its linearized predictive needs the Jacobian of :math:`d` only: one
    backward pass rather than one per class."""
    return outputs[:, 1:] - outputs[:, :1] if outputs.shape[-1] == 2 else outputs


def jacobian_transform(likelihood: str, link: str = "probit"):
    """What the linearized predictive differentiates: :func:`logit_difference` for a categorical
    likelihood (it changes only two-class outputs), except under the Laplace bridge, which needs
    every logit; ``None`` (the outputs themselves) otherwise."""
    return logit_difference if likelihood == "categorical" and link != "bridge" else None


def linearized_predictive(
    outputs: torch.Tensor,
    jl: torch.Tensor,
    likelihood: str,
    *,
    link: str = "probit",
    num_samples: int = 1000,
    noise: float | None = None,
    generator: torch.Generator | None = None,
):
    r"""Predictive of the linearized network with :math:`f_{lin} \sim N(f, (JL)(JL)^\top)`.

    ``link="probit"``: :func:`probit_logits` of each logit's own variance, through a sigmoid
    (Bernoulli) or softmax (categorical: the binary probit when C = 2 and one logit is a
    constant; not invariant to a shift of all logits, and the MAP argmax may change);
    ``"bridge"`` (categorical only): :func:`laplace_bridge`; ``"mc"``: the mean over
    ``num_samples`` draws of :math:`f_{lin}` (from ``generator``, else the global one).

    Two classes given the Jacobian of the logit difference (``jl`` (B, 1, S), from
    :func:`logit_difference`): the softmax is :math:`\sigma(d)` of :math:`d = f_1 - f_0 \sim
    N(\mu_d, v_d)`, so ``"probit"`` is MacKay's binary probit
    :math:`p_1 = \sigma(\mu_d / \sqrt{1 + \pi v_d / 8})`, the two-class form of the
    approximation itself (invariant to a shift of both logits, and the MAP argmax kept), and
    ``"mc"`` is the same draws' mean as from the full Jacobian (:math:`f_1 - f_0` of a draw is
    the draw of :math:`d`). On a classifier's log-probabilities it stays within 0.01 of
    :math:`E[\sigma(d)]` over variances 0.01 to 100, where the per-class probit is off by up
    to 0.015.

    :param outputs: the MAP outputs f, (B, C) or (B,).
    :param jl: :math:`J_S L` (B, C, S), with :math:`LL^\top = \Sigma_S`; or (B, 1, S) for the
        logit difference of two classes (categorical, ``"probit"`` or ``"mc"``).
    :returns: class probabilities (B, C) (categorical), P(y = 1) (B,) (Bernoulli), or
        ``(mean, variance)`` including σ² (Gaussian; ``link`` unused).
    """
    f = as_matrix(outputs)
    if likelihood == "heteroscedastic":
        raise ValueError(
            "a heteroscedastic Gaussian's linearized predictive is a mixture, not a closed "
            "form: use heteroscedastic_mixture(outputs, output_variance(jl, likelihood), split, "
            "standard_draws(num_samples, K)) (AutoSubnetLaplace.predictive_distribution)."
        )
    if likelihood == "gaussian":
        assert noise is not None
        var = jl.square().sum(-1) + noise**2
        if outputs.dim() == 1:
            return f.squeeze(-1), var.squeeze(-1)
        return f, var
    if likelihood == "categorical" and f.shape[-1] == 2 and jl.shape[-2] == 1:
        return _two_class(logit_difference(f), jl, link, num_samples, generator)
    if link == "mc":
        samples = f + _draws(jl, num_samples, generator)
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


def _draws(
    jl: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    r"""``num_samples`` draws of :math:`J_S L z`, :math:`z \sim N(0, I)` from ``generator`` (on
    its device): (num_samples, B, C)."""
    device = generator.device if generator is not None else jl.device
    z = torch.randn(num_samples, jl.shape[-1], dtype=jl.dtype, device=device, generator=generator)
    return torch.einsum("bcs,ks->kbc", jl, z.to(jl.device))


def _two_class(
    d: torch.Tensor,
    jl: torch.Tensor,
    link: str,
    num_samples: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Probabilities (B, 2) from the logit difference ``d`` (B, 1) and its ``jl`` (B, 1, S)."""
    if link == "bridge":
        raise ValueError(
            "link='bridge' needs the Jacobian of every logit, not of the logit difference; "
            "pass jl of shape (B, 2, S)."
        )
    if link == "mc":
        s = d + _draws(jl, num_samples, generator)
        return torch.cat([(-s).sigmoid(), s.sigmoid()], -1).mean(0)
    z = probit_logits(d, jl.square().sum(-1))
    return torch.cat([(-z).sigmoid(), z.sigmoid()], -1)


def probit_logits(f: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    r"""The probit logits :math:`f_k / \sqrt{1 + \pi v_k / 8}` of MAP logits ``f`` and the
    linearized variance :math:`v_k` of each logit (same shape).

    A sigmoid of them is MacKay's probit approximation of :math:`E[\mathrm{sigmoid}(f_k)]`
    (Bernoulli, multilabel; two classes from their logit difference); a softmax over the
    classes is the per-class multi-class probit (Lu, Ie & Sha, 2020; laplace-torch), that of
    :meth:`~pyro_bdl.guides.AutoSubnetLaplace.predict` for C > 2 and of ``val_ll`` tuning.
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
    generator: torch.Generator | None = None,
):
    """The linearized predictive of chunks ``(MAP outputs, J_S L)``, joined: probabilities, or
    ``(mean, variance)`` for a Gaussian likelihood (each ``(n,)`` when ``vector``, the model's
    outputs having shape ``(B,)``); see :func:`linearized_predictive` (``"mc"`` draws from
    ``generator``)."""
    parts = [
        linearized_predictive(
            out.to(jl.dtype),
            jl,
            likelihood,
            link=link,
            num_samples=num_samples,
            noise=noise,
            generator=generator,
        )
        for out, jl in chunks
    ]
    if likelihood != "gaussian":
        return torch.cat(parts)
    mean, var = torch.cat([m for m, _ in parts]), torch.cat([v for _, v in parts])
    return (mean.squeeze(-1), var.squeeze(-1)) if vector else (mean, var)


def predictive_log_likelihood(
    f: torch.Tensor,
    var: torch.Tensor,
    y: torch.Tensor,
    likelihood: str,
    noise: float | None,
    *,
    split: Split | None = None,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-likelihood of targets ``y`` under the linearized predictive with MAP outputs ``f``
    (n, C) and output variances ``var`` (:func:`output_variance`): the probit (classification;
    for two classes and ``var`` (n, 1), the variance of the logit difference, the binary probit
    of :func:`linearized_predictive`), the Gaussian with the noise σ added (regression; ``var``
    (n, 1), one output), or under a heteroscedastic Gaussian the mixture of
    :func:`heteroscedastic_mixture` (``var`` the covariances (n, K, K), ``z`` its standard
    draws, the same for every call that compares prior precisions)."""
    if likelihood == "heteroscedastic":
        assert split is not None and z is not None
        return heteroscedastic_mixture(f, var, split, z).log_prob(y.reshape(-1).to(f)).sum()
    if likelihood == "gaussian":
        assert noise is not None
        return dist.Normal(f.squeeze(-1), (var.squeeze(-1) + noise**2).sqrt()).log_prob(y).sum()
    if likelihood == "categorical" and f.shape[-1] == 2 and var.shape[-1] == 1:
        # The variance of the logit difference: the binary probit that predict() returns.
        z = probit_logits(logit_difference(f), var).squeeze(-1)
        return torch.where(y == 1, F.logsigmoid(z), F.logsigmoid(-z)).sum()
    logits = probit_logits(f, var)
    if likelihood == "bernoulli":
        return dist.Bernoulli(logits=logits.reshape(y.shape)).log_prob(y.to(f)).sum()
    return dist.Categorical(logits=logits).log_prob(y).sum()


def output_variance(jl: torch.Tensor, likelihood: str) -> torch.Tensor:
    r"""What the linearized predictive needs of :math:`J_S L` (n, C, S): each output's variance
    (n, C), or under a heteroscedastic Gaussian, whose mean and variance outputs move together,
    their covariance :math:`(J_S L)(J_S L)^\top` (n, C, C)."""
    if likelihood == "heteroscedastic":
        return jl @ jl.transpose(-1, -2)
    return jl.square().sum(-1)


def standard_draws(
    num_samples: int, k: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    r"""``num_samples`` draws of :math:`N(0, I_k)` (num_samples, k, float64, on the CPU), moved
    and turned so that their mean is exactly 0 and their covariance (divided by
    ``num_samples``) exactly :math:`I` (moment matching).

    Through :func:`heteroscedastic_mixture` the draws of a mean that is linear in the outputs
    then have exactly the linearized mean and variance, so the predictive's mean and the part
    of its variance that comes from the mean are free of Monte Carlo error; only σ²'s average
    and the density keep it, of at most the independent draws' standard error asymptotically
    (the matched moments remove the error's linear and quadratic parts).
    """
    if num_samples <= k:
        raise ValueError(
            f"num_samples must exceed the {k} outputs per example for the heteroscedastic "
            f"predictive (its draws are matched to mean 0 and covariance I); got {num_samples}. "
            "Pass num_samples=1000 (the default)."
        )
    z = torch.randn(num_samples, k, dtype=torch.float64, generator=generator)
    z = z - z.mean(0)
    chol = torch.linalg.cholesky(z.T @ z / num_samples)
    return torch.linalg.solve_triangular(chol, z.T, upper=False).T


def heteroscedastic_mixture(
    f: torch.Tensor, cov: torch.Tensor, split: Split, z: torch.Tensor
) -> torch.distributions.MixtureSameFamily:
    r"""The linearized predictive of a heteroscedastic Gaussian: with the outputs
    :math:`\tilde f \sim N(f, \Sigma)` (``f`` (n, K), ``cov`` (n, K, K)) and ``split`` giving
    :math:`(\mu, \log\sigma^2)` of them, :math:`p(y) = E[N(y; \mu(\tilde f),
    \sigma^2(\tilde f))]`, estimated by the equal-weight mixture over the M draws
    :math:`\tilde f_m = f + \Sigma^{1/2} z_m` of the standard draws ``z`` (M, K,
    :func:`standard_draws`), the same for every example. Batch shape (n,).

    Its ``mean`` and ``variance`` are :math:`E[\mu]` and :math:`\mathrm{Var}[\mu] +
    E[\sigma^2]` over the draws. Monte Carlo error: the density's relative standard error is
    :math:`\mathrm{sd}_m[N(y; \mu_m, \sigma_m^2)] / (\sqrt M\, p(y))`, and its log is
    biased low by about half its square: with M = 1000 and a density whose spread across the
    draws is of the order of its mean (coefficient of variation 1), about 3% and 0.0005 nats.
    """
    evals, evecs = torch.linalg.eigh(cov.double())
    # A square root of each Σ that any positive semi-definite one has (a singular Σ: outputs
    # the subnetwork cannot move), where a Cholesky factor would fail.
    root = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)
    draws = f.double().unsqueeze(1) + torch.einsum("nkj,mj->nmk", root, z.to(root))
    n, m, k = draws.shape
    mean, log_var = mean_and_log_variance(draws.reshape(n * m, k), split)
    components = dist.Normal(mean.reshape(n, m), (0.5 * log_var).exp().reshape(n, m))
    weights = dist.Categorical(logits=mean.new_zeros(n, m))
    return dist.MixtureSameFamily(weights, components)
