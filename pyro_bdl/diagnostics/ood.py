r"""Predictive entropy and out-of-distribution detection figures.

A good Bayesian predictive is uncertain away from the training data: its entropy (or
1 − max p) on out-of-distribution (OOD) inputs should be higher than on in-distribution ones.
:func:`ood_auroc` and :func:`fpr_at_95_tpr` measure how well that score separates the two sets;
:func:`auroc` and :func:`fpr_at_tpr` are the plain cores on scores.

Usage::

    auc = ood_auroc(predict(x_test), predict(x_ood))            # 0.5 = chance, 1 = perfect
    fpr = fpr_at_95_tpr(predict(x_test), predict(x_ood))        # lower is better

References:
    Hendrycks & Gimpel, "A Baseline for Detecting Misclassified and Out-of-Distribution
    Examples in Neural Networks", ICLR 2017.
    Liang, Li & Srikant, "Enhancing the Reliability of Out-of-distribution Image Detection in
    Neural Networks" (ODIN), ICLR 2018 — the FPR at 95% TPR convention.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pyro_bdl._validation import check_choice
from pyro_bdl.diagnostics.metrics import as_tensor, check_finite_values, check_probs

__all__ = [
    "SCORES",
    "auroc",
    "fpr_at_95_tpr",
    "fpr_at_tpr",
    "ood_auroc",
    "ood_scores",
    "predictive_entropy",
]

#: The OOD scores :func:`ood_scores` knows; higher means "more likely out of distribution".
SCORES = ("entropy", "max_prob")


def predictive_entropy(probs) -> torch.Tensor:
    r"""Entropy :math:`-\sum_c p_c \log p_c` (nats, with 0 log 0 = 0) of each row of ``probs``,
    shape (n,)."""
    check_probs(probs)
    p = as_tensor("probs", probs).double()
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)


def ood_scores(probs, *, score: str = "entropy") -> torch.Tensor:
    """The OOD score of each row of ``probs``: ``"entropy"`` (predictive entropy) or
    ``"max_prob"`` (1 − max p)."""
    check_choice("score", score, SCORES)
    if score == "entropy":
        return predictive_entropy(probs)
    check_probs(probs)
    return 1.0 - as_tensor("probs", probs).double().max(-1).values


def _scores(name: str, value) -> np.ndarray:
    t = as_tensor(name, value)
    if t.dim() != 1 or t.shape[0] == 0:
        raise ValueError(
            f"{name} must have shape (n,) with n ≥ 1; got {tuple(t.shape)}. Pass one score per "
            "example (t.reshape(-1) for a trailing dim of 1)."
        )
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be real numbers; got dtype {t.dtype}. Use {name}.float().")
    check_finite_values(
        name,
        t.double(),
        "Compute the scores from finite predictions (e.g. ood_scores of probabilities).",
    )
    return t.detach().double().cpu().numpy()


def auroc(scores_in, scores_out) -> float:
    r"""Area under the ROC curve for telling OOD (positive) from in-distribution examples by a
    score that is higher out of distribution: :math:`P(s_{out} > s_{in}) + \tfrac12 P(s_{out} =
    s_{in})`, computed exactly from mid-ranks (the Mann–Whitney U statistic)."""
    s_in, s_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    from scipy.stats import rankdata  # local: scipy loads only for the AUROC

    ranks = rankdata(np.concatenate([s_in, s_out]))  # ties share their mean rank
    n_in, n_out = len(s_in), len(s_out)
    u = ranks[n_in:].sum() - n_out * (n_out + 1) / 2.0
    return float(u / (n_in * n_out))


def fpr_at_tpr(scores_in, scores_out, *, tpr: float = 0.95) -> float:
    """False-positive rate at a given true-positive rate, with in-distribution as the positive
    class (the ODIN convention): accept an input as in-distribution when its score is at most a
    threshold chosen as the smallest one that accepts a fraction ``tpr`` of the in-distribution
    examples; return the fraction of OOD examples that are accepted too. Lower is better."""
    if isinstance(tpr, bool) or not isinstance(tpr, (int, float)) or not 0 < tpr <= 1:
        raise ValueError(f"tpr must lie in (0, 1]; got {tpr!r}. Use 0.95 for the usual figure.")
    s_in, s_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    # The k-th smallest in-distribution score, k = ⌈tpr·n⌉ (rounded first so 0.95·20 is 19).
    k = max(1, math.ceil(round(tpr * len(s_in), 9)))
    threshold = np.sort(s_in)[k - 1]
    return float((s_out <= threshold).mean())


def _two_sets(probs_in, probs_out, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_probs(probs_in, name="probs_in")
    check_probs(probs_out, name="probs_out")
    s_in, s_out = ood_scores(probs_in, score=score), ood_scores(probs_out, score=score)
    c_in, c_out = (
        as_tensor("probs_in", probs_in).shape[1],
        as_tensor("probs_out", probs_out).shape[1],
    )
    if c_in != c_out:
        raise ValueError(
            f"probs_in and probs_out must have the same number of classes; got {c_in} and "
            f"{c_out}. Predict both sets with the same network."
        )
    return s_in, s_out


def ood_auroc(probs_in, probs_out, *, score: str = "entropy") -> float:
    """AUROC of separating OOD inputs (``probs_out``, shape (m, C)) from in-distribution ones
    (``probs_in``, shape (n, C)) by :func:`ood_scores`; 0.5 is chance, 1 is perfect."""
    return auroc(*_two_sets(probs_in, probs_out, score))


def fpr_at_95_tpr(probs_in, probs_out, *, score: str = "entropy", tpr: float = 0.95) -> float:
    """Fraction of OOD inputs accepted as in-distribution when 95% of the in-distribution inputs
    are accepted (:func:`fpr_at_tpr` on :func:`ood_scores`); lower is better."""
    return fpr_at_tpr(*_two_sets(probs_in, probs_out, score), tpr=tpr)
