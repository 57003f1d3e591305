import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score, roc_curve

from pyro_bdl.diagnostics import ood


def _labels(n_in, n_out):
    return np.r_[np.zeros(n_in), np.ones(n_out)]


@pytest.mark.parametrize("discrete", [False, True])
def test_auroc_equals_sklearn(discrete):
    g = torch.Generator().manual_seed(1)
    s_in = torch.randn(200, generator=g, dtype=torch.float64)
    s_out = torch.randn(150, generator=g, dtype=torch.float64) + 0.7
    if discrete:  # many ties: both must count a tie as one half
        s_in, s_out = s_in.round(), s_out.round()
    expected = roc_auc_score(_labels(200, 150), torch.cat([s_in, s_out]).numpy())
    assert ood.auroc(s_in, s_out) == pytest.approx(expected, abs=1e-12)


def test_ood_auroc_on_probabilities_equals_sklearn():
    g = torch.Generator().manual_seed(2)
    probs_in = (3 * torch.randn(100, 5, generator=g, dtype=torch.float64)).softmax(-1)
    probs_out = (0.5 * torch.randn(80, 5, generator=g, dtype=torch.float64)).softmax(-1)
    for score in ood.SCORES:
        scores = torch.cat(
            [ood.ood_scores(probs_in, score=score), ood.ood_scores(probs_out, score=score)]
        )
        expected = roc_auc_score(_labels(100, 80), scores.numpy())
        assert ood.ood_auroc(probs_in, probs_out, score=score) == pytest.approx(expected, abs=1e-12)
    # Flatter predictions out of distribution (logits of sd 0.5 against 3): the default score
    # separates them almost perfectly, AUROC 0.9998 here and ≥ 0.99 for generator seeds 0–5;
    # swapping the classes (a sign slip in the score) gives ≤ 0.01.
    assert ood.ood_auroc(probs_in, probs_out) > 0.9


@pytest.mark.parametrize("discrete", [False, True])
def test_fpr_at_95_tpr_equals_sklearn_roc_curve(discrete):
    g = torch.Generator().manual_seed(3)
    s_in = torch.randn(300, generator=g, dtype=torch.float64)
    s_out = torch.randn(200, generator=g, dtype=torch.float64) + 1.5
    if discrete:
        s_in, s_out = (4 * s_in).round(), (4 * s_out).round()
    # In-distribution is the positive class; a low score means "in distribution".
    fpr, tpr, _ = roc_curve(
        np.r_[np.ones(300), np.zeros(200)],
        -torch.cat([s_in, s_out]).numpy(),
        drop_intermediate=False,
    )
    expected = fpr[np.argmax(tpr >= 0.95)]
    assert ood.fpr_at_tpr(s_in, s_out, tpr=0.95) == pytest.approx(expected, abs=1e-15)


def test_fpr_by_hand():
    s_in = torch.arange(20.0)  # 95% of 20 is 19 examples: threshold 18
    s_out = torch.tensor([17.5, 18.0, 18.5, 30.0])
    assert ood.fpr_at_tpr(s_in, s_out) == 0.5
    probs = torch.eye(3, dtype=torch.float64)
    flat = torch.full((2, 3), 1 / 3, dtype=torch.float64)
    assert ood.fpr_at_95_tpr(probs, flat) == 0.0
    assert ood.ood_auroc(probs, flat) == 1.0


def test_predictive_entropy():
    probs = torch.tensor(
        [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]], dtype=torch.float64
    )
    expected = torch.tensor([0.0, math.log(3), math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(ood.predictive_entropy(probs), expected, rtol=1e-14, atol=1e-15)


def test_bad_inputs_raise():
    probs = torch.eye(3)
    with pytest.raises(ValueError, match="same number of classes"):
        ood.ood_auroc(probs, torch.eye(2))
    with pytest.raises(ValueError, match="unknown score"):
        ood.ood_auroc(probs, probs, score="margin")
    with pytest.raises(ValueError, match="scores_out must have shape \\(n,\\) with n ≥ 1"):
        ood.auroc(torch.ones(3), torch.ones(0))
    with pytest.raises(ValueError, match="scores_in must have shape"):
        ood.fpr_at_tpr(torch.ones(3, 1), torch.ones(3))
    with pytest.raises(ValueError, match="non-finite"):
        ood.auroc(torch.tensor([0.0, float("nan")]), torch.ones(3))
    with pytest.raises(ValueError, match="tpr must lie"):
        ood.fpr_at_tpr(torch.ones(3), torch.ones(3), tpr=1.5)
    with pytest.raises(ValueError, match="sums to"):
        ood.predictive_entropy(torch.tensor([[0.2, 0.2]]))


def test_max_prob_score_is_one_minus_the_top_probability():
    probs = torch.tensor([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    expected = torch.tensor([0.3, 2 / 3], dtype=torch.float64)
    torch.testing.assert_close(ood.ood_scores(probs, score="max_prob"), expected)
    # Confident in distribution, flat out of it: a score higher out of distribution separates
    # the sets perfectly (AUROC 1) and accepts no OOD input at 95% TPR.
    confident, flat = torch.eye(3, dtype=torch.float64), torch.full((2, 3), 1 / 3).double()
    assert ood.ood_auroc(confident, flat, score="max_prob") == 1.0
    assert ood.fpr_at_95_tpr(confident, flat, score="max_prob") == 0.0


@pytest.mark.parametrize(
    "tpr, n, k",
    [
        (0.95, 10, 10),  # 9.5 examples: round up to k = 10, the smallest count reaching 95%
        (0.55, 100, 55),  # 0.55·100 is 55.00000000000001 in float64, yet exactly 55 examples
        (0.07, 100, 7),  # 7.000000000000001 likewise
    ],
)
def test_fpr_threshold_is_the_kth_smallest_in_score_with_k_the_ceiling_of_tpr_n(tpr, n, k):
    s_in = torch.arange(float(n))  # the k-th smallest is k − 1
    # One OOD score at the k-th smallest (accepted) and one just above it (refused).
    s_out = torch.tensor([k - 1.0, k - 0.5])
    assert ood.fpr_at_tpr(s_in, s_out, tpr=tpr) == 0.5
