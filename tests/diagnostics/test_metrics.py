import math

import numpy as np
import pytest
import torch

from pyro_bdl.diagnostics import metrics
from tests.common import assert_close

# Four hand-made predictions (2 classes): confidences 0.95 (right), 0.75 (wrong), 0.65 (right),
# 0.55 (right); none lies on a bin edge for 1, 2, 5 or 15 bins.
PROBS = torch.tensor([[0.95, 0.05], [0.75, 0.25], [0.35, 0.65], [0.55, 0.45]], dtype=torch.float64)
Y = torch.tensor([0, 1, 1, 0])


def test_accuracy_and_nll_against_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 7, (50,), generator=g)
    probs = logits.softmax(-1)
    expected = torch.nn.functional.cross_entropy(logits, y)
    assert_close(metrics.nll(probs, y), expected, rtol=1e-12)
    assert metrics.accuracy(probs, y) == pytest.approx(
        float((logits.argmax(-1) == y).double().mean())
    )
    assert metrics.accuracy(PROBS, Y) == 0.75


def test_brier_by_hand():
    # Σ_c (p_c − 1[y=c])² per row: 2·0.05², 2·0.75², 2·0.35², 2·0.45²; mean of the four.
    expected = (0.005 + 1.125 + 0.245 + 0.405) / 4
    assert metrics.brier(PROBS, Y) == pytest.approx(expected, abs=1e-15)
    onehot = torch.eye(3, dtype=torch.float64)
    assert metrics.brier(onehot, torch.arange(3)) == 0.0


def test_ece_by_hand():
    # 5 bins of width 0.2: {0.95} acc 1 gap 0.05; {0.75, 0.65} acc 0.5 conf 0.7 gap 0.2;
    # {0.55} acc 1 gap 0.45. ECE = ¼·0.05 + ½·0.2 + ¼·0.45 = 0.225.
    assert metrics.ece(PROBS, Y, num_bins=5) == pytest.approx(0.225, abs=1e-15)
    # One bin: accuracy 0.75 against mean confidence 0.725, so ECE = 0.025.
    assert metrics.ece(PROBS, Y, num_bins=1) == pytest.approx(0.025, abs=1e-15)
    # 15 bins (the default) put every example in its own bin: mean of |acc − conf|.
    assert metrics.ece(PROBS, Y) == pytest.approx((0.05 + 0.75 + 0.35 + 0.45) / 4, abs=1e-15)


def test_nll_floors_probabilities_at_eps():
    # A confident mistake (p_y = 0) costs −log eps, and eps must lie in (0, 1): 0 would make
    # that cost infinite, 1 would floor every probability at 1.
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([1, 0])
    assert metrics.nll(probs, y, eps=1e-6) == pytest.approx(
        (-math.log(1e-6) + math.log(2)) / 2, rel=1e-14
    )
    for eps in (0, 0.0, 1.0, -1e-3, True):
        with pytest.raises(ValueError, match=r"eps must be a number in \(0, 1\)"):
            metrics.nll(probs, y, eps=eps)


def test_reliability_data():
    r = metrics.reliability(PROBS, Y, num_bins=5)
    np.testing.assert_allclose(r.edges, [0, 0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_array_equal(r.counts, [0, 0, 1, 2, 1])
    np.testing.assert_allclose(r.accuracy[2:], [1.0, 0.5, 1.0])
    np.testing.assert_allclose(r.confidence[2:], [0.55, 0.7, 0.95])
    assert np.isnan(r.accuracy[:2]).all() and np.isnan(r.confidence[:2]).all()
    assert r.mce == pytest.approx(0.45)
    d = r.to_dict()
    assert d["accuracy"][0] is None and d["counts"] == [0, 0, 1, 2, 1]
    # A confidence of exactly 1 goes to the top bin, not past it.
    top = metrics.reliability(torch.tensor([[1.0, 0.0]]), torch.tensor([0]), num_bins=4)
    np.testing.assert_array_equal(top.counts, [0, 0, 0, 1])
    assert top.ece == 0.0


def _reference_bin_counts(probs: torch.Tensor, num_bins: int) -> np.ndarray:
    """Guo et al.'s binning, in the dtype of ``probs``: bin b holds the confidences c with
    e_b < c <= e_{b+1} (bin 0 also 0), the edges b/B rounded to that dtype."""
    confidence = probs.max(-1).values
    edges = torch.tensor([b / num_bins for b in range(num_bins + 1)], dtype=torch.float64)
    edges = edges.to(probs.dtype)
    counts = []
    for b in range(num_bins):
        lower = confidence >= edges[b] if b == 0 else confidence > edges[b]
        counts.append(int((lower & (confidence <= edges[b + 1])).sum()))
    return np.array(counts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_bins", [5, 10, 15, 25])
def test_confidences_on_bin_edges_land_in_the_bin_below_in_every_dtype(dtype, num_bins):
    # Confidences k/B on every edge, written in the dtype the probabilities come in (0.6 is
    # 0.6000000238 in float32). Each equals its edge in that dtype, so it belongs to the bin
    # that ends there (with edges from np.linspace, 14/25 = 0.56 lay above its edge 0.5599…).
    top = torch.tensor([k / num_bins for k in range(1, num_bins + 1)], dtype=torch.float64)
    top = top[top >= 0.5]  # a top probability of two classes is at least 1/2
    probs = torch.stack([top, 1 - top], -1).to(dtype)
    y = torch.zeros(len(top), dtype=torch.long)
    counts = metrics.reliability(probs, y, num_bins=num_bins).counts
    np.testing.assert_array_equal(counts, _reference_bin_counts(probs, num_bins))
    first = num_bins - len(top)  # the bin that ends at the smallest confidence
    np.testing.assert_array_equal(counts[first:], np.ones(len(top), dtype=int))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_outputs_in_half_precision_are_probabilities(dtype):
    # Each entry rounds by at most half an ulp, so a row sums to 1 within about the dtype's
    # machine epsilon (float16: 9.8e-4, bfloat16: 7.8e-3), far beyond atol = 1e-4: most
    # batches of these were refused as "not a probability vector".
    g = torch.Generator().manual_seed(0)
    for num_classes in (3, 10, 100):
        logits = 3 * torch.randn(500, num_classes, generator=g)
        probs = logits.softmax(-1).to(dtype)
        y = torch.randint(0, num_classes, (500,), generator=g)
        # Rounding moves each log p by at most ~eps (bfloat16: 7.8e-3) against an NLL above 1.
        assert metrics.nll(probs, y) == pytest.approx(metrics.nll(logits.softmax(-1), y), rel=0.02)
    # A row that is off by more than the rounding is still refused.
    with pytest.raises(ValueError, match=r"row 0 sums to 0\.89"):
        metrics.check_probs(torch.tensor([[0.45, 0.45]], dtype=dtype))


def test_metrics_accept_numpy():
    assert metrics.brier(PROBS.numpy(), Y.numpy()) == pytest.approx(metrics.brier(PROBS, Y))


@pytest.mark.parametrize(
    "probs, y, match",
    [
        (torch.tensor([0.5, 0.5]), torch.tensor([0]), "shape \\(n, C\\)"),
        (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), "zero rows"),
        (torch.tensor([[0.5, 0.6]]), torch.tensor([0]), "sums to 1.1"),
        (torch.tensor([[2.0, -1.0]]), torch.tensor([0]), "probability vector"),
        (torch.tensor([[float("nan"), 1.0]]), torch.tensor([0]), "non-finite"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1]), "labels y must have shape \\(1,\\)"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([2]), "lie in \\[0, 2\\)"),
    ],
)
def test_bad_inputs_raise(probs, y, match):
    for fn in (metrics.accuracy, metrics.nll, metrics.brier, metrics.ece):
        with pytest.raises(ValueError, match=match):
            fn(probs, y)


