"""The posterior of natural-gradient VI as an ordinary Pyro guide: a diagonal Normal over the
weight sites, backed by buffers that :class:`~pyro_bdl.infer.VOGN` or
:class:`~pyro_bdl.infer.IVON` updates in place."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

from pyro_bdl.guides.access import SiteAccess
from pyro_bdl.layout import SiteLayout

__all__ = ["NaturalGradientGuide"]


class NaturalGradientGuide(SiteAccess, AutoGuide):
    """A diagonal Normal posterior over every weight site, written by a natural-gradient method.

    The flat buffers ``loc`` (μ) and ``scale`` (σ) belong to the inference object (VOGN or IVON):
    :meth:`attach` hands them over once it has seen the model, and it updates them in place. The
    guide is then an ordinary guide for ``Predictive``, ``poutine`` and checkpoints
    (``state_dict`` holds both buffers), with ``median``, ``quantiles`` and ``locs_and_scales``
    per site.

    Usage::

        vogn.step(x, y)
        probs = Predictive(model, guide=vogn.guide, num_samples=32)(x_test)
    """

    layout: SiteLayout
    loc: torch.Tensor
    scale: torch.Tensor

    def __init__(self, model, *, owner: str = "VOGN"):
        super().__init__(model)
        #: The name of the inference object that writes the guide (``"VOGN"``, ``"IVON"``).
        self.owner = owner

    def attach(self, layout: SiteLayout, loc: torch.Tensor, scale: torch.Tensor) -> None:
        """Serve the posterior N(``loc``, ``scale``²) over the sites of ``layout``; the guide
        reads the given tensors (not copies), so their owner's in-place updates show here."""
        if loc.shape != (layout.size,) or scale.shape != (layout.size,):
            raise ValueError(
                f"loc and scale must have shape ({layout.size},) (the layout's D); got "
                f"{tuple(loc.shape)} and {tuple(scale.shape)}."
            )
        # A small prototype trace of the weight sites only (detached, Normal at the current
        # location): the model's full trace holds the network, which torch.save refuses.
        prototype = poutine.Trace()
        for site in layout:
            value = loc[site.slice].detach().view(site.shape).clone()
            prototype.add_node(
                site.name,
                type="sample",
                name=site.name,
                # Unvalidated: its parameters are valid by construction, and a check would
                # read their values (none on the meta device).
                fn=dist.Normal(value, torch.ones_like(value), validate_args=False).to_event(
                    len(site.shape)
                ),
                value=value,
                is_observed=False,
                args=(),
                kwargs={},
                infer={},
                scale=1.0,
                mask=None,
                cond_indep_stack=(),
                done=True,
                stop=False,
                continuation=None,
            )
        self.prototype_trace = prototype
        self.layout = layout
        self.register_buffer("loc", loc)
        self.register_buffer("scale", scale)

    def detach(self) -> None:
        """Undo :meth:`attach` (the first step was refused): the guide is unset again."""
        self.prototype_trace = None
        self._buffers.pop("loc", None)
        self._buffers.pop("scale", None)
        self.__dict__.pop("layout", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Before the method has seen the model there are no buffers to load into, and torch's
        # "Unexpected key(s)" would not say why, nor which state resumes a run.
        if self.prototype_trace is None and any(prefix + k in state_dict for k in ("loc", "scale")):
            name = self.owner.lower()
            raise RuntimeError(
                f"this guide's loc and scale belong to {self.owner}, which has not seen the model "
                f"yet: there is nothing to load them into, and nothing was loaded. To resume a "
                f"run, load {self.owner}'s own state ({name}.load_state_dict(state), or "
                f"pyro_bdl.checkpoint.load_checkpoint); to load only the guide, call "
                f"{name}.setup(x, y) first."
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _setup_prototype(self, *args, **kwargs) -> None:
        self._ensure_setup()

    def _ensure_setup(self) -> None:
        if self.prototype_trace is None:
            name = self.owner.lower()
            raise RuntimeError(
                f"this guide is set up by {self.owner}: call {name}.step(x, y) (or "
                f"{name}.setup(x, y)) before using {name}.guide."
            )

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loc, self.scale

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every weight site from N(μ, σ²); returns ``{name: value}``."""
        self._ensure_setup()
        out = {}
        locs, scales = self.layout.split(self.loc), self.layout.split(self.scale)
        for site, loc, scale in zip(self.layout, locs, scales):
            posterior = dist.Normal(loc, scale).to_event(site.event_dim)
            out[site.name] = pyro.sample(site.name, posterior)
        return out

    def get_posterior(self, name: str) -> dist.Distribution:
        """The Normal posterior of site ``name``."""
        self._ensure_setup()
        site = self.layout[name]
        loc, scale = self._site_loc_scale(site)
        return dist.Normal(loc, scale).to_event(site.event_dim)
