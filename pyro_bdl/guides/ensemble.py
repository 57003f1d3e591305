r"""Deep ensembles and MultiSWAG as ordinary Pyro guides over a lifted network.

A deep ensemble (Lakshminarayanan et al., NeurIPS 2017) is M networks trained from independent
initialisations; MultiSWAG (Wilson & Izmailov, NeurIPS 2020) fits a SWAG Gaussian around each.
Both are read here as one posterior over the packed weight vector, the equal-weight mixture

.. math::

    q(\theta) = \frac{1}{M}\sum_{m=1}^{M} q_m(\theta), \qquad
    q_m = \delta_{\theta_m} \text{ (ensemble)} \text{ or } \mathcal N(\bar\theta_m, \Sigma_m)
    \text{ (MultiSWAG)},

so a draw picks a member uniformly and draws from it (:class:`MemberMixture`; the guides
:class:`AutoEnsemble` and :class:`AutoMultiSWAG` share :class:`MemberGuide`): ``Predictive``,
:func:`~pyro_bdl.predictive.sample_outputs`, :func:`~pyro_bdl.diagnostics.export.to_inference_data`
and the metrics use :class:`AutoEnsemble` and :class:`AutoMultiSWAG` like any other guide. For
the predictive itself, :meth:`MemberGuide.member_outputs` enumerates the members instead of
sampling them, so its average is the exact equal-weight mixture of the members' predictives.
Where each site sits in the packed vector is the model's :class:`~pyro_bdl.layout.SiteLayout`;
per-site summaries are :class:`~pyro_bdl.guides.access.SiteAccess`'s: ``median`` is the mixture's
mean and ``quantiles`` those of the Gaussian with the mixture's mean and variance per weight (a
summary, not the mixture's own quantiles, which for point masses are member values). The method:
docs/design/ensemble.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import TorchDistribution, constraints
from pyro.infer.autoguide import AutoContinuous
from torch import nn
from torch.distributions import Distribution

from pyro_bdl._grad_mode import sets_up
from pyro_bdl._validation import check_positive_int
from pyro_bdl.guides.access import SiteAccess
from pyro_bdl.guides.state_checks import CheckedLoad
from pyro_bdl.guides.swag import AutoSWAG
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn import init_to_network
from pyro_bdl.predictive import DEFAULT_MAX_MEMORY, draw_outputs

__all__ = ["AutoEnsemble", "AutoMultiSWAG", "MemberGuide", "MemberMixture"]


#: The dtypes of a member index tensor (one member per draw).
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_member(member: object, count: int) -> int | torch.Tensor | None:
    """``member`` if it chooses among ``count`` members: ``None`` (uniformly), an int in
    ``[0, count)``, or a 1-D integer tensor (a member per draw; its values are not read here,
    which would wait for the device on every draw)."""
    if member is None:
        return None
    if isinstance(member, torch.Tensor):
        if member.dim() == 1 and member.dtype in _INDEX_DTYPES:
            return member
    elif isinstance(member, int) and not isinstance(member, bool) and 0 <= member < count:
        return member
    raise ValueError(
        f"member must be None or an int in [0, {count}) (there are {count} members), or a 1-D "
        f"integer tensor of such (the member of each draw); got {member!r}."
    )


class MemberMixture(TorchDistribution):
    r"""Equal-weight mixture of ``members``, each a distribution with event shape ``(D,)`` and no
    batch shape.

    Sampling draws the member indices of all ``n`` draws at once. Which member a draw comes from
    is data, never a shape, so a traced guide (``JitTrace_ELBO``, ``pyro.ops.jit.trace``) draws
    other members on later calls: point masses are gathered from their stacked locations
    (``index_select``); other members are drawn each only for the draws that picked it (``n``
    draws in all, not ``M · n``), except under tracing, where every member is drawn for every
    draw and the picked ones gathered (``M · n`` draws, shapes that do not depend on the index).

    :param members: the M component distributions (point masses, SWAG Gaussians, ...).
    :param member: draw from this member only (an int); or draw ``i`` of the flattened
        ``sample_shape + batch_shape`` from member ``member[i]`` (a 1-D integer tensor with an
        entry per draw: a plate of draws enumerates the members so); or pick uniformly per draw
        (``None``).
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = False

    def __init__(
        self,
        members: Sequence[Distribution],
        *,
        member: int | torch.Tensor | None = None,
        batch_shape: torch.Size | tuple[int, ...] = (),
    ):
        self.members = tuple(members)
        if not self.members:
            raise ValueError("MemberMixture needs at least one member distribution; got none.")
        self.member = _check_member(member, len(self.members))
        event_shape = self.members[0].event_shape
        super().__init__(torch.Size(batch_shape), event_shape, validate_args=False)

    def expand(self, batch_shape, _instance=None):
        # Pyro's plates (Predictive(parallel=True), sample_outputs) expand the distribution:
        # a draw of the expanded mixture is one independent mixture draw per batch element.
        return MemberMixture(self.members, member=self.member, batch_shape=batch_shape)

    def _stacked(self, attr: str) -> torch.Tensor:
        return torch.stack([getattr(m, attr) for m in self.members])

    @property
    def mean(self) -> torch.Tensor:
        """The average of the members' means."""
        return self._stacked("mean").mean(0).expand(self.batch_shape + self.event_shape)

    @property
    def variance(self) -> torch.Tensor:
        r"""Law of total variance: :math:`\frac1M\sum_m \sigma_m^2 + \frac1M\sum_m (\mu_m -
        \bar\mu)^2`, coordinate by coordinate."""
        means = self._stacked("mean")
        spread = (means - means.mean(0)).square().mean(0)
        total = self._stacked("variance").mean(0) + spread
        return total.expand(self.batch_shape + self.event_shape)

    def sample(self, sample_shape=torch.Size()) -> torch.Tensor:
        shape = torch.Size(sample_shape) + self.batch_shape
        with torch.no_grad():
            if isinstance(self.member, int):
                return self.members[self.member].sample(shape)
            n = shape.numel()
            device = self.members[0].mean.device
            if self.member is None:
                index = torch.randint(len(self.members), (n,), device=device)
            elif self.member.numel() == n:
                # Kept where it was given: the rows of each member are found on the host for a
                # host index (member_outputs' own), with no wait for the device.
                index = self.member
            else:
                raise ValueError(
                    f"member names the members of {self.member.numel()} draws, but {n} are "
                    f"drawn (sample and batch shape {tuple(shape)}); give one member per draw."
                )
            if all(isinstance(m, dist.Delta) for m in self.members):
                locs = torch.stack([cast(dist.Delta, m).v for m in self.members])
                return locs.index_select(0, index.to(device)).reshape(shape + self.event_shape)
            if torch.jit.is_tracing():
                draws = torch.stack([m.sample(torch.Size([n])) for m in self.members])
                index = index.to(device)
                picked = index.view(1, n, *(1,) * len(self.event_shape)).expand(1, *draws.shape[1:])
                return draws.gather(0, picked).reshape(shape + self.event_shape)
            out: torch.Tensor | None = None
            for k, member in enumerate(self.members):
                rows = (index == k).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                draw = member.sample(torch.Size([rows.numel()]))
                if out is None:
                    out = draw.new_empty((n, *self.event_shape))
                out[rows.to(device)] = draw
            assert out is not None  # n >= 1, so some member was picked
            return out.reshape(shape + self.event_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """:math:`\\log \\frac1M \\sum_m q_m(\\theta)`; for a fixed member, that member's."""
        if isinstance(self.member, int):
            return self.members[self.member].log_prob(value)
        parts = torch.stack([m.log_prob(value) for m in self.members], -1)
        if self.member is None:
            return parts.logsumexp(-1) - math.log(len(self.members))
        index = self.member.to(parts.device).reshape(parts.shape[:-1])
        return parts.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _count(members: object) -> int | None:
    """M when ``members`` is a count (a guide to be filled by ``load_state_dict``), else None."""
    if isinstance(members, bool):
        raise TypeError(
            f"members must be a sequence of trained members or an int M >= 1; got the bool "
            f"{members!r}. Pass a list of members, or the count M as an int."
        )
    return check_positive_int("members", members) if isinstance(members, int) else None


def _as_list(members: object, what: str) -> list:
    if isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Sequence):
        raise TypeError(
            f"members must be a list of {what} (or an int M >= 1 for an empty guide to load a "
            f"state into); got {type(members).__name__}. Pass a list, e.g. members=[g1, g2]."
        )
    if not members:
        raise ValueError(
            f"members must hold at least one of {what}; got an empty list (M = 0). Pass at least "
            "one member."
        )
    return list(members)