def test_bad_types_raise():
    with pytest.raises(TypeError, match="integers"):
        metrics.nll(PROBS, Y.double())
    with pytest.raises(TypeError, match=r"torch\.Tensor or numpy"):
        metrics.nll("probs", Y)
    with pytest.raises(TypeError, match="floating point"):
        metrics.brier(torch.tensor([[1, 0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="num_bins"):
        metrics.ece(PROBS, Y, num_bins=0)


def test_rmse_and_gaussian_log_likelihood_by_hand():
    mean = torch.tensor([0.0, 1.0, -0.5], dtype=torch.float64)
    y = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    y_scale = 3.0
    assert metrics.rmse(mean, y, y_scale=y_scale) == pytest.approx(
        y_scale * math.sqrt((0.25 + 0.25 + 0.25) / 3), rel=1e-14
    )
    # One draw: log N(y; m, s) − log y_scale, averaged.
    s = 0.7
    hand = [
        -0.5 * math.log(2 * math.pi * s**2) - (yi - mi) ** 2 / (2 * s**2) - math.log(y_scale)
        for mi, yi in zip(mean.tolist(), y.tolist())
    ]
    assert metrics.gaussian_log_likelihood(mean, s, y, y_scale=y_scale) == pytest.approx(
        sum(hand) / 3, rel=1e-14
    )
    # Two draws: the predictive is the equal mixture of the two Gaussians.
    draws = torch.stack([mean, mean + 1.0])
    scales = torch.tensor([0.5, 2.0], dtype=torch.float64).unsqueeze(-1)

    def normal(x, m, sd):
        return math.exp(-((x - m) ** 2) / (2 * sd**2)) / math.sqrt(2 * math.pi * sd**2)

    mix = [
        math.log(0.5 * normal(yi, mi, 0.5) + 0.5 * normal(yi, mi + 1.0, 2.0)) - math.log(y_scale)
        for mi, yi in zip(mean.tolist(), y.tolist())
    ]
    got = metrics.gaussian_log_likelihood(draws, scales, y, y_scale=y_scale)
    assert got == pytest.approx(sum(mix) / 3, rel=1e-13)
    # RMSE of several draws uses their mean.
    assert metrics.rmse(draws, y) == pytest.approx(metrics.rmse(mean + 0.5, y), rel=1e-14)


def test_regression_bad_inputs():
    y = torch.zeros(3)
    with pytest.raises(ValueError, match="mean must have shape \\(3,\\)"):
        metrics.rmse(torch.zeros(4), y)
    with pytest.raises(ValueError, match="y must have shape \\(n,\\)"):
        metrics.rmse(torch.zeros(3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        metrics.gaussian_log_likelihood(torch.zeros(3), 0.0, y)
    with pytest.raises(ValueError, match="y_scale"):
        metrics.rmse(torch.zeros(3), y, y_scale=-1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        metrics.gaussian_log_likelihood(torch.zeros(3), torch.ones(2), y)
    with pytest.raises(TypeError, match="floating point"):
        metrics.rmse(torch.zeros(3), torch.zeros(3, dtype=torch.long))
