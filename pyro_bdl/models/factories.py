r"""The factories users call: one :class:`~pyro_bdl.models.NetworkModel` per likelihood.

Which inference method takes which likelihood (the others refuse with an error naming the pair):

- mean-field, Radial and SWAG guides: every likelihood and noise model (a learned σ is one more
  latent site of the guide; a point σ is a param trained by SVI).
- VOGN: every likelihood whose parameters all come from the lifted network (categorical,
  Bernoulli, fixed and heteroscedastic Gaussian); a learned or point σ is refused, since VOGN
  updates only lifted weights.
- subnetwork Laplace: categorical, Bernoulli, a Gaussian with one known σ (fixed, or a point
  estimate read when fitting) and a heteroscedastic Gaussian (the Gaussian's Fisher over both
  outputs); a learned σ is refused, since the posterior covers the weights only
  (docs/methods/laplace.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributions import Distribution

from pyro_bdl.models.network import NetworkModel
from pyro_bdl.models.structured import Output

__all__ = [
    "binary_classifier",
    "classifier",
    "heteroscedastic_regressor",
    "language_model",
    "multilabel_classifier",
    "regressor",
]

# Every factory takes output=: which tensor of the network's output the likelihood reads, for a
# network returning a ModelOutput, dict or tuple (pyro_bdl.models.structured).


def classifier(net: nn.Module, dataset_size: int, *, output: Output = None) -> NetworkModel:
    """A categorical-likelihood model ``model(x, y=None) -> logits`` over ``net``'s outputs
    ``(B, C)``; labels are integer classes ``(B,)``.

    Sequence classification with a Hugging Face model is this model over a tokenized batch::

        model = bdl.models.classifier(bnn, N)   # reads .logits of the ModelOutput
        svi.step(tokenizer(texts, padding=True, return_tensors="pt"), labels)
    """
    return NetworkModel(net, likelihood="categorical", dataset_size=dataset_size, output=output)


def binary_classifier(net: nn.Module, dataset_size: int, *, output: Output = None) -> NetworkModel:
    """A Bernoulli-likelihood model ``model(x, y=None) -> logits`` over one logit per example
    (``net`` outputs ``(B,)`` or ``(B, 1)``); labels ``(B,)`` are 0 or 1, of any dtype."""
    return NetworkModel(net, likelihood="bernoulli", dataset_size=dataset_size, output=output)


def multilabel_classifier(
    net: nn.Module, dataset_size: int, *, output: Output = None
) -> NetworkModel:
    """K independent Bernoulli labels per example: ``model(x, y=None) -> logits`` with ``net``
    outputting ``(B, K)`` and labels ``(B, K)`` of 0 or 1."""
    return NetworkModel(
        net, likelihood="bernoulli", dataset_size=dataset_size, multilabel=True, output=output
    )


def language_model(
    net: nn.Module, dataset_size: int, *, output: Output = None, shift: bool = True
) -> NetworkModel:
    """A token-level categorical likelihood ``model(x, y=None) -> logits`` over ``net``'s
    outputs ``(B, T, V)``: one term of the data plate per sequence (N counts sequences), the
    sum of the log-probabilities of its scored tokens.

    A token is scored unless its label is ``-100`` or the batch's ``attention_mask`` is 0 there.
    With ``shift=True`` (next-token prediction, as Hugging Face's causal language models
    compute their loss) the logits at position t predict the label at t+1, and the labels are
    the input ids; ``shift=False`` scores each position's own label (masked language modelling,
    labels ``-100`` except at the masked positions).

    Usage::

        model = bdl.models.language_model(bnn, N)
        svi.step(batch, batch["input_ids"])    # batch: input_ids, attention_mask
    """
    return NetworkModel(
        net, likelihood="tokens", dataset_size=dataset_size, output=output, shift=shift
    )


def regressor(
    net: nn.Module,
    dataset_size: int,
    noise_scale: float | None = None,
    *,
    noise: str = "fixed",
    noise_prior: Distribution | None = None,
    output: Output = None,
    name: str | None = None,
) -> NetworkModel:
    r"""A Gaussian-likelihood model ``model(x, y=None) -> mean``, :math:`y \sim N(f(x), σ^2)`.

    ``net`` must output shape ``(B,)`` or ``(B, 1)``; targets have shape ``(B,)``.

    Usage::

        model = bdl.models.regressor(bnn, N, noise_scale=0.1)          # σ known
        model = bdl.models.regressor(bnn, N, noise="learned")          # σ ~ LogNormal(0, 1)
        model = bdl.models.regressor(bnn, N, noise="point", noise_scale=0.5)  # σ fitted from 0.5

    :param float noise_scale: σ for ``noise="fixed"``; the initial value of the estimate for
        ``noise="point"`` (default 1).
    :param str noise: ``"fixed"``, ``"learned"`` (σ a latent site ``"sigma"`` inferred with the
        weights) or ``"point"`` (σ a positive param ``"<name>.sigma"``, a maximum-likelihood
        estimate); see :mod:`pyro_bdl.models.noise`.
    :param noise_prior: the prior over σ for ``noise="learned"`` (default ``LogNormal(0, 1)``),
        a univariate distribution over positive numbers.
    :param str name: the prefix of the params the model creates (``model.param_names``):
        default a unique ``"model_<k>"``; pass one to keep the names fixed across programs
        (resuming a checkpoint in a program that builds other models first).
    """
    return NetworkModel(
        net,
        likelihood="gaussian",
        dataset_size=dataset_size,
        noise_scale=noise_scale,
        noise=noise,
        noise_prior=noise_prior,
        output=output,
        name=name,
    )


def heteroscedastic_regressor(
    net: nn.Module,
    dataset_size: int,
    *,
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    output: Output = None,
) -> NetworkModel:
    r"""A Gaussian likelihood whose noise depends on the input: :math:`y \sim N(\mu(x),
    \exp s(x))` with the mean :math:`\mu` and the log-variance :math:`s` both from ``net``.

    ``model(x, y=None)`` returns the network's output; ``(model.split or
    models.mean_log_variance)(out)`` gives ``(mean, log_var)``.

    :param split: ``out -> (mean, log_var)``, each ``(B,)`` (default: ``net`` outputs ``(B, 2)``,
        the mean in column 0 and the log-variance in column 1).
    """
    return NetworkModel(
        net,
        likelihood="gaussian",
        dataset_size=dataset_size,
        noise="heteroscedastic",
        split=split,
        output=output,
    )
