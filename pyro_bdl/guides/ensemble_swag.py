"""MultiSWAG (Wilson & Izmailov, NeurIPS 2020) as a Pyro guide: the equal-weight mixture of M
:class:`~pyro_bdl.guides.AutoSWAG` Gaussians, on the machinery of
:class:`~pyro_bdl.guides.ensemble.MemberGuide`. The method: docs/design/ensemble.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pyro.distributions as dist
import torch
from torch import nn

from pyro_bdl.guides.ensemble import MemberGuide, _as_list, _check_same_layout, _count, _signature
from pyro_bdl.guides.swag import AutoSWAG
from pyro_bdl.nn import init_to_network

__all__ = ["AutoMultiSWAG"]


class AutoMultiSWAG(MemberGuide):
    r"""MultiSWAG: the uniform mixture of M :class:`~pyro_bdl.guides.AutoSWAG` Gaussians, each
    from its own SGD run of one lifted model.

    A draw picks a member uniformly and draws from its SWAG Gaussian; :meth:`member_outputs`
    takes ``num_samples`` draws from each member in turn. The members are submodules
    (``members.0`` …), so ``state_dict`` holds every member's SWAG statistics and
    ``load_state_dict`` checks them all before copying any.

    :param callable model: the Pyro model over the lifted network (any member's).
    :param members: the M trained :class:`~pyro_bdl.guides.AutoSWAG` guides (each with at
        least two collected snapshots), or an int M for M fresh ones built with
        ``swag_options`` (to load a ``state_dict`` into).
    :param swag_options: keyword arguments of the fresh members' :class:`AutoSWAG` (``rank``,
        ``diag_only``, ``scale``, ...), only with an int ``members``.

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
                    "members); trained members keep their own options."
                )
            guides = _as_list(members, "trained AutoSWAG guides")
            for k, guide in enumerate(guides):
                if not isinstance(guide, AutoSWAG):
                    raise TypeError(
                        f"members[{k}] must be an AutoSWAG guide; got {type(guide).__name__}."
                    )
                guide._require_collected(f"join a MultiSWAG ensemble (members[{k}])")
            _check_same_layout([_signature(g.layout) for g in guides], "MultiSWAG member")
        super().__init__(model, len(guides), init_loc_fn=init_loc_fn)
        self.members = nn.ModuleList(guides)

    def _setup_members(self, init: torch.Tensor) -> None:
        own = _signature(self.layout)
        for k, guide in enumerate(self.swag_members):
            if guide.prototype_trace is None:
                guide._setup_prototype(*self._args_kwargs[0], **self._args_kwargs[1])
            if _signature(guide.layout) != own:
                raise ValueError(
                    f"members[{k}] is a SWAG guide of another model (its sites differ from this "
                    "model's); pass AutoSWAG guides of the same lifted network."
                )

    def _setup_prototype(self, *args, **kwargs):
        self._args_kwargs = (args, kwargs)  # fresh members set up on the same arguments
        try:
            super()._setup_prototype(*args, **kwargs)
        finally:
            del self._args_kwargs

    def member_posteriors(self) -> list[dist.TorchDistribution]:
        """Each member's SWAG Gaussian; a member with fewer than two snapshots (a fresh guide
        before ``load_state_dict``) contributes its point estimate, as AutoSWAG itself does."""
        self._ensure_setup()
        out: list[dist.TorchDistribution] = []
        for guide in self.swag_members:
            if guide.num_collected >= 2:
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
