"""Every colour the reliability diagram fills with is one its legend shows.

An underconfident bin's gap lies inside its accuracy bar; drawn translucent it blended with the
bar into a colour the legend never named. The gap colours are opaque now, one per sign.
"""

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba

from pyro_bdl.diagnostics import metrics, plots


def _probs_and_labels(correct: int) -> tuple[torch.Tensor, torch.Tensor]:
    """400 rows over 10 classes whose first ``correct`` rows are right and the rest random."""
    g = torch.Generator().manual_seed(0)
    probs = (2 * torch.randn(400, 10, generator=g)).softmax(-1)
    y = torch.randint(0, 10, (400,), generator=g)
    y[:correct] = probs[:correct].argmax(-1)
    return probs, y


def _fill_colours(artists) -> set[tuple[float, ...]]:
    return {tuple(np.round(to_rgba(a.get_facecolor()), 6)) for a in artists}


@pytest.mark.parametrize("correct", [0, 200, 400], ids=["overconfident", "mixed", "all-right"])
def test_every_fill_colour_is_in_the_legend(correct):
    probs, y = _probs_and_labels(correct)
    reliability = metrics.reliability(probs, y)
    ax = plots.plot_reliability(reliability).axes[0]
    legend = ax.get_legend()
    drawn = _fill_colours(ax.patches)
    shown = _fill_colours(legend.get_patches())
    assert drawn <= shown, f"colours drawn but not in the legend: {drawn - shown}"
    # Opaque fills: a gap drawn over an accuracy bar shows its own colour, not a blend.
    assert all(colour[3] == 1.0 for colour in drawn)
    labels = [t.get_text() for t in legend.get_texts()]
    gap = reliability.confidence - reliability.accuracy
    for sign, kind in ((1, "over"), (-1, "under")):
        occurs = bool((np.sign(gap[reliability.counts > 0]) == sign).any())
        assert (plots.GAP_STYLES[kind][2] in labels) == occurs, (kind, labels)


def test_the_cases_cover_both_gaps():
    # Guard: the mixed case has over- and underconfident bins, so both legend entries are tested.
    probs, y = _probs_and_labels(200)
    r = metrics.reliability(probs, y)
    gap = (r.confidence - r.accuracy)[r.counts > 0]
    assert (gap > 0).any() and (gap < 0).any()
