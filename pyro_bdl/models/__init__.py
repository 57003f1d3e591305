"""Ready-made Pyro models around a lifted network, with the checks a user would otherwise forget.

Users are free to write their own model with ``pyro.sample``; these helpers are what the
``pyro-bdl`` command, the tests and the tutorials use. Every one scales the likelihood by N/B
through the data plate (:func:`data_plate`), checks each batch before the network sees it
(:mod:`pyro_bdl.models.checks`) and returns the network's output.

- :func:`classifier`: Categorical over C logits; class labels ``(B,)``.
- :func:`binary_classifier`: Bernoulli over one logit; 0/1 labels ``(B,)``.
- :func:`multilabel_classifier`: K independent Bernoulli logits; 0/1 labels ``(B, K)``.
- :func:`regressor`: ``Normal(f(x), σ)`` with σ fixed, learned or a point estimate; ``(B,)``.
- :func:`heteroscedastic_regressor`: ``Normal(μ(x), σ(x))``, both from the network; ``(B,)``.
- :func:`language_model`: a categorical per token (next-token or masked); token ids ``(B, T)``.

Every one takes a batch ``x`` that is a tensor, a mapping of tensors (passed as keyword
arguments: a tokenizer's output) or a tuple of tensors, and a network that returns a tensor, a
``ModelOutput``, a dict or a tuple (``output=`` picks the tensor; :mod:`.structured`).

Usage::

    model = bdl.models.classifier(bnn, dataset_size=len(x_train))
    svi.step(x_batch, y_batch)
"""

from pyro_bdl.models.checks import NetworkShape, check_batch
from pyro_bdl.models.factories import (
    binary_classifier,
    classifier,
    heteroscedastic_regressor,
    language_model,
    multilabel_classifier,
    regressor,
)
from pyro_bdl.models.network import DATA_PLATE, NetworkModel, data_plate, mean_log_variance
from pyro_bdl.models.noise import NOISES, SIGMA

__all__ = [
    "DATA_PLATE",
    "NOISES",
    "SIGMA",
    "NetworkModel",
    "NetworkShape",
    "binary_classifier",
    "check_batch",
    "classifier",
    "data_plate",
    "heteroscedastic_regressor",
    "language_model",
    "mean_log_variance",
    "multilabel_classifier",
    "regressor",
]
