r"""Is the network at a mode? The check behind ``fit(check_mode=True)``: how far the mode of the
quadratic model of the training loss lies from the fitted weights, in posterior standard
deviations (docs/methods/laplace.md)."""

from __future__ import annotations

import math
import warnings

import torch

from pyro_bdl._caller import user_stacklevel

__all__ = ["MODE_TOLERANCE_SD", "NotAtModeWarning", "warn_if_not_at_mode"]


class NotAtModeWarning(UserWarning):
    """The Laplace posterior was fitted at weights far from a mode of the training loss: the
    network does not look trained to a MAP estimate."""


#: How many standard deviations of χ²_S above its mean S the squared Mahalanobis distance from
#: the fitted weights to the mode of the quadratic model may lie before the fit warns.
MODE_TOLERANCE_SD = 5.0


def warn_if_not_at_mode(gradient: torch.Tensor, posterior) -> None:
    r"""Warn (:class:`NotAtModeWarning`) when the fitted weights lie far from a mode.

    With ``gradient`` :math:`g` of the training loss (negative log-likelihood plus the Gaussian
    prior's :math:`\tfrac12\lambda\lVert\theta\rVert^2`) at the fitted weights and the
    Laplace precision :math:`H` of ``posterior``, the quadratic model of the loss has its mode at
    :math:`\delta = -H^{-1}g`, whose squared Mahalanobis distance under the posterior is
    :math:`d^2 = g^\top H^{-1} g = \lVert L^\top g\rVert^2` (twice the Newton decrement: the
    loss the quadratic model says one Newton step would still remove). The Laplace approximation
    assumes :math:`g = 0`; an SGD-trained MAP sits inside its own posterior, and a draw from
    :math:`N(\text{mode}, H^{-1})` has :math:`d^2 \sim \chi^2_S`, of mean S and standard
    deviation :math:`\sqrt{2S}`. Past :math:`S + 5\sqrt{2S}` (:data:`MODE_TOLERANCE_SD`) the
    fitted weights lie outside the posterior they define, so the Gaussian centred there
    describes no posterior of the data: the network was not trained to a MAP. The bound is in
    the loss's own units (nats scaled by the curvature), so it holds for any data size and
    likelihood.
    """
    white = posterior.apply_scale(gradient.unsqueeze(0)).squeeze(0)
    d2 = float(white.double().square().sum())
    s = gradient.numel()
    limit = s + MODE_TOLERANCE_SD * math.sqrt(2 * s)
    if not d2 <= limit:
        warnings.warn(
            f"the network does not look trained to a MAP estimate: at the fitted weights the "
            f"training loss's gradient puts its mode {math.sqrt(d2):.3g} posterior standard "
            f"deviations away (squared {d2:.3g} > {limit:.3g}, {MODE_TOLERANCE_SD:g} standard "
            f"deviations above the {s} expected of a point inside the posterior), so the Laplace "
            "posterior is centred at the wrong place. Train the network to a MAP estimate first "
            "(for example SVI with this guide and Trace_ELBO until the loss stops falling), then "
            "call fit; pass check_mode=False to fit at these weights anyway.",
            NotAtModeWarning,
            stacklevel=user_stacklevel(),
        )
