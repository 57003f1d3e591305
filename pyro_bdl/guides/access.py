"""Per-site access to a posterior over the flat vector, written once for every guide.

A guide that mixes in :class:`SiteAccess` provides :attr:`layout` (a
:class:`~pyro_bdl.layout.SiteLayout`), ``_ensure_setup()`` and :meth:`SiteAccess.flat_loc_scale`
(the marginal location and scale of every unconstrained coordinate); it then has ``median``,
``quantiles``, ``locs_and_scales``, ``site_names`` and ``num_latents``. A guide whose marginals
are not Gaussian overrides :meth:`SiteAccess.site_quantiles`; one whose median is not the
marginal location (or exists before the marginals do) overrides :meth:`SiteAccess.flat_median`.

A guide that packs its sites into fixed-size parameters covers the sites it was set up on only;
:func:`check_same_sites` is the one check that the model still has those sites.

A guide's set-up runs whatever the caller's grad mode (:func:`~pyro_bdl._grad_mode.sets_up`), so
that a guide first called under ``torch.no_grad()`` or ``torch.inference_mode()`` (an evaluation,
a ``Predictive``) trains afterwards, and ``copy.deepcopy`` copies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyro
import torch
from pyro.infer.autoguide.guides import prototype_hide_fn

from pyro_bdl.layout import Site, SiteLayout
from pyro_bdl.models.network import LIKELIHOOD

__all__ = ["SiteAccess", "SiteSetChangedError", "check_quantiles", "check_same_sites"]


def check_quantiles(quantiles, like: torch.Tensor) -> torch.Tensor:
    """``quantiles`` as a 1-d tensor like ``like``, refused unless every value is in (0, 1)."""
    q = torch.as_tensor(quantiles, dtype=like.dtype, device=like.device)
    if q.dim() != 1 or q.numel() == 0 or not bool(((q > 0) & (q < 1)).all()):
        raise ValueError(
            f"quantiles must be a non-empty 1-d list of numbers in (0, 1); got {quantiles!r}. "
            "Pass for example [0.05, 0.5, 0.95]."
        )
    return q


class SiteSetChangedError(ValueError):
    """The model's latent sites are not those a packed guide was set up on."""


def check_same_sites(
    guide: str,
    *,
    set_up: Sequence[str] | None,
    now: Sequence[str],
    set_up_size: int | None = None,
    now_size: int | None = None,
) -> None:
    """Refuse, naming the new and missing sites, unless ``now`` are the sites ``set_up``.

    A guide that packs every site into parameters of a fixed size (mean-field, Radial, SWAG,
    Laplace) cannot follow a model that declares new sites, or drops some, after the guide was
    set up (Pyro's idiom of a model that grows). Where the names of the set-up sites are unknown
    (``set_up=None``: parameters restored from elsewhere), the packed sizes are compared.

    :param str guide: the guide's name, for the message.
    :param set_up: the site names the parameters were made for, in order, or ``None``.
    :param now: the model's site names now.
    :param int set_up_size: numbers in the parameters (compared when ``set_up`` is ``None``).
    :param int now_size: numbers the sites need now.
    :raises SiteSetChangedError: if they differ.
    """
    # Every guide of a class has the same parameter names in Pyro's store, so these were made
    # by an earlier guide: over another network, or over this model before it changed.
    fix = (
        f"Every {guide} stores its parameters under the same names, so a second {guide} in one "
        "program (for another network, or for a model that has grown or lost a site) finds "
        "the first one's: call pyro.clear_param_store() before building it. For a model "
        f"whose sites change while it trains use pyro.infer.autoguide.AutoNormal ({guide} "
        "packs a fixed set of sites), which keeps each site's parameters apart."
    )
    if set_up is not None:
        if list(set_up) == list(now):
            return
        new = [n for n in now if n not in set(set_up)]
        missing = [n for n in set_up if n not in set(now)]
        listed = lambda names: ", ".join(map(repr, names)) or "none"  # noqa: E731
        raise SiteSetChangedError(
            f"Pyro's param store holds {guide} parameters made for other sites than the "
            f"model's: new sites {listed(new)}; missing sites {listed(missing)}"
            + ("; the same sites in another order" if not new and not missing else "")
            + f". {fix}"
        )
    if set_up_size is not None and now_size is not None and set_up_size != now_size:
        raise SiteSetChangedError(
            f"Pyro's param store holds {guide} parameters made for other sites than the "
            f"model's: they hold {set_up_size} numbers, the model's sites "
            f"({', '.join(map(repr, now))}) need {now_size}. {fix}"
        )


