import itertools
import math

import numpy as np
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


def test_binary_metrics_by_hand():
    # P = (0, 0.3, 1) against Y = (0, 0, 1): only the middle row errs, by 0.3.
    assert binary_brier(P, Y) == pytest.approx(0.3**2 / 3, rel=1e-14)
    # Confident mistakes cost −log eps each, not infinity: the clip to [eps, 1 − eps].
    wrong = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert binary_nll(wrong, torch.tensor([1, 0]), eps=1e-3) == pytest.approx(
        -math.log(1e-3), rel=1e-12
    )


def test_binary_ece_by_hand_with_a_probability_on_a_bin_edge():
    # Two bins: p = 0.5 lies on the inner edge and belongs to the lower bin (calibration_curve's
    # left search); the bins' gaps have opposite signs, ȳ − p̄ = −0.5 and +0.1, and are weighted
    # by their counts: (|−0.5| + |0.1|) / 2. (In the upper bin both rows would give 0.2.)
    p = torch.tensor([0.5, 0.9], dtype=torch.float64)
    y = torch.tensor([0, 1])
    assert binary_ece(p, y, num_bins=2) == pytest.approx(0.3, rel=1e-14)


@pytest.mark.parametrize("num_bins", [1, 5, 10])
def test_binary_metrics_equal_scikit_learn(num_bins):
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import brier_score_loss, log_loss

    g = torch.Generator().manual_seed(4)
    # Probabilities on the edges k/20 too (every bin edge of 1, 5 and 10 bins), and 0 and 1.
    p = torch.cat(
        [
            torch.rand(300, generator=g, dtype=torch.float64),
            torch.arange(21, dtype=torch.float64) / 20,
        ]
    )
    y = (torch.rand(len(p), generator=g, dtype=torch.float64) < p).long()
    assert binary_nll(p, y) == pytest.approx(log_loss(y.numpy(), p.numpy()), rel=1e-12)
    assert binary_brier(p, y) == pytest.approx(brier_score_loss(y.numpy(), p.numpy()), rel=1e-12)
    prob_true, prob_pred = calibration_curve(y.numpy(), p.numpy(), n_bins=num_bins)
    # calibration_curve drops empty bins and gives no counts: count each bin by its edges,
    # right-closed (e_b, e_{b+1}] with 0 in the first, as its left search over the inner edges.
    edges = np.linspace(0, 1, num_bins + 1)
    pn = p.numpy()
    counts = [
        ((pn > lo) | (b == 0)) & (pn <= hi) for b, (lo, hi) in enumerate(itertools.pairwise(edges))
    ]
    counts = np.array([c.sum() for c in counts])
    counts = counts[counts > 0]
    expected = float((counts / len(pn) * np.abs(prob_true - prob_pred)).sum())
    assert binary_ece(p, y, num_bins=num_bins) == pytest.approx(expected, rel=1e-12)
