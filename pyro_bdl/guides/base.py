r"""Shared machinery of the per-site location-scale guides (:class:`AutoMeanField`,
:class:`AutoRadial`).

Every latent site gets its own location-scale distribution **on the site itself**, so an ELBO
sees the (posterior, prior) pair and can use an exact KL. The locations and the unconstrained
scales of consecutive sites are packed into one ``(2, n)`` parameter per block of at most
:data:`BLOCK_NUMEL` numbers (``loc_rho``, then ``loc_rho_1``, ... for larger models), as Pyro's
``AutoDiagonalNormal`` packs its sites: an optimizer then updates one tensor per block instead
of two per site, and the scales go through one softplus per block. The blocks are views of one
``(2, D)`` tensor whose rows are ``guide.loc`` and ``guide.rho``. The
:class:`~pyro_bdl.layout.SiteLayout` says where each site sits; each site reads a view of its
block, and the noise of a block's plate-free sites is drawn in one flat operation
(:meth:`flat_noise`). A model of several blocks takes each block's sites from one autograd node
(:class:`~pyro_bdl.guides.block_sites.BlockSites`), whose backward writes the block's gradient
once instead of concatenating the sites' gradients.

A subclass fills three small hooks: :meth:`AutoLocScaleGuide.site_posterior` (the distribution
of one unconstrained site given its location, scale and event dims), :meth:`flat_noise` (the
standardized noise ξ of one draw of every site of a block at once: the draw is μ + σ·ξ) and, for
non-Gaussian marginals, :meth:`site_quantiles`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoGuide
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.poutine.plate_messenger import PlateMessenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn

from pyro_bdl._grad_mode import sets_up
from pyro_bdl._validation import check_positive
from pyro_bdl.guides.access import SiteAccess, check_same_sites
from pyro_bdl.guides.block_sites import BlockSites, softplus
from pyro_bdl.guides.state_checks import CheckedLoad
from pyro_bdl.layout import Site, SiteLayout
from pyro_bdl.nn.lift import init_to_network

__all__ = ["AutoLocScaleGuide", "inverse_softplus"]

#: Sites are grouped in contiguous blocks of at most this many numbers (8 MB in fp32), each with
#: its own parameter: glibc hands every freed block above 32 MB back to the kernel, so D-long
#: temporaries (a gradient, Pyro's zeroed gradient, Adam's sqrt and quotient) would be mapped
#: and page-faulted in afresh at every step, while block-long ones reuse the heap.
BLOCK_NUMEL = 1 << 21


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """ρ with softplus(ρ) = x, stable for small and large x (x > 0)."""
    return x + torch.log(-torch.expm1(-x))


#: The attribute of a packed parameter naming the sites it was made for.
_SITES_ATTR = "_pyro_bdl_sites"


def _inside_plate() -> bool:
    """Whether the guide runs under a plate (its sites then get batch dims)."""
    return any(isinstance(m, PlateMessenger) for m in _PYRO_STACK)


class AutoLocScaleGuide(CheckedLoad, SiteAccess, AutoGuide):
    r"""Base class: one location-scale posterior per latent site, sampled on the site itself.

    Locations start from ``init_loc_fn`` (by default :func:`~pyro_bdl.init_to_network`, the
    network's own weights); scales are ``softplus(ρ)`` with ρ initialised so that every scale
    equals ``init_scale``. Sites with a constrained support get the distribution pushed through
    ``biject_to(support)``. Use a subclass: :class:`~pyro_bdl.guides.AutoMeanField` or
    :class:`~pyro_bdl.guides.AutoRadial`.

    Usage::

        guide = AutoMeanField(model)
        guide(x, y)                                  # creates the parameters lazily
        loc, scale = guide.locs_and_scales()["0.weight"]

    :param callable model: the Pyro model.
    :param float init_scale: initial posterior standard deviation of every unconstrained
        coordinate (> 0). Small scales suit network weights, larger ones (0.1) small models
        with wide posteriors; see :class:`~pyro_bdl.guides.AutoMeanField`.
    :param callable init_loc_fn: per-site initialisation strategy.
    :param callable create_plates: optional, as in :class:`~pyro.infer.autoguide.AutoGuide`.
    """

    #: Where each site sits in :attr:`loc_rho` (set by the first call of the guide).
    layout: SiteLayout
    derived_caches = ("_views", "_checked", "_flat")

    def __init__(
        self,
        model,
        *,
        init_scale: float = 1e-2,
        init_loc_fn=init_to_network,
        create_plates=None,
    ):
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)):
            raise TypeError(
                f"init_scale must be a float > 0; got {type(init_scale).__name__} {init_scale!r}. "
                "Pass a small positive Python float, e.g. 1e-2."
            )
        check_positive(
            "init_scale", float(init_scale), fix="Pass a small positive scale, e.g. 1e-2."
        )
        if not callable(init_loc_fn):
            raise TypeError(
                f"init_loc_fn must be callable (site -> tensor), e.g. pyro_bdl.init_to_network; "
                f"got {type(init_loc_fn).__name__}. Pass a function, or leave it out."
            )
        self._init_scale = float(init_scale)
        self.init_loc_fn = init_loc_fn
        super().__init__(InitMessenger(init_loc_fn)(model), create_plates=create_plates)
        self._no_plates = False

    # -- the hooks a subclass fills -------------------------------------------------------------

    def site_posterior(
        self, loc: torch.Tensor, scale: torch.Tensor, event_dim: int, *, value=None
    ) -> dist.TorchDistribution:
        """The posterior over one unconstrained site (``event_dim`` trailing dims form it).

        ``value``, when given, is a draw of this distribution made beforehand by
        :meth:`flat_sample`; the returned distribution's next ``rsample()`` must return it.
        """
        raise NotImplementedError

    def flat_noise(self, loc: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The standardized noise ξ of one draw of the sites of one block at once, without a
        graph: the draw is ``loc + scale * ξ`` (``loc`` is the block's flat locations, for the
        shape, dtype and device; the sites' sizes, in order, are ``sizes``)."""
        raise NotImplementedError

    def flat_sample(self, loc: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """One reparameterized draw of the sites of one block at once from the block's flat
        ``loc`` and ``scale`` (the sites' sizes, in order, are ``sizes``): ``loc + scale * ξ``
        with ξ from :meth:`flat_noise`. A subclass may override this instead of
        :meth:`flat_noise` (its blocks then take torch's split and unbind)."""
        return torch.addcmul(loc, scale, self.flat_noise(loc, sizes))

    # -- set-up ------------------------------------------------------------------------------

    @sets_up
    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        layout, loc = SiteLayout.from_trace(self.prototype_trace)
        self.layout = layout
        # Without plates on the latent sites (nor a create_plates or a master guide) the plates
        # dict stays empty: each step then skips rebuilding it.
        self.plates = {}
        self._no_plates = not self._prototype_frames and self.create_plates is None
        rho = inverse_softplus(torch.full_like(loc, self._init_scale))
        # One (2, n) parameter per block for both halves: the optimizer (pyro.optim keeps one
        # torch optimizer per parameter) and the param store do one update and one lookup per
        # block, and every gradient and optimizer temporary is one block long.
        flat = torch.stack([loc, rho])
        totals = self._blocks()[0]
        if len(totals) == 1:
            params = [nn.Parameter(flat)]
        else:  # views of one (2, D) tensor, which guide.loc and guide.rho show
            params = [nn.Parameter(part) for part in flat.split(totals, dim=1)]
            self.__dict__["_flat"] = flat
        # The param store keeps this very tensor: its site names let a later guide of the same
        # name, set up on a model whose sites changed, say which sites differ.
        params[0].__dict__[_SITES_ATTR] = tuple(layout.names)
        for name, param in zip(self._param_names(), params):
            setattr(self, name, param)

    def _param_names(self) -> list[str]:
        """Names of the blocks' parameters: ``loc_rho``, then ``loc_rho_1``, ``loc_rho_2``..."""
        count = len(self._blocks()[0])
        return ["loc_rho"] + [f"loc_rho_{k}" for k in range(1, count)]

    def split_packed(self, key: str, value: Any) -> dict[str, Any] | None:
        """This guide's block entries for an entry ``key`` that an older version saved when
        all blocks shared one ``(2, D)`` parameter ``loc_rho`` (``key`` ends in ``loc_rho``: a
        ``state_dict`` key, a param-store name, or an optimizer's state of that parameter);
        ``None`` where there is nothing to split.

        Usage (what ``load_state_dict`` and :func:`pyro_bdl.checkpoint.load_checkpoint` do)::

            blocks = guide.split_packed("AutoMeanField.loc_rho", old_tensor)
        """
        if self.prototype_trace is None or not key.endswith("loc_rho"):
            return None
        names, totals = self._param_names(), self._blocks()[0]
        if len(names) == 1:
            return None
        base = key[: -len("loc_rho")]

        def split(t: Any) -> list[Any] | None:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.layout.size:
                return list(t.split(totals, dim=1))
            return None

        parts = split(value)
        if parts is None:  # an optimizer's state_dict: split the moments, copy the rest
            state = value.get("state") if isinstance(value, dict) else None
            if not isinstance(state, dict) or len(state) != 1:
                return None
            ((index, moments),) = state.items()
            split_moments = {k: split(m) for k, m in moments.items()}
            if not any(split_moments.values()):
                return None

            def block_state(block: int) -> dict:
                # Counters are cloned: an optimizer advances them in place.
                return {
                    k: pieces[block]
                    if pieces
                    else (m.clone() if isinstance(m, torch.Tensor) else m)
                    for (k, m), pieces in zip(moments.items(), split_moments.values())
                }

            parts = [{**value, "state": {index: block_state(block)}} for block in range(len(names))]
        return {base + name: part for name, part in zip(names, parts)}

    def _upgrade_state(self, state_dict: dict, prefix: str) -> None:
        names = self._param_names() if self.prototype_trace is not None else []
        if len(names) > 1 and prefix + names[1] not in state_dict:
            blocks = self.split_packed(prefix + "loc_rho", state_dict.get(prefix + "loc_rho"))
            if blocks is not None:
                state_dict.update(blocks)

    def _check_sites(self, params: list[torch.Tensor]) -> None:
        """Refuse parameters (found in the param store under this guide's name) made for other
        sites than the model's."""
        check_same_sites(
            type(self).__name__,
            set_up=params[0].__dict__.get(_SITES_ATTR),
            now=self.layout.names,
            set_up_size=sum(p.shape[-1] for p in params),
            now_size=self.layout.size,
        )
        self.__dict__["_checked"] = params[0]

    def _ensure_setup(self) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__} has not seen the model yet; call the guide once with "
                "the model's arguments (for example guide(x, y) or one svi.step(x, y)) first."
            )

    # -- the guide -----------------------------------------------------------------------------

    @property
    def loc(self) -> torch.Tensor:
        """All posterior locations, flat (a view of the parameters; writable under
        ``torch.no_grad()``).

        A model of at most :data:`BLOCK_NUMEL` numbers has one parameter ``loc_rho`` and
        ``guide.loc`` is its row 0: after a call of the guide it is the very tensor that call
        used, so ``torch.autograd.grad(loss, [guide.loc, guide.rho])`` works. A larger model has
        one parameter per block (``loc_rho``, ``loc_rho_1``, ...), views of one flat tensor that
        ``guide.loc`` shows: take gradients with respect to ``guide.parameters()`` there."""
        return self._loc_rho_views()[0]

    @property
    def rho(self) -> torch.Tensor:
        """All free scale parameters ρ (σ = softplus(ρ)), flat; as :attr:`loc`, row 1."""
        return self._loc_rho_views()[1]

    @property
    def scale(self) -> torch.Tensor:
        """All posterior scales, flat (``softplus`` of the free parameter)."""
        return softplus(self.rho)

    def _loc_rho_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        # (loc view, rho view, version of loc_rho when they were made by unbind, else None)
        self._ensure_setup()
        names = self._param_names()
        if len(names) > 1:
            flat = self._shared_flat([self._parameters[n] for n in names])
            return flat[0], flat[1]
        packed = self._parameters["loc_rho"]
        views = self.__dict__.get("_views")
        if (
            views is None
            or views[0]._base is not packed
            or views[0].data_ptr() != packed.data_ptr()  # .to(), .double() swap the storage
            or views[0].requires_grad != packed.requires_grad
            # The last call's unbind views cannot enter a new graph once loc_rho changed in
            # place (an optimizer step): single views (select) can, so they replace them.
            or (views[2] is not None and views[2] != packed._version)
        ):
            with torch.enable_grad():
                views = packed[0], packed[1], None
            self._cache_views(views[:2], None)
        return views[0], views[1]

    def _shared_flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The (2, D) tensor the blocks' parameters are views of; made afresh (and the
        parameters pointed into it) where they no longer are (after ``.to()``, ``.double()``,
        unpickling, or a param store that was loaded)."""
        flat = self.__dict__.get("_flat")
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.shape[1])
        if flat is not None and all(
            p.dtype == flat.dtype
            and p.stride() == flat.stride()
            and p.data_ptr() == flat[:, start].data_ptr()
            for p, start in zip(params, offsets)
        ):
            return flat
        with torch.no_grad():
            flat = torch.cat([p.detach() for p in params], dim=1)
            for p, part in zip(params, flat.split([p.shape[1] for p in params], dim=1)):
                p.data = part
        self.__dict__["_flat"] = flat
        return flat

    def _cache_views(self, views, version) -> None:
        # Not under inference mode: views made there cannot enter autograd later.
        if not torch.is_inference_mode_enabled():
            self.__dict__["_views"] = (views[0], views[1], version)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_views", None)  # non-leaf views of loc_rho: rebuilt on demand
        state.pop("_checked", None)
        state.pop("_flat", None)  # made afresh from the parameters
        return state

    def forward(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Sample every latent site from its own posterior; returns ``{name: value}``."""
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        if self._no_plates and self.master is None:
            plates = self.plates
        else:
            plates = self._create_plates(*args, **kwargs)
        self._follow_param_store()
        params = [getattr(self, name) for name in self._param_names()]  # param-store lookups
        if params[0] is not self.__dict__.get("_checked"):
            self._check_sites(params)
        # Sites in contiguous blocks of about BLOCK_NUMEL numbers: every flat temporary of the
        # step (scale, noise, sample, their gradients) is one block long, not D long. torch's
        # split gives each site a view with ONE backward node for all of them (slicing per site
        # would make each slice's backward fill a zero tensor of the block's length).
        site_sizes, flat_blocks = self._blocks()[1:]
        # Fast path: draw the noise of every plate-free site in one operation per block. Under
        # an outer plate (vectorized particles, parallel Predictive) the sites are batched, so
        # each one samples for itself instead.
        flat = not _inside_plate()
        locs: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        values: list[torch.Tensor | None] = []
        # One autograd node per block (BlockSites) where it can be: torch's split and unbind
        # would copy the block's gradient several times over. The unbind path stays for a
        # single block, whose guide.loc / guide.rho are the very tensors of the step (autograd
        # can differentiate with respect to them), under torch.jit.trace, and for a subclass
        # that draws through its own flat_sample rather than flat_noise.
        fused = (
            len(params) > 1
            and not torch.jit.is_tracing()
            and type(self).flat_sample is AutoLocScaleGuide.flat_sample
        )
        for param, sizes, flat_block in zip(params, site_sizes, flat_blocks):
            draw = flat and flat_block
            if fused:
                with torch.no_grad():
                    noise = self.flat_noise(param[0], sizes) if draw else None
                out = BlockSites.apply(param, noise, sizes)
                count = len(sizes)
                locs += out[:count]
                scales += out[count : 2 * count]
                values += out[2 * count :] if draw else [None] * count
                continue
            # unbind: ONE backward node that stacks both gradients (two selects would each fill
            # a zero tensor of the full (2, n) size and then add them).
            block_loc, block_rho = param.unbind(0)
            if len(params) == 1:
                self._cache_views((block_loc, block_rho), param._version)
            block_scale = softplus(block_rho)
            locs += block_loc.split(sizes)
            scales += block_scale.split(sizes)
            if draw:
                values += self.flat_sample(block_loc, block_scale, sizes).split(sizes)
            else:
                values += [None] * len(sizes)
        result = {}
        for i, site in enumerate(self.layout):
            shape = site.shape
            site_loc, site_scale = locs[i], scales[i]
            if site_loc.shape != shape:  # a 1-d site already has its shape: skip the view
                site_loc, site_scale = site_loc.view(shape), site_scale.view(shape)
            if not site.frames:  # the common case for weights: no plate to enter
                value = values[i]
                if value is not None and value.shape != shape:
                    value = value.view(shape)
                fn = self._site_dist(site, site_loc, site_scale, value)
                result[site.name] = pyro.sample(site.name, fn)
                continue
            with ExitStack() as stack:
                for plate_name, dim in site.frames:
                    plate = plates[plate_name]
                    idx = stack.enter_context(plate)
                    if plate.subsample_size < plate.size:
                        site_loc = site_loc.index_select(dim - site.event_dim, idx)
                        site_scale = site_scale.index_select(dim - site.event_dim, idx)
                fn = self._site_dist(site, site_loc, site_scale, None)
                result[site.name] = pyro.sample(site.name, fn)
        return result

    def _blocks(self) -> tuple[list[int], list[list[int]], list[bool]]:
        """(numbers per block, site sizes per block, whether the block is drawn flat):
        consecutive sites grouped into blocks of at most :data:`BLOCK_NUMEL` numbers (a larger
        site is a block of its own).

        A block is drawn in one flat operation only if every site in it takes that draw (no
        plate, every dim an event dim); sites that sample for themselves form blocks of their
        own. A flat draw that no site used would be dropped from a traced graph (JIT dead-code
        elimination) while an eager step still consumed its random numbers, so traced and eager
        steps would see different noise for the same seed.
        """
        cached = self.__dict__.get("_block_cache")
        if cached is not None and cached[0] is self.layout:
            return cached[1]
        blocks: list[list[int]] = []
        flags: list[bool] = []
        for site in self.layout:
            takes_flat = site.whole and not site.frames
            if (
                not blocks
                or flags[-1] != takes_flat
                or (blocks[-1] and sum(blocks[-1]) + site.numel > BLOCK_NUMEL)
            ):
                blocks.append([])
                flags.append(takes_flat)
            blocks[-1].append(site.numel)
        result = [sum(b) for b in blocks], blocks, flags
        self.__dict__["_block_cache"] = (self.layout, result)
        return result

    def _site_dist(self, site: Site, loc: torch.Tensor, scale: torch.Tensor, value=None):
        fn = self.site_posterior(loc, scale, site.event_dim, value=value)
        if site.transform is not None:
            fn = dist.TransformedDistribution(fn, site.transform)
        return fn

    # -- per-site access, median, quantiles ----------------------------------------------------

    def get_posterior(self, name: str) -> dist.TorchDistribution:
        """The posterior distribution of site ``name`` (at full plate size)."""
        self._ensure_setup()
        site = self._site(name)
        loc, scale = self._site_loc_scale(site)
        return self._site_dist(site, loc, scale)

    def _site(self, name: str) -> Site:
        return self.layout[name]

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loc, self.scale

    def _site_loc_scale(self, site: Site) -> tuple[torch.Tensor, torch.Tensor]:
        # The softplus of this site's ρ only, not of the whole vector.
        loc = self.loc[site.slice].view(site.shape)
        scale = softplus(self.rho[site.slice]).view(site.shape)
        return loc, scale

    @torch.no_grad()
    def set_loc_scale(self, name: str, *, loc=None, scale=None) -> None:
        """Overwrite the location and/or scale of site ``name`` (unconstrained space).

        Usage::

            guide.set_loc_scale("0.weight", scale=1e-3)   # a float or a tensor of the site shape
        """
        self._ensure_setup()
        site = self._site(name)
        if scale is not None:
            check_positive(f"scale of site {name!r}", scale, fix="Pass a positive scale.")
        # Check both values before changing anything (fail at the boundary).
        new = {}
        for what, value in (("loc", loc), ("scale", scale)):
            if value is None:
                continue
            value = torch.as_tensor(value, dtype=self.loc.dtype, device=self.loc.device)
            try:
                new[what] = value.expand(site.shape).reshape(-1)
            except RuntimeError:
                raise ValueError(
                    f"{what} for site {name!r} must broadcast to {tuple(site.shape)}; got shape "
                    f"{tuple(value.shape)}. Pass a number or a tensor of the site's shape."
                ) from None
        if "loc" in new:
            self.loc[site.start : site.stop] = new["loc"]
        if "scale" in new:
            self.rho[site.start : site.stop] = inverse_softplus(new["scale"])
