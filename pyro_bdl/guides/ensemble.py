r"""Deep ensembles and MultiSWAG as ordinary Pyro guides over a lifted network.

A deep ensemble (Lakshminarayanan et al., NeurIPS 2017) is M networks trained from independent
initialisations; MultiSWAG (Wilson & Izmailov, NeurIPS 2020) fits a SWAG Gaussian around each.
Both are read here as one posterior over the packed weight vector, the equal-weight mixture

.. math::

    q(\theta) = \frac{1}{M}\sum_{m=1}^{M} q_m(\theta), \qquad
    q_m = \delta_{\theta_m} \text{ (ensemble)} \text{ or } \mathcal N(\bar\theta_m, \Sigma_m)
    \text{ (MultiSWAG)},

so a draw picks a member uniformly and draws from it (:class:`AutoEnsemble` here,
:class:`~pyro_bdl.guides.ensemble_swag.AutoMultiSWAG` in :mod:`~pyro_bdl.guides.ensemble_swag`):
``Predictive``,
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

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoContinuous

from pyro_bdl._validation import check_positive_int
from pyro_bdl.guides.access import SiteAccess
from pyro_bdl.guides.ensemble_mixture import MemberMixture
from pyro_bdl.guides.state_checks import CheckedLoad
from pyro_bdl.layout import SiteLayout
from pyro_bdl.nn import init_to_network
from pyro_bdl.predictive import sample_outputs

__all__ = ["AutoEnsemble", "MemberGuide", "MemberMixture"]


def _count(members: object) -> int | None:
    """M when ``members`` is a count (a guide to be filled by ``load_state_dict``), else None."""
    if isinstance(members, bool):
        raise TypeError("members must be a sequence of trained members or an int M >= 1; got bool.")
    return check_positive_int("members", members) if isinstance(members, int) else None


def _as_list(members: object, what: str) -> list:
    if isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Sequence):
        raise TypeError(
            f"members must be a list of {what} (or an int M >= 1 for an empty guide to load a "
            f"state into); got {type(members).__name__}."
        )
    if not members:
        raise ValueError(f"members must hold at least one of {what}; got an empty list (M = 0).")
    return list(members)


def _signature(layout_or_values) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(layout_or_values, SiteLayout):
        return [(s.name, tuple(s.shape)) for s in layout_or_values]
    return [(name, tuple(v.shape)) for name, v in layout_or_values.items()]


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


class MemberGuide(CheckedLoad, SiteAccess, AutoContinuous):
    """Base of :class:`AutoEnsemble` and :class:`AutoMultiSWAG`: the guide of the mixture
    :class:`~pyro_bdl.guides.ensemble_mixture.MemberMixture` over the packed vector. A subclass
    provides :meth:`member_posteriors` and sets up its members in :meth:`_setup_members`."""

    layout: SiteLayout

    def __init__(self, model: Callable, num_members: int, *, init_loc_fn=init_to_network):
        self.num_members = num_members
        self._member: int | None = None
        super().__init__(model, init_loc_fn=init_loc_fn)

    def _setup_prototype(self, *args, **kwargs):
        super()._setup_prototype(*args, **kwargs)
        self.layout, init = SiteLayout.from_trace(self.prototype_trace, full_plates=False)
        self._setup_members(init)

    def _setup_members(self, init: torch.Tensor) -> None:
        raise NotImplementedError

    def _ensure_setup(self) -> None:
        if self.prototype_trace is None:
            raise RuntimeError(
                f"{type(self).__name__} has not seen the model yet; call the guide once with the "
                "model's training arguments (for example guide(x, y)) first."
            )

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        """The M members' distributions over the packed unconstrained vector, each ``(D,)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ choosing members

    @property
    def member(self) -> int | None:
        """``None`` (each draw picks a member uniformly) or the one member every draw uses."""
        return self._member

    @member.setter
    def member(self, value: int | None) -> None:
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value < self.num_members
        ):
            raise ValueError(
                f"member must be None or an int in [0, {self.num_members}) (this guide has "
                f"{self.num_members} members); got {value!r}."
            )
        self._member = value

    @contextmanager
    def use_member(self, k: int) -> Iterator[None]:
        """Draw from member ``k`` only inside the block."""
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
    def member_outputs(self, model, *args: Any, num_samples: int = 1, **kwargs: Any):
        """The network outputs of every member: shape ``(M, num_samples, *output_shape)``.

        Member m's ``num_samples`` draws come from member m alone, in the order m = 0 … M − 1,
        so averaging a predictive over dims 0 and 1 weights each member's predictive exactly
        1/M (no draw of the member index)::

            probs = guide.member_outputs(model, x_test).softmax(-1).mean((0, 1))

        :param model: the model the guide belongs to (as for
            :func:`~pyro_bdl.predictive.sample_outputs`).
        :param int num_samples: draws per member (1 is exact for an ensemble of point masses).
        """
        check_positive_int("num_samples", num_samples)
        outputs = []
        for k in range(self.num_members):
            with self.use_member(k):
                outputs.append(
                    sample_outputs(model, self, *args, num_samples=num_samples, **kwargs)
                )
        return torch.stack(outputs)

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
        ``state_dict`` into.
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
            self._values = [self._member_values(k, m) for k, m in enumerate(listed)]
            _check_same_layout([_signature(v) for v in self._values], "ensemble member")
            count = len(self._values)
        super().__init__(model, count, init_loc_fn=init_loc_fn)

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
            member = median()
        values = {}
        for name, value in member.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"members[{k}][{name!r}] must be a tensor; got {type(value).__name__}."
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

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        self._ensure_setup()
        locs = self._buffers["ensemble_locs"]
        assert locs is not None
        return [dist.Delta(loc, event_dim=1, validate_args=False) for loc in locs]
