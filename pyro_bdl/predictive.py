r"""The posterior predictive of a model over a lifted network: the network's output for S
posterior draws, in one batched forward pass.

:func:`sample_outputs` is :class:`pyro.infer.Predictive` with ``return_sites=["_RETURN"]`` and
``parallel=True``: the guide draws all S weight samples at once under a plate and the lifted
network runs once on the batched weights (:mod:`pyro_bdl.nn.vectorize`). It works with every
guide whose sites follow Pyro's plates (:class:`~pyro_bdl.guides.AutoMeanField`,
:class:`~pyro_bdl.guides.AutoRadial`, :class:`~pyro_bdl.guides.AutoSWAG`,
:class:`~pyro_bdl.guides.AutoSubnetLaplace` after ``fit``, VOGN's ``guide``).
``max_parallel`` bounds the memory by drawing at most that many samples per batched pass.

Usage::

    logits = bdl.predictive.sample_outputs(model, guide, x_test, num_samples=32)  # (32, B, C)
    probs = logits.softmax(-1).mean(0)
"""

from __future__ import annotations

from typing import Any

import torch
from pyro.infer import Predictive

from pyro_bdl._validation import check_positive_int

__all__ = ["sample_outputs"]


def sample_outputs(
    model,
    guide,
    *args: Any,
    num_samples: int,
    parallel: bool = True,
    max_parallel: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The model's return value (the network output) for ``num_samples`` posterior draws.

    :param callable model: a Pyro model that returns the network output, e.g.
        :func:`pyro_bdl.models.classifier`; BatchNorm layers must be in eval mode when
        ``parallel``.
    :param callable guide: any guide of ``model`` (called with the same arguments).
    :param args: the model's inputs (``x``; no labels, so the outputs are predictions).
    :param int num_samples: S, the number of posterior draws.
    :param bool parallel: draw the S samples in one vectorized pass (``True``) or one after the
        other (``False``; same distribution, other random streams).
    :param int max_parallel: at most this many samples per vectorized pass (default: all S).
    :returns: a tensor of shape ``(S, *output_shape)``.
    """
    check_positive_int("num_samples", num_samples)
    if max_parallel is not None:
        check_positive_int("max_parallel", max_parallel)
    chunk = num_samples if (max_parallel is None or not parallel) else max_parallel
    outputs = []
    for start in range(0, num_samples, chunk):
        size = min(chunk, num_samples - start)
        predictive = Predictive(
            model, guide=guide, num_samples=size, return_sites=["_RETURN"], parallel=parallel
        )
        out = predictive(*args, **kwargs)["_RETURN"]
        if out.shape[0] != size:
            raise ValueError(
                f"the model's return value has leading dim {out.shape[0]} for {size} samples; "
                "sample_outputs needs a model that returns the network output (as "
                "pyro_bdl.models.classifier/regressor do)."
            )
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
