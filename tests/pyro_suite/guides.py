"""The registry of every guide the library ships, plus Pyro's own guides as controls.

Each :class:`GuideEntry` builds its guide over a model and makes it ready to sample in the way
its method does: SVI-trained guides (``AutoMeanField``, ``AutoRadial`` and Pyro's controls) are
ready once called; SWAG collects snapshots after SVI steps; the Laplace guides fit after their
MAP phase; the ensembles combine members; the natural-gradient guide is written by VOGN steps.
The suites in this folder parametrize over :data:`GUIDES` and mark known failures with
:func:`cases`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoNormal, init_to_sample
from torch import nn

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.guides import (
    AutoEnsemble,
    AutoLaplace,
    AutoMeanField,
    AutoMultiSWAG,
    AutoRadial,
    AutoSubnetLaplace,
    AutoSWAG,
)
from pyro_bdl.infer import VOGN

Args = Sequence[Any]

ROWS, FEATURES, CLASSES = 12, 4, 3


def lifted_classifier():
    """``(model, x, y)``: a small lifted MLP classifier over ``ROWS`` examples and its data."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    model = models.classifier(bayesianize(net, priors.Normal(scale=1.0)), ROWS)
    x = torch.randn(ROWS, FEATURES)
    y = torch.randint(0, CLASSES, (ROWS,))
    return model, x, y


def _call(guide, model, args: Args):
    guide(*args)
    return guide


def _map_steps(model, guide, args: Args, steps: int) -> None:
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    for _ in range(steps):
        svi.step(*args)


def _swag_ready(guide, model, args: Args):
    for _ in range(4):  # SGD steps between snapshots, so every coordinate moves
        _map_steps(model, guide, args, 2)
        guide.collect()
    return guide


def _laplace_ready(guide, model, args: Args):
    _map_steps(model, guide, args, 2)
    return guide.fit(tuple(args))


def _members(model, args: Args, count: int) -> list[dict]:
    """``count`` point estimates of ``model``'s latent sites (draws from the prior)."""
    members = []
    for k in range(count):
        pyro.set_rng_seed(k)
        # Every AutoDelta names its parameters alike in the store: without clearing it, each
        # member would read the first one's values instead of drawing its own.
        pyro.clear_param_store()
        delta = AutoDelta(model, init_loc_fn=init_to_sample)
        delta(*args)
        members.append({k: v.detach().clone() for k, v in delta.median(*args).items()})
    pyro.clear_param_store()
    return members


def _ensemble(model):
    return ("ensemble", model)  # built in ``ready``: its members come from the model


def _ensemble_ready(placeholder, model, args: Args):
    guide = AutoEnsemble(model, _members(model, args, 3))
    guide(*args)
    return guide


def _multiswag_ready(placeholder, model, args: Args):
    members = []
    for k in range(2):
        pyro.set_rng_seed(k)
        pyro.clear_param_store()
        # From a prior draw of its own seed: SWAG's runs draw no noise, so two runs from the
        # network's weights would be one run, which AutoMultiSWAG refuses.
        member = AutoSWAG(model, rank=2, init_loc_fn=init_to_sample)
        members.append(_swag_ready(member, model, args))
    guide = AutoMultiSWAG(model, members)
    guide(*args)
    return guide


def _vogn_ready(placeholder, model, args: Args):
    vogn = VOGN(model, dataset_size=args[0].shape[0], lr=1e-2)
    for _ in range(2):
        vogn.step(*args)
    return vogn.guide


@dataclass(frozen=True)
class GuideEntry:
    """One guide: its test id, how to build it over a model and how to make it ready to sample.

    :ivar build: ``build(model) -> guide``, untrained (for the ensembles and the
        natural-gradient guide a placeholder: they exist only once fitted).
    :ivar ready: ``ready(guide, model, args) -> guide`` fits it the way its method does and
        returns the guide to sample from.
    :ivar elbo: whether the guide is trained by an ELBO (an SVI test can drive it).
    :ivar control: one of Pyro's own guides.
    :ivar network_only: the guide infers the weights of a lifted network from data only (the
        Laplace guides and the natural-gradient guide refuse other latent sites and need data
        to fit), so Pyro's data-free models with scalar latents do not apply to it.
    """

    name: str
    build: Callable[[Callable], Any]
    ready: Callable[[Any, Callable, Args], Any] = _call
    elbo: bool = True
    control: bool = False
    network_only: bool = False

    def make(self, model, args: Args = ()):
        """A guide over ``model`` ready to sample, fitted on ``args``."""
        return self.ready(self.build(model), model, args)


