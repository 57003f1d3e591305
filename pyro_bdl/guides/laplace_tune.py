r"""Choosing the prior precision (and the Gaussian noise σ) of a fitted Laplace guide: by the
Laplace marginal likelihood, optimised by gradient (scalar, per layer or per weight, and σ) or on
a grid, or by the validation log-likelihood on a grid (docs/design/laplace.md).

:class:`LaplaceTuning` is the part of :class:`~pyro_bdl.guides.AutoSubnetLaplace` that does it,
for every Hessian structure; :mod:`~pyro_bdl.guides.laplace_marglik` holds the evidence and its
optimiser, :mod:`~pyro_bdl.guides.laplace_posterior` the grid search.
"""

from __future__ import annotations

from typing import Any

import torch

from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.guides.laplace_marglik import PRIOR_STRUCTURES, evidence, optimize_marglik
from pyro_bdl.guides.laplace_posterior import (
    posterior_factor,
    predictive_log_likelihood,
    tune_grid,
    tune_precision,
)
from pyro_bdl.layout import SiteLayout

__all__ = ["SEARCHES", "LaplaceTuning", "layer_groups"]

#: How :meth:`LaplaceTuning.tune_prior_precision` searches.
SEARCHES = ("gradient", "grid")


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


class LaplaceTuning:
    """Prior-precision and noise selection for the Laplace guide family (a mixin)."""

    # Provided by the guide.
    _noise: float | None
    _noise0: Any
    _likelihood: str
    _stats: torch.Tensor | None
    _structure: Any
    _check_fitted: Any
    _prior_s: Any
    _batches: Any
    _observe: Any
    _jacobians: Any
    posterior: Any
    hessian_structure: str
    layout: SiteLayout
    map_loc: torch.Tensor
    subnet_index: torch.Tensor
    ggn: torch.Tensor
    scale_tril: torch.Tensor
    prior_precision: torch.Tensor

    @property
    def noise_scale(self) -> float | None:
        """The Gaussian observation noise σ the posterior and :meth:`predict` use: the tuned one
        (``tune_prior_precision(tune_noise=True)``), else the model's (``None`` unless the
        likelihood is Gaussian)."""
        return self._noise if self._noise is not None else self._noise0

    def _noise_scale(self) -> float:
        """c = σ₀²/σ², the factor from the GGN at the model's σ₀ to the tuned σ."""
        if self._noise is None:
            return 1.0
        return (self._noise0 / self._noise) ** 2

    def _set_prior(self, lam_s: torch.Tensor, sigma: float | None) -> None:
        """Hold λ_S (one per subnetwork weight) and σ, and refactor the posterior."""
        s, total = self.subnet_index.numel(), self.map_loc.numel()
        lam = lam_s / self._prior_s(1.0, s, total)
        same = bool(torch.all(lam == lam.reshape(-1)[0]))
        self.prior_precision = lam.reshape(-1)[0].clone() if same else lam.clone()
        self._noise = sigma if sigma is not None else self._noise
        c = self._noise_scale()
        prior: float | torch.Tensor = float(lam_s.reshape(-1)[0]) if same else lam_s
        if self.hessian_structure == "full":
            self.scale_tril = posterior_factor(c * self.ggn, prior)
        else:
            self._structure = self._structure.with_prior(lam_s, c)

    def marginal_likelihood(self) -> float:
        r"""The Laplace log marginal likelihood :math:`\log p(\mathcal D)` at the held prior
        precision and σ (:func:`~pyro_bdl.guides.laplace_marglik.evidence`)."""
        self._check_fitted("marginal_likelihood")
        stats = self._fit_stats()
        post = self.posterior
        theta = self.map_loc[self.subnet_index]
        sigma = None if self._noise is None else torch.tensor(self._noise, dtype=torch.float64)
        lam = torch.as_tensor(post.lam, dtype=torch.float64)
        value = evidence(post, theta, lam, stats, self._likelihood, self._noise0, sigma)
        return float(value)

    def _fit_stats(self) -> torch.Tensor:
        if self._stats is None:
            raise ValueError(
                "the marginal likelihood needs the fit statistics, which state_dict does not "
                "keep; call guide.fit(data) again."
            )
        return self._stats

    def tune_prior_precision(
        self,
        data: Any = None,
        *,
        method: str = "marglik",
        search: str | None = None,
        grid: torch.Tensor | None = None,
        refine: bool = True,
        prior_structure: str = "scalar",
        tune_noise: bool = False,
        max_iter: int = 200,
    ) -> float | torch.Tensor:
        r"""Choose the prior precision by the Laplace marginal likelihood or the validation
        log-likelihood, update the posterior and return λ (a float for one value, else one per
        subnetwork weight).

        ``search="gradient"`` (the default for ``"marglik"`` without a ``grid``) maximises the
        evidence over log λ (``prior_structure``: ``"scalar"``, ``"layerwise"`` or
        ``"diagonal"``, the last not with ``"kron"``) and, with ``tune_noise`` (Gaussian
        likelihood), log σ, by L-BFGS (Immer et al. 2021). ``search="grid"`` searches one λ on
        a log grid (default :math:`10^{-4} … 10^{4}`, 17 values), then a finer grid between the
        best value's neighbours; it warns when the best value sits at the grid's edge (a
        one-value grid just sets λ, silently).

        :param data: validation ``(x, y)`` (or a DataLoader) for ``method="val_ll"``.
        :param str method: ``"marglik"`` or ``"val_ll"`` (probit predictive log-likelihood).
        """
        check_choice("method", method, ("marglik", "val_ll"))
        search = search or ("grid" if grid is not None or method == "val_ll" else "gradient")
        check_choice("search", search, SEARCHES)
        check_choice("prior_structure", prior_structure, PRIOR_STRUCTURES)
        check_positive_int("max_iter", max_iter)
        self._check_fitted("tune_prior_precision")
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
        if tune_noise and self._likelihood != "gaussian":
            raise ValueError(
                "tune_noise=True needs a Gaussian likelihood; this model's is "
                f"{self._likelihood!r}."
            )
        if prior_structure == "diagonal" and self.hessian_structure == "kron":
            raise ValueError(
                "prior_structure='diagonal' cannot be added exactly to Kronecker factors; use "
                "'scalar' or 'layerwise', or hessian_structure='diag' or 'full'."
            )
        if search == "gradient":
            return self._tune_gradient(prior_structure, tune_noise, max_iter)
        return self._tune_grid(data, method, grid, refine)

    def _tune_gradient(self, prior_structure: str, tune_noise: bool, max_iter: int):
        stats = self._fit_stats()
        index = self.subnet_index
        post = self.posterior
        theta = self.map_loc[index].double()
        lam0 = torch.as_tensor(post.lam, dtype=torch.float64).expand(theta.shape)
        groups = layer_groups(self.layout, index)
        # The evidence rescales the GGN as computed (at σ₀) by (σ₀/σ)² itself.
        lam_s, sigma, _ = optimize_marglik(
            post,
            theta,
            groups.to(theta.device),
            lam0,
            stats,
            self._likelihood,
            self._noise0,
            prior_structure=prior_structure,
            tune_noise=tune_noise,
            max_iter=max_iter,
        )
        self._set_prior(lam_s, sigma)
        lam = self.prior_precision
        return float(lam) if lam.dim() == 0 else lam

    def _tune_grid(self, data: Any, method: str, grid, refine: bool) -> float:
        index = self.subnet_index
        s, total = index.numel(), self.map_loc.numel()
        ratio = self._prior_s(1.0, s, total)
        theta = self.map_loc[index]
        if self.hessian_structure == "full" and self._noise is None:
            if method == "marglik":
                best = tune_precision(self.ggn, ratio, grid, refine, theta)
            else:
                obs, parts = self._validation_parts(data)
                best = tune_precision(self.ggn, ratio, grid, refine, parts=parts, obs=obs)
        else:
            grid = torch.logspace(-4, 4, 17, dtype=torch.float64) if grid is None else grid
            grid = torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
            post, c = self.posterior, self._noise_scale()
            sigma = None if self._noise is None else torch.tensor(self._noise, dtype=torch.float64)
            if method == "marglik":
                stats = self._fit_stats()

                def score(v):
                    return evidence(
                        post, theta, v * ratio, stats, self._likelihood, self._noise0, sigma
                    )
            else:
                obs, parts = self._validation_parts(data)
                parts = list(parts)
                noise = obs.noise if self._noise is None else self._noise

                def score(v):
                    trial = post.with_prior(v * ratio * torch.ones(s, dtype=torch.float64), c)
                    total_ll = 0.0
                    for out, jac, y in parts:
                        var = trial.apply_scale(jac).square().sum(-1)
                        total_ll += predictive_log_likelihood(
                            out.double(), var, y, obs.likelihood, noise
                        )
                    return torch.as_tensor(total_ll)

            best = tune_grid(score, grid, refine=refine)
        self._set_prior(torch.full((s,), best * ratio, dtype=torch.float64), None)
        return best

    def _validation_parts(self, data: Any):
        first = next(self._batches(data))
        if len(first) < 2:
            raise ValueError("validation data must be (x, y).")
        obs = self._observe(first)
        parts = ((out, jac, b[1]) for out, jac, b in self._jacobians(data, obs))
        return obs, parts
