"""The linearized predictive of a fitted Laplace guide, for every Hessian structure: the
Jacobian of the outputs over the subnetwork at the MAP, times the posterior structure's factor
(:mod:`~pyro_bdl.guides.laplace_structures`), through a link
(:mod:`~pyro_bdl.guides.laplace_predictive`); docs/design/laplace.md."""

from __future__ import annotations

from typing import Any

import torch

from pyro_bdl._validation import check_choice, check_positive_int
from pyro_bdl.curvature.jacobian import subnet_jacobian
from pyro_bdl.guides.laplace_model import Observation, eval_mode
from pyro_bdl.guides.laplace_predictive import LINKS, predictive

__all__ = ["LaplacePredicting"]


class LaplacePredicting:
    """:meth:`predict` of :class:`~pyro_bdl.guides.AutoSubnetLaplace` (a mixin)."""

    # Provided by the guide.
    _raw_model: Any
    _batches: Any
    _forward: Any
    _observe: Any
    _check_fitted: Any
    map_loc: torch.Tensor
    subnet_index: torch.Tensor
    posterior: Any
    _noise: float | None

    def _jacobians(self, data: Any, obs: Observation):
        """(outputs (b, C), J_S (b, C, S), batch) at the MAP values, ``batch_size`` rows at a
        time; the model gets the batch's first tensor (the inputs)."""
        with eval_mode(self._raw_model):
            for batch in self._batches(data):
                forward, slots = self._forward(self.map_loc, batch[:1], obs)
                jac, out = subnet_jacobian(forward, slots, self.subnet_index, return_outputs=True)
                yield out, jac, batch

    def predict(self, x: torch.Tensor, *, link: str = "probit", num_samples: int = 1000):
        r"""The linearized predictive :math:`f(x,\theta^*) + J_S(x)(\theta_S - \theta_S^*)`.

        Categorical: class probabilities (n, C); Bernoulli: P(y = 1) (n,); Gaussian: the
        closed form ``(mean, variance)`` with the observation noise included (``link`` unused).
        ``link``: ``"probit"`` (per logit), ``"bridge"`` (Laplace bridge) or ``"mc"``
        (``num_samples`` draws): :func:`~pyro_bdl.guides.laplace_posterior.linearized_predictive`.

        :param torch.Tensor x: inputs, the model's first argument.
        """
        check_choice("link", link, LINKS)
        check_positive_int("num_samples", num_samples)
        self._check_fitted("predict")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}.")
        obs = self._observe((x,), without_targets=True)
        posterior = self.posterior
        chunks = ((out, posterior.apply_scale(jac)) for out, jac, _ in self._jacobians((x,), obs))
        noise = obs.noise if self._noise is None else self._noise
        return predictive(chunks, obs.likelihood, noise, obs.vector, link, num_samples)
