import math

import pytest
import torch

from pyro_bdl.diagnostics.metrics_binary import binary_brier, binary_ece, binary_nll

P = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
Y = torch.tensor([0, 0, 1])


@pytest.mark.parametrize("eps", [0, 0.0, -1e-3, 0.5, 2.0, math.nan, True])
def test_binary_nll_refuses_an_eps_outside_0_to_half(eps):
    # eps = 0 left the confident, correct p = 1 at 0·log(0) = NaN; eps ≥ 1/2 clips every p to
    # one value (the clip interval [eps, 1 − eps] is empty).
    with pytest.raises(ValueError, match=r"eps must be a number in \(0, 0.5\)"):
        binary_nll(P, Y, eps=eps)


def test_binary_nll_with_a_tiny_eps_is_finite():
    # Only the middle row costs anything: -log(0.7).
    assert binary_nll(P, Y, eps=1e-300) == pytest.approx(-math.log(0.7) / 3, rel=1e-12)


@pytest.mark.parametrize("metric", [binary_nll, binary_brier, binary_ece])
@pytest.mark.parametrize(
    "p, fix",
    [(torch.stack([1 - P, P], -1), "p[:, 1]"), (P.unsqueeze(-1), "p.squeeze(-1)")],
)
def test_two_column_or_column_probabilities_name_the_fix(metric, p, fix):
    with pytest.raises(ValueError) as info:
        metric(p, Y)
    assert fix in str(info.value), str(info.value)
