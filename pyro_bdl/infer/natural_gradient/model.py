r"""How natural-gradient VI (:class:`~pyro_bdl.infer.VOGN`, :class:`~pyro_bdl.infer.IVON`) runs a
Pyro model: the first, traced pass and its checks, the per-example negative log-likelihoods of
the data plate, and the fast conditioned run with the weights written on the layers.

The first step traces the model once (weights at their initial values) and checks that every
latent site is a lifted weight, every observation lies in the data plate, and every ``param``
site belongs to a layer of the network. That structure is then kept: every later pass writes the
weight sample straight onto the lifted layers (as :func:`~pyro_bdl.curvature.substitute` does)
and runs the model under :class:`SiteRecorder`, which records the sample sites that still reach
Pyro, the observations. This is the same computation as ``poutine.trace(poutine.condition(model,
weights))`` without a Pyro message, a prior distribution and a trace node per weight site. A
latent site that appears after the first step (a model whose structure changes) is refused.

References:

- Osawa et al., "Practical Deep Learning with Bayesian Principles", NeurIPS 2019 (Algorithm 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyro.poutine as poutine
import torch
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.rollback import BufferRecorder, ParamStoreRecorder, Rollback
from pyro_bdl.layout import SiteLayout
from pyro_bdl.models import DATA_PLATE
from pyro_bdl.nn.lift import init_to_network, site_spec

__all__ = [
    "Hidden",
    "Prepared",
    "SiteRecorder",
    "inspect_model",
    "per_example_nll",
    "prepare",
    "run_substituted",
]


@dataclass(frozen=True, eq=False)
class Hidden:
    """A hidden parameter: a ``pyro.param`` of a layer kept as a point estimate.

    :ivar str name: the dotted parameter (``param`` site) name.
    :ivar param: the parameter itself.
    :ivar module: the layer that owns it.
    :ivar str param_name: its name within ``module``.
    """

    name: str
    param: nn.Parameter
    module: nn.Module
    param_name: str


def data_frame(site) -> Any:
    """The data plate's frame among the site's plates, or ``None``."""
    for frame in site["cond_indep_stack"]:
        if frame.name == DATA_PLATE:
            return frame
    return None


def inspect_model(
    trace, layers: Iterable[nn.Module], dataset_size: int, method: str
) -> tuple[SiteLayout, list[Hidden]]:
    """Validate the model's first trace; returns the layout of its weight sites (the flat μ) and
    the hidden parameters among the ``layers`` the trace called. ``method`` names the inference
    object in the messages."""
    sites, observed, params = [], [], []
    for name, site in trace.nodes.items():
        if site["type"] == "param":
            params.append(name)
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        if site["is_observed"]:
            observed.append(site)
            continue
        spec = site_spec(site)
        if spec is None:
            raise ValueError(
                f"{method} infers only network weights lifted by pyro_bdl.bayesianize; latent site "
                f"{name!r} is not one. Make it observed or a constant, or use SVI with a guide."
            )
        if site["cond_indep_stack"]:
            raise ValueError(
                f"weight site {name!r} lies inside a plate; {method} needs global weights. "
                "Sample the weights outside every plate (as pyro_bdl.bayesianize does), or use "
                "SVI with a guide."
            )
        sites.append(spec)
    if not sites:
        raise ValueError(
            "the model has no weight sites; lift the network with pyro_bdl.bayesianize(net)."
        )
    in_plate = [s for s in observed if data_frame(s) is not None]
    outside = [s["name"] for s in observed if data_frame(s) is None]
    if outside or not in_plate:
        raise ValueError(
            f"{method} needs every observed site inside pyro.plate({DATA_PLATE!r}, N, "
            f"subsample_size=B) to read per-example likelihoods; "
            + (f"sites {outside} are outside it." if outside else "the model has none.")
            + " Use pyro_bdl.models.classifier/regressor or wrap the observation in that plate."
        )
    for s in in_plate:
        frame = data_frame(s)
        full = frame.full_size or frame.size
        if full != dataset_size:
            raise ValueError(
                f"dataset_size is {dataset_size} but the model's data plate has size "
                f"{full} (site {s['name']!r}); pass the same N to both."
            )
    dtypes = {spec.init_value.dtype for spec in sites}
    if len(dtypes) > 1:
        raise ValueError(
            f"all weight sites must share one dtype; got {sorted(map(str, dtypes))}. Convert the "
            "network to one dtype (net.float()) before lifting it."
        )
    hidden, covered = [], set()
    for module in layers:
        prefix = module.__dict__.get("_pyro_name")
        for pname, p in module._parameters.items():
            if p is None or not p.requires_grad or prefix is None:
                continue
            fullname = f"{prefix}.{pname}" if prefix else pname
            if fullname in params and fullname not in covered:
                covered.add(fullname)
                hidden.append(Hidden(fullname, p, module, pname))
    # The state (μ, momentum, curvature) takes the weights' dtype, and a running average of
    # squared gradients in bf16 or fp16 keeps 8 or 11 bits: refused, as ``.to`` refuses it.
    dtypes_of = [(f"weight site {s.name!r}", s.init_value.dtype) for s in sites]
    dtypes_of += [(f"hidden parameter {h.name!r}", h.param.dtype) for h in hidden]
    for what, dtype in dtypes_of:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"{method} keeps its state (the mean, momentum and curvature of every weight) in "
                f"the dtype of the weights; {what} is {dtype}, in which the running averages "
                "lose the curvature. Keep the network in float32 (net.float()) and train under "
                f"torch.autocast for {dtype} compute."
            )
    missing = [p for p in params if p not in covered]
    if missing:
        raise ValueError(
            f"{method} trains the lifted network's weights and its hidden layer parameters only; "
            f"param sites {missing} belong to no layer of the network. Make them constants, "
            "or fit the model with SVI."
        )
    return SiteLayout.from_specs(sites), hidden


def per_example_nll(sites: Iterable[dict], where: str) -> tuple[torch.Tensor, int, float]:
    """Per-example negative log-likelihood ``(B,)`` of the data-plate sites without the plate's
    N/B scaling (any other ``poutine.scale`` kept), the batch size B, and the sum as a float;
    ``where`` (``"VOGN step 3"``) starts the messages."""
    total, batch, value = None, 0, 0.0
    for site in sites:
        name, frame = site["name"], data_frame(site)
        lp = site["fn"].log_prob(site["value"])
        if site["mask"] is not None:
            lp = lp * site["mask"] if site["mask"] is not False else torch.zeros_like(lp)
        scale = site["scale"] * frame.size / (frame.full_size or frame.size)
        if not isinstance(scale, (int, float)) or scale != 1.0:
            lp = lp * scale
        dim = frame.dim
        if lp.shape != site["fn"].batch_shape:
            raise ValueError(
                f"{where}: the observation of site {name!r} has shape "
                f"{tuple(site['value'].shape)}, which broadcasts the distribution's batch shape "
                f"{tuple(site['fn'].batch_shape)} to {tuple(lp.shape)}; give it the batch shape."
            )
        if lp.dim() < -dim or lp.shape[dim] != frame.size:
            raise ValueError(
                f"site {name!r} has log-probability shape {tuple(lp.shape)}, which does not "
                f"hold one entry per example at the data plate's dim {dim}; give the "
                "observation distribution the batch shape (B,) (or (B, ...) with to_event)."
            )
        per = -(lp.movedim(dim, 0).reshape(frame.size, -1).sum(1) if lp.dim() > 1 else lp)
        # One number per site: its sum is finite only if every entry is (barring an overflow
        # of finite values, which float32 reaches only past 3e38).
        site_total = float(per.detach().sum())
        if not math.isfinite(site_total):
            raise ValueError(
                f"{where}: the negative log-likelihood of site {name!r} is not finite "
                "(NaN or inf). Lower the learning rate or check the data."
            )
        total = per if total is None else total + per
        batch, value = frame.size, value + site_total
    assert total is not None
    return total, batch, value


def observed_sites(trace, weights: set[str]) -> list[dict]:
    """The observed sample sites of a trace, without the weights and the subsample sites."""
    return [
        site
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and site["is_observed"]
        and name not in weights
        and not site_is_subsample(site)
    ]


class SiteRecorder(Messenger):
    """Records the sample sites that reach it (with the weights substituted on the layers, only
    the observations); a lighter ``poutine.trace`` for the passes after the first.

    It refuses every ``param`` statement (``where``, ``"VOGN step 3"``, starts the message): the
    passes write every hidden parameter onto its layer, so one reaches Pyro only from a layer
    the first pass did not call, which the method would not train."""

    def __init__(self, where: str = "") -> None:
        super().__init__()
        self.sites: list[dict] = []
        self.where = where

    def _pyro_param(self, msg) -> None:
        # Refused before the layer computes with it (its running statistics, for one, are
        # still as they were; only a BatchNorm's num_batches_tracked has counted the call).
        raise ValueError(
            f"{self.where}: parameter {msg['name']!r} belongs to a layer that the first step did "
            "not call; the first step read which parameters to train from the layers it called, "
            "so this one would never be trained. Nothing was updated. Call every layer at the "
            "first step (give the model the same structure at every step)."
        )

    def _pyro_post_sample(self, msg) -> None:
        # A message is not reused once its sample statement has returned: keep it, uncopied.
        self.sites.append(msg)


def run_substituted(
    model: Callable,
    values: Sequence[tuple[nn.Module, str, torch.Tensor]],
    args: tuple,
    kwargs: dict,
    where: str,
    weights: Collection[str] = (),
) -> list[dict]:
    """Run ``model`` with ``module.<name> = value`` for every entry of ``values``; returns the
    observed sites of the data plate, refusing a latent site or a parameter (the model changed
    its structure). ``where`` (``"VOGN step 3"``) starts the messages; ``weights`` are the
    names of the weight sites the values stand for."""
    recorder = SiteRecorder(where)
    try:
        for module, name, value in values:
            # An instance attribute shadows both nn.Module's parameter lookup and PyroModule's
            # PyroSample lookup (both live in __getattr__), without touching the module's state.
            module.__dict__[name] = value
        with recorder:
            model(*args, **kwargs)
    finally:
        for module, name, _ in values:
            module.__dict__.pop(name, None)
    sites = []
    for site in recorder.sites:
        if site_is_subsample(site):
            continue
        if not site["is_observed"] and site["name"] in weights:
            method = where.split()[0]
            raise ValueError(
                f"{where}: the model drew weight site {site['name']!r} from its prior: it ran "
                f"layers other than the ones {method} writes its weight samples on. That is "
                f"what a copy of {method} (copy.deepcopy, pickle, torch.save) does when its "
                "model is a function that uses the original network, which the copy does not "
                "copy. Nothing was updated. Give the copy a model over its own network (a "
                f"pyro_bdl.models model is copied with its network), or build a new {method} "
                "and load the state_dict into it."
            )
        if not site["is_observed"] or data_frame(site) is None:
            kind = "latent" if not site["is_observed"] else "outside the data plate"
            raise ValueError(
                f"{where}: site {site['name']!r} is {kind}, but the model had no such site at the "
                "first step, whose structure is kept. Give the model the same sample sites at "
                "every step."
            )
        sites.append(site)
    return sites


@dataclass(frozen=True)
class Prepared:
    """What the first pass found.

    :ivar layout: the weight sites in the flat vector μ.
    :ivar hidden: the hidden (point-estimate) parameters.
    :ivar tape: the tape that recorded the pass (its layers are the ones to hook from then on).
    :ivar observed: the observed sites of the pass, weights at their initial values.
    :ivar statistics: the buffers of every layer as they were before the pass.
    :ivar params: the param store entries the pass created.
    """

    layout: SiteLayout
    hidden: list[Hidden]
    tape: PerExampleGradients
    observed: list[dict]
    statistics: BufferRecorder
    params: ParamStoreRecorder

    def restore_statistics(self) -> None:
        """Put back the buffers (BatchNorm's running statistics) that the pass changed; only
        once the pass's backward is done, which reads them."""
        self.statistics.restore()

    def undo(self) -> None:
        """Undo the pass (the first step was refused): the buffers, and the param store entries
        that PyroModule registered for the layers' parameters."""
        self.statistics.restore()
        self.params.forget()


def prepare(
    model: Callable,
    args: tuple,
    kwargs: dict,
    *,
    dataset_size: int,
    chunk_size: int | None,
    method: str,
) -> Prepared:
    """Trace ``model`` at the weights' initial values while a tape records every layer, and check
    the model (``method`` names the inference object in the messages).

    The pass is a training pass: it updates BatchNorm's running statistics, which are put back on
    any refusal, whatever raised (and by :meth:`Prepared.restore_statistics`). The random streams
    are left as they were found (a subsampling plate draws indices), so that a run resumed from a
    state_dict continues bit for bit.

    :raises ValueError: for a model that natural-gradient VI cannot fit.
    """
    recorder, params = BufferRecorder(), ParamStoreRecorder()
    streams = Rollback.saved()
    tape = PerExampleGradients(None, chunk_size=chunk_size)
    try:
        with recorder, tape:
            trace = poutine.trace(InitMessenger(init_to_network)(model)).get_trace(*args, **kwargs)
        layout, hidden = inspect_model(trace, list(tape.calls), dataset_size, method)
    except BaseException:
        # Whatever refused the pass (bad data, a model error, a check), nothing stays changed.
        recorder.restore()
        params.forget()
        raise
    finally:
        streams.restore()
    observed = observed_sites(trace, set(layout.names))
    params.stop()
    return Prepared(layout, hidden, tape, observed, recorder, params)
