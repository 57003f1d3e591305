r"""VOGN's Monte Carlo estimates: weight samples w = μ + σ ⊙ ε, the conditioned passes, and ĝ, ĥ
(the per-example gradients of the negative log-likelihood and their squares, averaged), written
into buffers allocated once (docs/design/vogn.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyro_bdl.curvature.per_example import PerExampleGradients
from pyro_bdl.infer.rollback import Rollback
from pyro_bdl.infer.vogn_model import Hidden, per_example_nll, run_substituted
from pyro_bdl.layout import SiteLayout

__all__ = ["Passes"]


class Passes:
    """The buffers and passes of VOGN's steps over one model.

    :param model: the Pyro model.
    :param layout: its weight sites.
    :param hidden: its hidden parameters.
    :param loc: μ and ``scale`` σ, read (not copied) at every draw.
    :param layers: the layers to hook (those the first pass called).
    :param int chunk_size: examples per chunk of the per-example gradients.
    """

    def __init__(
        self,
        model: Callable,
        layout: SiteLayout,
        hidden: list[Hidden],
        loc: torch.Tensor,
        scale: torch.Tensor,
        layers: list,
        chunk_size: int | None,
    ):
        self.model, self.loc, self.scale = model, loc, scale
        self.num_hidden = len(hidden)
        #: What :meth:`check_finite` calls μ's estimates, then each hidden parameter's.
        self.names = ["weights", *(f"{h.name} (hidden)" for h in hidden)]
        #: ε of the last draw; free once w is drawn (VOGN computes log σ into it).
        self.noise = torch.empty_like(loc)
        self._w = torch.empty_like(loc)
        g, h = torch.empty_like(loc), torch.empty_like(loc)
        g_hidden = [torch.empty_like(hp.param) for hp in hidden]
        h_hidden = [torch.empty_like(hp.param) for hp in hidden]
        #: [ĝ, ĥ, ĝ of each hidden parameter..., ĥ of each...], the list ``reduce_fn`` receives.
        self.estimates = [g, h, *g_hidden, *h_hidden]
        specs = [site.spec for site in layout if site.spec is not None]
        self._out = {
            (spec.module, spec.param_name): (gs, hs)
            for spec, gs, hs in zip(specs, layout.split(g), layout.split(h))
        }
        for hp, gp, hh in zip(hidden, g_hidden, h_hidden):
            self._out[(hp.module, hp.param_name)] = (gp, hh)
        # What each pass writes onto the layers: the weight sample's views, and the hidden
        # parameters themselves (what PyroModule's pyro.param statement would return).
        self._values = [
            (spec.module, spec.param_name, w) for spec, w in zip(specs, layout.split(self._w))
        ]
        self._values += [(hp.module, hp.param_name, hp.param) for hp in hidden]
        self._tape = PerExampleGradients(layers=layers, chunk_size=chunk_size)
        #: Saves and restores what a pass changes outside VOGN's state (set by VOGN).
        self.rollback = Rollback([])
        #: The method named in the refusals (IVON reuses these passes).
        self.method = "VOGN"

    def split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ĝs, ĥs) of μ first, then of each hidden parameter (views of :attr:`estimates`)."""
        k, e = self.num_hidden, self.estimates
        return [e[0], *e[2 : 2 + k]], [e[1], *e[2 + k :]]

    def sample(self) -> torch.Tensor:
        """w = μ + σ ⊙ ε into the flat sample buffer (whose views the layers read)."""
        torch.randn(self.noise.shape, out=self.noise)
        return torch.addcmul(self.loc, self.scale, self.noise, out=self._w)

    def run(self, args, kwargs, step: int) -> tuple[torch.Tensor, int, float]:
        """One conditioned pass at the current sample: the per-example NLL, B and its sum."""
        sites = run_substituted(self.model, self._values, args, kwargs, step)
        return per_example_nll(sites, step)

    def gradients(self, tape: PerExampleGradients, losses: torch.Tensor, add: bool) -> None:
        """Σg and Σg² into :attr:`estimates` (added to them if ``add``)."""
        raw = tape.compute(losses, out=self._out, add=add)
        tape.clear()  # free the recorded activations now, not at the next step
        if not add and len(raw) < len(self._out):
            for key, (g, h) in self._out.items():
                if key not in raw:  # a layer the model did not call this time: no gradient
                    g.zero_()
                    h.zero_()

    def estimate(self, args, kwargs, *, num_particles: int, step: int) -> tuple[list[float], int]:
        """ĝ and ĥ averaged over ``num_particles`` draws and the B examples, into
        :attr:`estimates`; returns Σᵢ ℓᵢ of each draw, and B."""
        nlls, batch = [], 0
        for k in range(num_particles):
            self.sample()
            with self._tape:
                losses, batch, nll = self.run(args, kwargs, step)
            self.gradients(self._tape, losses, add=k > 0)
            nlls.append(nll)
        torch._foreach_div_(self.estimates, float(num_particles * batch))
        return nlls, batch

    @torch.no_grad()
    def mean_nll(self, args, kwargs, *, num_particles: int, step: int) -> float:
        """(1/B) Σᵢ ℓᵢ averaged over ``num_particles`` draws, with nothing recorded for gradients;
        if a pass raises, the layers' buffers and the random state are put back."""
        self.rollback.save()
        try:
            nll = 0.0
            for _ in range(num_particles):
                self.sample()
                _, batch, total = self.run(args, kwargs, step)
                nll += total / batch
        except BaseException:
            self.rollback.restore()
            raise
        return nll / num_particles

    def check_finite(self, step: int) -> None:
        """Refuse non-finite estimates, naming the first tensor."""
        # One reduction per tensor: a sum is finite only if every element is.
        if bool(torch.isfinite(torch.stack([t.sum() for t in self.estimates])).all()):
            return
        g_hats, h_hats = self.split()
        labelled = [(f"{n} (ĝ)", t) for n, t in zip(self.names, g_hats)]
        labelled += [(f"{n} (ĥ)", t) for n, t in zip(self.names, h_hats)]
        name = next(n for n, t in labelled if not bool(torch.isfinite(t).all()))
        raise ValueError(
            f"{self.method} step {step}: the gradient of the likelihood for {name} is not finite "
            "(NaN or inf); nothing was updated. Lower the learning rate."
        )