def _signature(layout_or_values) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(layout_or_values, SiteLayout):
        return [(s.name, tuple(s.shape)) for s in layout_or_values]
    # Values are packed by the model's layout, so the order of their keys does not matter.
    return sorted((name, tuple(v.shape)) for name, v in layout_or_values.items())


def _check_same_layout(signatures: list, what: str) -> None:
    """Refuse members whose sites (names, order, shapes) differ from member 0's."""
    first = signatures[0]
    for k, other in enumerate(signatures[1:], 1):
        if other != first:
            diff = sorted(set(other) ^ set(first))[:4]
            raise ValueError(
                f"members[{k}] has another site layout than members[0] (differing sites, name "
                f"and shape: {diff}); every {what} must be of the same lifted model: the same "
                "network architecture and prior, so the same sites and shapes."
            )


def _refuse_shared_parameters(guides: Sequence[nn.Module]) -> None:
    """Refuse guides that hold the same parameter tensors: they are one member, not several."""
    owner: dict[int, int] = {}
    for k, guide in enumerate(guides):
        for p in guide.parameters():
            j = owner.setdefault(id(p), k)
            if j != k:
                raise ValueError(
                    f"members[{j}] and members[{k}] share their parameter tensors, so they are "
                    "the same member: Pyro's param store names the parameters of every guide of "
                    "a kind alike, and a guide trained in a store that still holds another's "
                    "trains that one's tensors. Call pyro.clear_param_store() before building "
                    "and training each member (as from_training does), or pass each member's "
                    "values (guide.median()) as soon as it is trained."
                )


