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
        self._product = torch.empty_like(loc)

    def split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ĝs of the mean and each hidden parameter, [ĥ of the mean])."""
        return [self.estimates[0], *self.estimates[2:]], [self.estimates[1]]

    def _track(self) -> torch.Tensor:
        """The current sample as a leaf that records gradients, its views on the layers."""
        w = self._w.detach().requires_grad_()
        views = self.layout.split(w)
        values = [(module, name, v) for (module, name, _), v in zip(self._sites, views)]
        self._values = values + self._values[len(values) :]
        return w

    def estimate(self, args, kwargs, *, num_particles: int, step: int) -> tuple[list[float], int]:
        """ĝ and ĥ averaged over ``num_particles`` draws and the B examples, into
        :attr:`estimates`; returns Σᵢ ℓᵢ of each draw, and B."""
        g, h, *g_hidden = self.estimates
        nlls, batch = [], 0
        for k in range(num_particles):
            with torch.no_grad():
                self.sample()
            w = self._track()
            losses, batch, nll = self.run(args, kwargs, step)
            wrt = [w, *self._hidden_params]
            grads: Sequence[torch.Tensor | None] = (None,) * len(wrt)
            if losses.requires_grad:  # else the likelihood depends on no weight
                grads = torch.autograd.grad(losses.sum(), wrt, allow_unused=True)
            with torch.no_grad():
                for out, grad in zip([g, *g_hidden], grads):
                    if grad is None:
                        grad = torch.zeros_like(out)
                    if k == 0:
                        out.copy_(grad)
                    else:
                        out.add_(grad)
                gw = grads[0] if grads[0] is not None else torch.zeros_like(g)
                # ĥ of this draw summed over the batch: (Σᵢ gᵢ) ε/σ.
                product = torch.mul(gw, self.noise, out=self._product)
                if k == 0:
                    torch.div(product, self.scale, out=h)
                else:
                    h.addcdiv_(product, self.scale)
            nlls.append(nll)
        torch._foreach_div_(self.estimates, float(num_particles * batch))
        return nlls, batch