#: Every guide of ``pyro_bdl.guides`` (and the natural-gradient guide), then Pyro's controls.
GUIDES: list[GuideEntry] = [
    GuideEntry("meanfield", lambda m: AutoMeanField(m)),
    GuideEntry("radial", lambda m: AutoRadial(m)),
    GuideEntry("swag", lambda m: AutoSWAG(m, rank=2), _swag_ready),
    GuideEntry("ensemble", _ensemble, _ensemble_ready, elbo=False),
    GuideEntry("multiswag", _ensemble, _multiswag_ready, elbo=False),
    GuideEntry("laplace", lambda m: AutoLaplace(m), _laplace_ready, network_only=True),
    GuideEntry(
        "subnet_laplace",
        lambda m: AutoSubnetLaplace(m, subnetwork="all"),
        _laplace_ready,
        network_only=True,
    ),
    GuideEntry("natural_gradient", _ensemble, _vogn_ready, elbo=False, network_only=True),
    GuideEntry("AutoNormal", lambda m: AutoNormal(m), control=True),
    GuideEntry("AutoDiagonalNormal", lambda m: AutoDiagonalNormal(m), control=True),
    GuideEntry("AutoDelta", lambda m: AutoDelta(m), control=True),
]

BY_NAME = {entry.name: entry for entry in GUIDES}


Known = tuple[str, type[BaseException]]


def known(reason: str, raises: type[BaseException] = Exception) -> Known:
    """A known failure: the issue item (or Pyro limitation) that explains it and what it raises."""
    return (reason, raises)


def _name(value: Any) -> str:
    if isinstance(value, tuple):
        return "-".join(map(_name, value))
    return getattr(value, "__name__", str(value))


def cases(
    names: Sequence[str] | None = None,
    *,
    over: Sequence[Any] | None = None,
    xfail: Mapping[str, Known] | None = None,
    elbo: bool | None = None,
    generic: bool = False,
) -> list:
    """``pytest.param`` s over the entries ``names`` (default: all), each known failure in
    ``xfail`` marked strict, so that its fix shows as XPASS.

    :param over: also cross with these values (ELBO classes, flags, or tuples of them): the
        params are then ``(entry, *value)`` with ids ``guide-value``.
    :param xfail: known failures, ``{id: known(...)}`` where the id is a guide's name (every
        case of that guide) or ``"guide-value"`` (one pair).
    :param elbo: keep only the guides trained (``True``) or not trained (``False``) by an ELBO.
    :param generic: keep only the guides that apply to any Pyro model (not ``network_only``).
    """
    xfail = dict(xfail or {})
    chosen = [BY_NAME[n] for n in names] if names is not None else GUIDES
    if elbo is not None:
        chosen = [e for e in chosen if e.elbo == elbo]
    if generic:
        chosen = [e for e in chosen if not e.network_only]
    rows = [(e.name, (e,)) for e in chosen]
    if over is not None:
        rows = [
            (f"{e.name}-{_name(v)}", (e, *(v if isinstance(v, tuple) else (v,))))
            for e in chosen
            for v in over
        ]
    params, used = [], set()
    for ident, values in rows:
        key = ident if ident in xfail else values[0].name if values[0].name in xfail else None
        marks = []
        if key is not None:
            used.add(key)
            reason, raises = xfail[key]
            marks.append(pytest.mark.xfail(strict=True, reason=reason, raises=raises))
        params.append(pytest.param(*values, id=ident, marks=marks))
    unused = set(xfail) - used
    assert not unused, f"xfail names no case: {sorted(unused)}"
    return params


# -- known failures shared by the suites ------------------------------------------------------

#: TraceSuffStat_ELBO warns and falls back to Trace_ELBO's one-sample term for sites without an
#: M-sample KL (a Dirichlet behind a stick-breaking transform, an MVN or Beta prior, an
#: auxiliary guide site): the documented behaviour, and the loss stays a valid estimator.
KL_FALLBACK_IS_DOCUMENTED = "ignore::pyro_bdl.infer.KLFallbackWarning"
#: torch deprecates TorchScript; Pyro's tests trace guides and predictives all the same.
TORCHSCRIPT_DEPRECATED = "ignore:`torch.jit:FutureWarning"


def not_reparameterized(*elbos: str, suffixes: tuple[str, ...] = ("",)) -> dict[str, Known]:
    """By design, a point-mass mixture or a MultiSWAG posterior has no reparameterized sample, so
    the ELBOs that need one (TraceMeanField_ELBO, TraceSuffStat_ELBO) refuse it with the fix in the
    message: the known failures of ``elbos`` keyed ``guide-elbo`` plus each of ``suffixes``."""
    errors = {"TraceMeanField_ELBO": NotImplementedError, "TraceSuffStat_ELBO": ValueError}
    return {
        f"{guide}-{elbo}{suffix}": known(
            f"by design (refusal expected): {guide} is not reparameterizable", errors[elbo]
        )
        for guide in ("swag", "ensemble", "multiswag")
        for elbo in elbos
        for suffix in suffixes
        # While it trains, AutoSWAG's guide is its point estimate (its mode is a setting, not
        # inferred from grad mode), which both ELBOs accept.
        if guide != "swag"
    }