def _refuse_identical(members: Sequence[Sequence[torch.Tensor]]) -> None:
    """Refuse members whose weights are equal bit for bit: one member counted twice, not an
    independent run (an equal-weight mixture would weight it double)."""
    for j in range(len(members)):
        for k in range(j + 1, len(members)):
            if all(torch.equal(a, b) for a, b in zip(members[j], members[k], strict=True)):
                raise ValueError(
                    f"members[{j}] and members[{k}] hold the same weights bit for bit, so they "
                    "are one run, not independent ones: their training started from the same "
                    "initial weights and drew the same noise (a build() that seeds its own "
                    "network, such as torch.manual_seed(0) inside it, undoes from_training's "
                    "seed + k). Initialise each member from its own seed."
                )


def _release_from_param_store(guides: Sequence[nn.Module]) -> None:
    """Remove from Pyro's param store the entries that are these guides' own parameters."""
    own = {id(p) for guide in guides for p in guide.parameters()}
    store = pyro.get_param_store()
    for name, value in list(store.named_parameters()):
        if id(value) in own:
            del store[name]


class MemberGuide(CheckedLoad, SiteAccess, AutoContinuous):
    """Base of :class:`AutoEnsemble` and :class:`AutoMultiSWAG`: the guide of the mixture
    :class:`MemberMixture` over the packed vector. A subclass
    provides :meth:`member_posteriors` and sets up its members in :meth:`_setup_members`."""

    layout: SiteLayout

    def __init__(self, model: Callable, num_members: int, *, init_loc_fn=init_to_network):
        self.num_members = num_members
        self._member: int | torch.Tensor | None = None
        super().__init__(model, init_loc_fn=init_loc_fn)

    @sets_up
    def _setup_prototype(self, *args, **kwargs):
        # All or nothing: a refused set-up (members of another model) leaves the guide as it
        # was before, so the next call refuses the same way instead of meeting a half-built one.
        try:
            super()._setup_prototype(*args, **kwargs)
            self.layout, init = SiteLayout.from_trace(self.prototype_trace, full_plates=False)
            self._setup_members(init)
        except BaseException:
            self.prototype_trace = None
            self.__dict__.pop("layout", None)
            raise

    def _setup_members(self, init: torch.Tensor) -> None:
        """Check the members against the model's sites, then build them; nothing of the guide
        changes before every check has passed."""
        raise NotImplementedError

    def _ensure_setup(self, use: str = "") -> None:
        """Refuse ``use`` (what the caller is about to do) before the guide has seen the model."""
        if self.prototype_trace is None:
            before = f" before {use}" if use else ""
            raise RuntimeError(
                f"{type(self).__name__} has not seen the model yet; call the guide once with the "
                f"model's training arguments (for example guide(x, y)){before}."
            )

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        """The M members' distributions over the packed unconstrained vector, each ``(D,)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ choosing members

    @property
    def member(self) -> int | torch.Tensor | None:
        """``None`` (each draw picks a member uniformly), the one member every draw uses, or
        the member of each draw of a plate (a 1-D integer tensor; see :meth:`use_member`)."""
        return self._member

    @member.setter
    def member(self, value: int | torch.Tensor | None) -> None:
        value = _check_member(value, self.num_members)
        if isinstance(value, torch.Tensor) and not bool(
            ((value >= 0) & (value < self.num_members)).all()
        ):
            raise ValueError(
                f"member must hold member indices in [0, {self.num_members}) (this guide has "
                f"{self.num_members} members); got values {value.unique().tolist()[:8]}."
            )
        self._member = value

    @contextmanager
    def use_member(self, k: int | torch.Tensor) -> Iterator[None]:
        """Draw from member ``k`` only inside the block; or, for a 1-D integer tensor ``k``,
        draw ``i`` of the guide's plate from member ``k[i]`` (``len(k)`` draws under one plate
        then enumerate members in one vectorized pass, as :meth:`member_outputs` does)."""
        previous = self._member
        self.member = k
        try:
            yield
        finally:
            self._member = previous

    # ------------------------------------------------------------------ posterior

    def get_posterior(self, *args, **kwargs) -> MemberMixture:
        """The equal-weight mixture of :meth:`member_posteriors` (one member if :attr:`member`
        is set)."""
        self._ensure_setup()
        return MemberMixture(self.member_posteriors(), member=self._member)

    def flat_loc_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixture's marginal mean and standard deviation of every unconstrained number."""
        posterior = MemberMixture(self.member_posteriors())
        return posterior.mean, posterior.variance.sqrt()

    @torch.no_grad()
    def member_outputs(
        self,
        model,
        *args: Any,
        num_samples: int = 1,
        parallel: bool = True,
        max_parallel: int | None = None,
        max_memory: int = DEFAULT_MAX_MEMORY,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The model's return values (the network outputs, as for
        :func:`~pyro_bdl.predictive.sample_outputs`) of every member: shape
        ``(M, num_samples, *output_shape)``.

        Member m's ``num_samples`` draws come from member m alone, in the order m = 0 … M − 1,
        so averaging a predictive over dims 0 and 1 weights each member's predictive exactly
        1/M (no draw of the member index)::

            probs = guide.member_outputs(model, x_test).softmax(-1).mean((0, 1))

        The M · ``num_samples`` draws run as :func:`~pyro_bdl.predictive.sample_outputs`'s
        draws, the member of each chosen by :meth:`use_member`: by default in one vectorized
        pass of the network (plus, on the model's first call with rows of this shape, a pass
        on one row that checks the output's memory first), which costs less than M plain
        forward passes.

        :param model: the model the guide belongs to (as for
            :func:`~pyro_bdl.predictive.sample_outputs`).
        :param int num_samples: draws per member (1 is exact for an ensemble of point masses).
        :param bool parallel: all draws in one vectorized pass (``True``) or one after the other
            (``False``, one forward pass each); as in ``sample_outputs``.
        :param int max_parallel: at most this many draws per vectorized pass (default: all).
        :param int max_memory: at most this many bytes for the returned outputs (default 4
            GiB), checked before any member's draws run.
        """
        # Set up on the training arguments, never here: prediction arguments lack the targets,
        # which the set-up would then take for latent sites (Pyro's "discrete sample site").
        self._ensure_setup("member_outputs")
        check_positive_int("num_samples", num_samples)
        order = torch.arange(self.num_members).repeat_interleave(num_samples)

        def draws(start: int, size: int):
            # One draw has no plate, so it takes the member as an int: the plain draw.
            return self.use_member(int(order[start]) if size == 1 else order[start : start + size])

        out = draw_outputs(
            model,
            self,
            args,
            kwargs,
            num_samples=len(order),
            parallel=parallel,
            max_parallel=max_parallel,
            max_memory=max_memory,
            draws=draws,
        )
        return out.reshape(self.num_members, num_samples, *out.shape[1:])

    # ------------------------------------------------------------------ training members

    @classmethod
    def from_training(
        cls,
        build: Callable[[], Callable],
        train: Callable[[Callable], Any],
        num_members: int = 5,
        *,
        seed: int = 0,
        **options: Any,
    ):
        """Train ``num_members`` members independently and combine them.

        For member k the RNGs are seeded with ``seed + k`` and Pyro's parameter store is
        cleared, then ``build()`` makes a fresh lifted model (its network initialised anew
        under that seed) and ``train(model)`` trains it and returns the member (see the
        subclass). The guide is over the first member's model; call it once with the model's
        training arguments before use, as every autoguide.

        Usage::

            guide = AutoEnsemble.from_training(build, train_map, num_members=5)
        """
        check_positive_int("num_members", num_members)
        models, members = [], []
        for k in range(num_members):
            pyro.set_rng_seed(seed + k)
            pyro.clear_param_store()
            model = build()
            members.append(cls._keep(k, train(model)))
            models.append(model)
        build_guide: Any = cls  # the subclasses take the members where the base takes M
        return build_guide(models[0], members, **options)

    @classmethod
    def _keep(cls, k: int, member):
        """What of a freshly trained member to keep before the next member trains (Pyro's
        parameter store names the parameters of every guide of a kind alike, so the next
        member's training overwrites what an earlier guide reads through the store)."""
        return member


class AutoEnsemble(MemberGuide):
    r"""A deep ensemble: the uniform mixture of M point estimates of one lifted model.

    A draw is one member's weights, chosen uniformly; :meth:`member_outputs` enumerates them.
    The M packed vectors are one ``(M, D)`` buffer, ``ensemble_locs``, so ``state_dict`` /
    ``load_state_dict`` round-trip the ensemble (a state of another M or another network is
    refused whole, before anything changes).

    Usage::

        members = []
        for k in range(5):                         # independent initialisations
            pyro.set_rng_seed(k); pyro.clear_param_store()
            model = bdl.models.classifier(bdl.bayesianize(make_net()), n)
            delta = AutoDelta(model)
            ...                                    # SVI on the MAP objective
            members.append(delta.median())
        guide = AutoEnsemble(model, members)
        guide(x, y)                                # set up on the model's sites
        probs = guide.member_outputs(model, x_test).softmax(-1).mean((0, 1))

    :param callable model: the Pyro model over the lifted network (any member's).
    :param members: the M trained members, each ``{site name: value}`` (as
        ``AutoDelta.median()`` gives) or a trained guide with a ``median()`` method; or an int
        M for an empty ensemble (every member at the network's initial weights) to load a
        ``state_dict`` into. A guide's values are copied now, from its own parameters (not
        through Pyro's param store, which names every AutoDelta's parameters alike): guides each
        trained after ``pyro.clear_param_store()`` stay distinct members. Guides that share
        parameter tensors (trained one after the other without clearing the store, so they
        trained the same tensors) are refused, as are guides that never ran, members with NaN
        or inf, and members equal bit for bit (one run counted twice).
    :param callable init_loc_fn: initial weights of an empty ensemble's members.

    References:

    [1] `Simple and Scalable Predictive Uncertainty Estimation using Deep Ensembles`,
        Balaji Lakshminarayanan, Alexander Pritzel, Charles Blundell (NeurIPS 2017)
    """

    ensemble_locs: torch.Tensor

    def __init__(self, model: Callable, members, *, init_loc_fn: Callable = init_to_network):
        count = _count(members)
        self._values: list[dict[str, torch.Tensor]] | None = None
        if count is None:
            listed = _as_list(members, "point estimates (dicts of site values or guides)")
            _refuse_shared_parameters([m for m in listed if isinstance(m, nn.Module)])
            self._values = [self._member_values(k, m) for k, m in enumerate(listed)]
            _check_same_layout([_signature(v) for v in self._values], "ensemble member")
            _refuse_identical(
                [[values[name] for name in sorted(values)] for values in self._values]
            )
            count = len(self._values)
        super().__init__(model, count, init_loc_fn=init_loc_fn)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # Members given as values wait in ``_values`` until the guide sees the model (the
        # layout that packs them comes from its trace): ``.to()``, ``.double()`` and ``.cuda()``
        # convert them there as they convert the buffer that later holds them.
        out = super()._apply(fn, recurse)
        if self._values is not None:
            self._values = [{k: fn(v) for k, v in values.items()} for values in self._values]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Reached also when the guide sits inside another module. Members given as values are
        # packed only on the first call (the packing needs the model's sites), so a state saved
        # before it would hold none of them and load into nothing.
        if self._values is not None:
            self._ensure_setup("state_dict() (the members are packed into it then)")
        super()._save_to_state_dict(destination, prefix, keep_vars)

    @classmethod
    def _keep(cls, k: int, member):
        return cls._member_values(k, member)  # the weights, copied now

    @staticmethod
    def _member_values(k: int, member) -> dict[str, torch.Tensor]:
        if not isinstance(member, Mapping):
            median = getattr(member, "median", None)
            if not callable(median):
                raise TypeError(
                    f"members[{k}] must be a dict of site values or a trained guide with a "
                    f"median() method (e.g. AutoDelta); got {type(member).__name__}."
                )
            if getattr(member, "prototype_trace", False) is None:
                raise ValueError(
                    f"members[{k}] is an {type(member).__name__} that has not seen the model "
                    "yet, so it holds no trained weights; train it (SVI steps on the model's "
                    "data) before passing it, or pass its values (guide.median())."
                )
            # The guide's own parameters, not the param store's: the store names the parameters of
            # every guide of a kind alike (AutoDelta.<site>), so through it every member trained
            # after pyro.clear_param_store() would read the last one's values.
            with pyro.get_param_store().scope():  # an empty store, the user's comes back
                member = median()
        values = {}
        for name, value in member.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"members[{k}][{name!r}] must be a tensor; got {type(value).__name__}. Pass "
                    "the member's site values as tensors (guide.median())."
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"members[{k}][{name!r}] contains NaN or inf; train that member again with "
                    "a lower learning rate."
                )
            values[name] = value.detach().clone()
        return values

    def _setup_members(self, init: torch.Tensor) -> None:
        if self._values is None:
            locs = init.expand(self.num_members, -1).clone()
        else:
            names = set(self.layout.names)
            for k, values in enumerate(self._values):
                extra = sorted(set(values) - names)
                if extra:
                    raise ValueError(
                        f"members[{k}] has sites {extra} that the model does not sample; the "
                        f"model's sites are {self.layout.names}. Pass members of this model."
                    )
            locs = torch.stack([self._pack(values) for values in self._values])
            locs = locs.to(dtype=init.dtype, device=init.device)
            self._values = None  # now in the buffer
        self.register_buffer("ensemble_locs", locs)

    def _pack(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One member's constrained site values, packed unconstrained."""
        unconstrained = {
            site.name: values[site.name]
            if site.transform is None
            else site.transform.inv(values[site.name])
            for site in self.layout
            if site.name in values
        }
        return self.layout.pack(unconstrained)  # names any missing site, checks every shape

    def _state_errors(self, state_dict: Mapping[str, Any], prefix: str) -> list[str]:
        # As the constructor refuses a member with NaN or inf, so does a load.
        locs = state_dict.get(prefix + "ensemble_locs")
        if isinstance(locs, torch.Tensor) and locs.dim() == 2 and locs.is_floating_point():
            bad = (~torch.isfinite(locs)).any(-1).nonzero().flatten().tolist()
            if bad:
                return [
                    f"{prefix + 'ensemble_locs'!r}: members {bad} contain NaN or inf (a member "
                    "must be finite, as the constructor requires)"
                ]
        return []

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        self._ensure_setup()
        locs = self._buffers["ensemble_locs"]
        assert locs is not None
        return [dist.Delta(loc, event_dim=1, validate_args=False) for loc in locs]


class AutoMultiSWAG(MemberGuide):
    r"""MultiSWAG: the uniform mixture of M :class:`~pyro_bdl.guides.AutoSWAG` Gaussians, each
    from its own SGD run of one lifted model.

    A draw picks a member uniformly and draws from its SWAG Gaussian; :meth:`member_outputs`
    takes ``num_samples`` draws from each member in turn. The members are submodules
    (``members.0`` …), so ``state_dict`` holds every member's SWAG statistics and
    ``load_state_dict`` checks them all before copying any.

    :param callable model: the Pyro model over the lifted network (any member's).
    :param members: the M trained :class:`~pyro_bdl.guides.AutoSWAG` guides (each with at
        least two collected snapshots and finite weights), or an int M for M fresh ones built with
        ``swag_options`` (to load a ``state_dict`` into).
    :param swag_options: keyword arguments of the fresh members' :class:`AutoSWAG` (``rank``,
        ``diag_only``, ``scale``, ...), only with an int ``members``.

    Trained members become this guide's submodules: their parameters leave Pyro's param store
    (every AutoSWAG's point estimate is named ``AutoSWAG.loc`` there, so the store can hold only
    one of them) and live in this guide's ``state_dict``, so a checkpoint
    (:func:`~pyro_bdl.checkpoint.save_checkpoint`) loads into a fresh ``AutoMultiSWAG(model, M,
    **same options)`` as the plain ``state_dict`` does. Members that share parameter tensors
    (guides trained one after the other in one param store, which trains the same tensors) are
    refused.

    References:

    [1] `Bayesian Deep Learning and a Probabilistic Perspective of Generalization`,
        Andrew Gordon Wilson, Pavel Izmailov (NeurIPS 2020)
    """

    def __init__(
        self,
        model: Callable,
        members,
        *,
        init_loc_fn: Callable = init_to_network,
        **swag_options: Any,
    ):
        count = _count(members)
        if count is not None:
            guides = [
                AutoSWAG(model, init_loc_fn=init_loc_fn, **swag_options) for _ in range(count)
            ]
        else:
            if swag_options:
                raise TypeError(
                    f"swag_options {sorted(swag_options)} only apply to fresh members (an int "
                    f"members); got {type(members).__name__} members, trained ones, which keep "
                    "their own options. Drop the options, or pass members=M for fresh ones."
                )
            guides = _as_list(members, "trained AutoSWAG guides")
            for k, guide in enumerate(guides):
                if not isinstance(guide, AutoSWAG):
                    raise TypeError(
                        f"members[{k}] must be an AutoSWAG guide; got {type(guide).__name__}. "
                        "Pass trained AutoSWAG guides, or members=M for fresh ones."
                    )
                guide.require_collected(f"join a MultiSWAG ensemble (members[{k}])")
                loc = guide._parameters["loc"]
                if loc is not None and not bool(torch.isfinite(loc).all()):
                    # collect() refuses such weights, so the run diverged after its last one.
                    raise ValueError(
                        f"members[{k}]'s weights (loc) contain NaN or inf: its training "
                        "diverged after its last collect(). Train that member again with a "
                        "lower learning rate."
                    )
            _check_same_layout([_signature(g.layout) for g in guides], "MultiSWAG member")
            _refuse_shared_parameters(guides)
            _refuse_identical([[g._parameters["loc"]] for g in guides])
            _release_from_param_store(guides)
        super().__init__(model, len(guides), init_loc_fn=init_loc_fn)
        self.members = nn.ModuleList(guides)

    def _setup_members(self, init: torch.Tensor) -> None:
        own = _signature(self.layout)
        for k, guide in enumerate(self.swag_members):
            if guide.prototype_trace is not None and _signature(guide.layout) != own:
                raise ValueError(
                    f"members[{k}] is a SWAG guide of another model (its sites differ from this "
                    "model's); pass AutoSWAG guides of the same lifted network."
                )
        for guide in self.swag_members:  # fresh members, set up on this model's arguments
            if guide.prototype_trace is None:
                guide._setup_prototype(*self._args_kwargs[0], **self._args_kwargs[1])

    @sets_up
    def _setup_prototype(self, *args, **kwargs):
        self._args_kwargs = (args, kwargs)  # fresh members set up on the same arguments
        try:
            super()._setup_prototype(*args, **kwargs)
        finally:
            del self._args_kwargs

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        """Each member's SWAG Gaussian, as its :attr:`~pyro_bdl.guides.AutoSWAG.mode` says: a
        member in mode ``"point"``, or in ``"auto"`` with fewer than two snapshots (a fresh
        guide before ``load_state_dict``), contributes its point estimate. A MultiSWAG guide has
        no training role, so ``"auto"`` members draw SWAG wherever the guide runs."""
        self._ensure_setup()
        out: list[dist.TorchDistribution] = []
        for guide in self.swag_members:
            if guide.mode == "swag" or (guide.mode == "auto" and guide.num_collected >= 2):
                out.append(guide.get_posterior())
            else:
                loc = guide._parameters["loc"]
                assert loc is not None
                out.append(dist.Delta(loc.detach(), event_dim=1, validate_args=False))
        return out

    @property
    def swag_members(self) -> list[AutoSWAG]:
        """The M member guides (``members`` typed)."""
        return [cast(AutoSWAG, guide) for guide in self.members]