class SiteAccess:
    """Mixin: ``median``, ``quantiles`` and ``locs_and_scales`` from :meth:`flat_loc_scale`;
    and a guide whose parameters follow ``.to(device)`` / ``.to(dtype)`` into Pyro's param store
    (see :meth:`_apply`) and, where it calls :meth:`_follow_param_store`, a store loaded after
    it was set up."""

    layout: SiteLayout
    prototype_trace: object
    # Pyro's autoguides record every sample site that is not observed: a ready-made model's
    # likelihood called with y=None (Predictive(model, guide)(x) as the guide's first call)
    # would become a latent of the guide, refused as discrete or, for a regressor, fitted.
    _prototype_hide_fn = staticmethod(
        lambda msg: prototype_hide_fn(msg) or bool(msg.get("infer", {}).get(LIKELIHOOD))
    )
    #: Attributes caching tensors made from the parameters (views, checked identities): dropped
    #: when the parameters are converted, rebuilt on demand.
    derived_caches: tuple[str, ...] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        """``nn.Module._apply`` (behind ``.to()``, ``.double()``, ``.cuda()``) that keeps the
        guide's state in one place: where torch replaces a parameter by a new tensor rather
        than swapping its data (a move to a device whose tensors cannot share the old storage
        type, such as ``meta``), the param store, which SVI's optimizer updates, would keep the
        old tensor on the old device; it is pointed at the new one (with the attributes the old
        one carried), and the cached views of the old one are dropped."""
        before = dict(self._parameters)  # type: ignore[attr-defined]
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        for key in self.derived_caches:
            self.__dict__.pop(key, None)
        store = pyro.get_param_store()
        for name, new in self._parameters.items():  # type: ignore[attr-defined]
            old = before.get(name)
            if new is None or old is None or new is old:
                continue
            for key, value in old.__dict__.items():
                new.__dict__.setdefault(key, value)
            fullname = self._pyro_get_fullname(name)  # type: ignore[attr-defined]
            # Only an unconstrained entry holding the old tensor itself is this parameter.
            if fullname in store and store[fullname] is old:
                del store[fullname]
                store[fullname] = new
        return out

    def _follow_param_store(self) -> None:
        """Take the param store's tensor for each parameter that the store holds under the
        guide's name as another tensor of the same shape (``pyro.get_param_store().load(...)``
        or ``set_state`` after the guide was set up). SVI's optimizer updates the store's
        tensors, so a guide that sampled from its own would go on drawing the values from before
        the load, and no step would change it any more. Called where the guide runs, as Pyro's
        ``PyroParam`` follows the store only inside a ``PyroModule``'s call (a plain
        ``nn.Parameter`` does not follow it at all): ``median()`` and the other readers outside
        a call read the guide's own parameters, which an ensemble copies its members from."""
        if not self._pyro_context.used:  # type: ignore[attr-defined]
            return  # never called under its name: the store holds nothing of it
        store = pyro.get_param_store()
        adopted = False
        for name, own in self._parameters.items():  # type: ignore[attr-defined]
            fullname = self._pyro_get_fullname(name)  # type: ignore[attr-defined]
            if own is None or fullname not in store:
                continue
            stored = store[fullname]
            # Another shape is another guide's parameter under the same name: not this one's.
            if stored is own or stored.shape != own.shape:
                continue
            if not isinstance(stored, torch.nn.Parameter):  # a state of plain tensors
                # Contiguous, so that the store keeps this very tensor rather than a copy.
                stored = torch.nn.Parameter(stored.detach().contiguous())
                store[fullname] = stored
            self._parameters[name] = stored  # type: ignore[attr-defined]
            adopted = True
        if adopted:
            for key in self.derived_caches:
                self.__dict__.pop(key, None)

    def _ensure_setup(self) -> None:
        raise NotImplementedError

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Marginal ``(location, scale)`` of every unconstrained coordinate, each ``(D,)``."""
        raise NotImplementedError

    def flat_median(self) -> torch.Tensor:
        """The unconstrained vector whose image on the support is the median, ``(D,)``; the
        marginal location by default."""
        return self.flat_loc_scale()[0]

    def site_quantiles(
        self, loc: torch.Tensor, scale: torch.Tensor, event_dim: int, q: torch.Tensor
    ) -> torch.Tensor:
        """Marginal quantiles ``q`` (shape ``(Q,) + (1,) * loc.dim()``) of one site; Gaussian
        marginals by default."""
        return loc + scale * torch.special.ndtri(q)

    def _site_loc_scale(self, site: Site) -> tuple[torch.Tensor, torch.Tensor]:
        """Marginal ``(location, scale)`` of one site, each of the site's shape."""
        loc, scale = self.flat_loc_scale()
        return loc[site.slice].view(site.shape), scale[site.slice].view(site.shape)

    def _setup_from(self, args, kwargs) -> None:
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)  # type: ignore[attr-defined]
        self._ensure_setup()

    @torch.no_grad()
    def locs_and_scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (loc, scale)}`` of every site in unconstrained space (detached copies)."""
        self._ensure_setup()
        loc, scale = (self.layout.split(t.detach()) for t in self.flat_loc_scale())
        return {s.name: (l.clone(), c.clone()) for s, l, c in zip(self.layout, loc, scale)}

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Posterior median of every site (the location pushed onto the support)."""
        self._setup_from(args, kwargs)
        loc = self.layout.split(self.flat_median())
        return {s.name: s.constrain(v).clone() for s, v in zip(self.layout, loc)}

    @torch.no_grad()
    def quantiles(self, quantiles, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Marginal posterior quantiles of every site, shape ``(len(quantiles),) + site shape``.

        Usage::

            lo, hi = guide.quantiles([0.05, 0.95])["0.weight"]
        """
        self._setup_from(args, kwargs)
        loc, scale = self.flat_loc_scale()
        q = check_quantiles(quantiles, loc)
        out = {}
        for site, site_loc, site_scale in zip(
            self.layout, self.layout.split(loc), self.layout.split(scale)
        ):
            qs = q.reshape((-1,) + (1,) * site_loc.dim())
            out[site.name] = site.constrain(
                self.site_quantiles(site_loc, site_scale, site.event_dim, qs)
            )
        return out

    @property
    def site_names(self) -> list[str]:
        """Names of the latent sites, in the model's order."""
        self._ensure_setup()
        return self.layout.names

    def num_latents(self) -> int:
        """Total number of unconstrained latent numbers."""
        self._ensure_setup()
        return self.layout.size
