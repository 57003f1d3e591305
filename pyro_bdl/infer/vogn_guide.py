"""VOGN's posterior as an ordinary Pyro guide (written by :class:`~pyro_bdl.infer.VOGN`)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoGuide

__all__ = ["VOGNGuide"]


class VOGNGuide(AutoGuide):
    """VOGN's posterior as a Pyro guide: an independent Normal on every weight site.

    The flat buffers ``loc`` (μ) and ``scale`` (σ) are written by :class:`VOGN`; the guide is set
    up by VOGN's first step and is then an ordinary guide for ``Predictive``, ``poutine`` and
    checkpoints (``state_dict`` holds both buffers).

    Usage::

        vogn.step(x, y)
        probs = Predictive(model, guide=vogn.guide, num_samples=32)(x_test)
    """

    def __init__(self, model) -> None:
        super().__init__(model)
        self._layout: list[tuple[str, int, int, torch.Size]] = []

    def _install(self, trace, layout, loc: torch.Tensor, scale: torch.Tensor) -> None:
        # Keep only the weight sites, detached and with a Normal at the initial location: the
        # full trace holds the network (and its parameters' weakrefs), which torch.save refuses.
        prototype = poutine.Trace()
        for name, _, _, shape in layout:
            site = trace.nodes[name]
            value = site["value"].detach()
            prototype.add_node(
                name,
                type="sample",
                name=name,
                fn=dist.Normal(value, torch.ones_like(value)).to_event(len(shape)),
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
        self._layout = layout
        self.register_buffer("loc", loc)
        self.register_buffer("scale", scale)

    def _ensure_setup(self) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                "VOGNGuide is set up by VOGN: call vogn.step(x, y) (or vogn.load_state_dict) "
                "before using vogn.guide."
            )

    def _site_loc_scale(self, name: str, start: int, stop: int, shape) -> tuple:
        return self.loc[start:stop].view(shape), self.scale[start:stop].view(shape)

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every weight site from N(μ, σ²); returns ``{name: value}``."""
        self._ensure_setup()
        out = {}
        for name, start, stop, shape in self._layout:
            loc, scale = self._site_loc_scale(name, start, stop, shape)
            out[name] = pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape)))
        return out

    def get_posterior(self, name: str) -> dist.Distribution:
        """The Normal posterior of site ``name``."""
        self._ensure_setup()
        for site, start, stop, shape in self._layout:
            if site == name:
                loc, scale = self._site_loc_scale(site, start, stop, shape)
                return dist.Normal(loc, scale).to_event(len(shape))
        raise ValueError(
            f"unknown site {name!r}; the guide's sites are "
            f"{', '.join(repr(s[0]) for s in self._layout)}."
        )

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The posterior median (= mean μ) of every site."""
        self._ensure_setup()
        return {s[0]: self._site_loc_scale(*s)[0].clone() for s in self._layout}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal quantiles, shape ``(len(quantiles),) + site shape``."""
        self._ensure_setup()
        q = torch.as_tensor(quantiles, dtype=self.loc.dtype, device=self.loc.device)
        if q.dim() != 1 or q.numel() == 0 or not bool(((q > 0) & (q < 1)).all()):
            raise ValueError(
                f"quantiles must be a 1-d list of numbers in (0, 1); got {quantiles!r}."
            )
        z = torch.special.ndtri(q)
        out = {}
        for s in self._layout:
            loc, scale = self._site_loc_scale(*s)
            out[s[0]] = loc + scale * z.reshape((-1,) + (1,) * loc.dim())
        return out
