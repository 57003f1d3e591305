r"""IVON's Monte Carlo estimates: one ordinary backward pass per weight sample, no per-example
gradients (docs/design/ivon.md).

For a draw :math:`\theta = m + \sigma\varepsilon` the minibatch-mean gradient :math:`\hat g` of
the per-example negative log-likelihood gives, by Price's (Bonnet's) theorem, the diagonal Hessian
estimate :math:`\hat h = \hat g \cdot (\theta - m)/\sigma^2 = \hat g\,\varepsilon/\sigma`, whose
expectation under q is :math:`\mathbb E_q[\operatorname{diag} \nabla^2 \ell]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pyro_bdl.infer.vogn_model import Hidden
from pyro_bdl.infer.vogn_passes import Passes
from pyro_bdl.layout import SiteLayout

__all__ = ["IVONPasses"]


class IVONPasses(Passes):
    """VOGN's passes (sampling, the conditioned run, the finiteness check, the evaluation loss)
    with IVON's estimates: ĝ by autograd at the sample, and ĥ = ĝ ε/σ.

    :attr:`estimates` is ``[ĝ, ĥ, ĝ of each hidden parameter...]``, the list ``reduce_fn``
    receives.
    """

    def __init__(
        self,
        model: Callable,
        layout: SiteLayout,
        hidden: list[Hidden],
        loc: torch.Tensor,
        scale: torch.Tensor,
    ):
        super().__init__(model, layout, hidden, loc, scale, layers=[], chunk_size=None)
        self.method = "IVON"
        self.layout = layout
        self._hidden_params = [hp.param for hp in hidden]
        e, k = self.estimates, len(hidden)
        self.estimates = [e[0], e[1], *e[2 : 2 + k]]  # no ĥ for the noiseless hidden parameters
        self._sites = self._values[: len(self._values) - k]
        self._product = torch.empty_like(loc)  # a later draw's ĝ
        self._g_views = layout.split(self.estimates[0])
        self._spare_views = layout.split(self._product)

    def split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ĝs of the mean and each hidden parameter, [ĥ of the mean])."""
        return [self.estimates[0], *self.estimates[2:]], [self.estimates[1]]

    def _track(self) -> list[torch.Tensor]:
        """The current sample's site views as leaves that record gradients, put on the layers.

        Leaves per site (sharing the sample's storage) rather than one flat leaf: autograd then
        returns one gradient per site, as ``loss.backward()`` would for the plain network, not
        those and their concatenation as well."""
        leaves = [v.detach().requires_grad_() for v in self.layout.split(self._w)]
        values = [(module, name, v) for (module, name, _), v in zip(self._sites, leaves)]
        self._values = values + self._values[len(values) :]
        return leaves

    def estimate(self, args, kwargs, *, num_particles: int, step: int) -> tuple[list[float], int]:
        """ĝ and ĥ averaged over ``num_particles`` draws and the B examples, into
        :attr:`estimates`; returns Σᵢ ℓᵢ of each draw, and B."""
        g, h, *g_hidden = self.estimates
        nlls, batch = [], 0
        for k in range(num_particles):
            with torch.no_grad():
                self.sample()
            leaves = self._track()
            losses, batch, nll = self.run(args, kwargs, step)
            wrt = [*leaves, *self._hidden_params]
            grads: Sequence[torch.Tensor | None] = (None,) * len(wrt)
            if losses.requires_grad:  # else the likelihood depends on no weight
                grads = torch.autograd.grad(losses.sum() / batch, wrt, allow_unused=True)
            with torch.no_grad():
                # This draw's ĝ into g (the first draw) or the spare buffer (later draws).
                draw = g if k == 0 else self._product
                views = self._g_views if k == 0 else self._spare_views
                for out, grad in zip(views, grads):
                    out.zero_() if grad is None else out.copy_(grad)
                for out, grad in zip(g_hidden, grads[len(views) :]):
                    if grad is None:
                        if k == 0:
                            out.zero_()
                    elif k == 0:
                        out.copy_(grad)
                    else:
                        out.add_(grad)
                if k > 0:
                    g.add_(draw)
                # ĥ of this draw: ĝ ε/σ.
                if k == 0:
                    torch.mul(draw, self.noise, out=h).div_(self.scale)
                else:
                    h.addcdiv_(draw.mul_(self.noise), self.scale)
            nlls.append(nll)
        if num_particles > 1:
            torch._foreach_div_(self.estimates, float(num_particles))
        return nlls, batch
