"""Diagnostic plots, saved as PNG: reliability diagram, predictive-entropy histograms in and out of
distribution, and ArviZ's own plots on exported data.

Figures are built with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through ``pyplot``: nothing opens a window, nothing changes the user's backend, and figures are
freed when dropped. ArviZ 0.x plots get their axes from us for the same reason; ArviZ ≥ 1
(``arviz_plots``) makes its own figures with ``pyplot``, and each is closed once saved (see
:mod:`~pyro_bdl.diagnostics.arviz_compat`).

Usage::

    fig = plot_reliability(metrics.reliability(probs, y)); fig.savefig("reliability.png")
    plot_entropy(predictive_entropy(probs), predictive_entropy(probs_ood))
    save_arviz_plots(idata, "out/", prefix="map-")

References:
    Guo, Pleiss, Sun & Weinberger, "On Calibration of Modern Neural Networks", ICML 2017.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pyro_bdl.diagnostics import arviz_compat
from pyro_bdl.diagnostics.metrics import Reliability, as_tensor, check_finite_values

__all__ = ["plot_entropy", "plot_reliability", "save_arviz_plots"]


#: How the gap between confidence and accuracy is drawn, by its sign: ``(colour, hatch, label)``.
#: The colours are opaque, so a gap drawn over an accuracy bar (an underconfident bin) shows the
#: colour its legend entry shows instead of a blend of the two.
GAP_STYLES = {
    "over": ("#f4a3a3", "//", "gap: confidence above accuracy"),
    "under": ("#a6d8a0", "\\\\", "gap: accuracy above confidence"),
}


def plot_reliability(reliability: Reliability, *, title: str = "") -> Figure:
    """Accuracy per confidence bin against the diagonal of perfect calibration, with the gap
    shaded (one colour where the model is overconfident, another where it is underconfident,
    each in the legend when it occurs) and the ECE in the legend."""
    if not isinstance(reliability, Reliability):
        raise TypeError(
            f"reliability must be a Reliability (from metrics.reliability(probs, y)); got "
            f"{type(reliability).__name__}."
        )
    r = reliability
    fig = Figure(figsize=(4.5, 4.5), layout="constrained")
    ax = fig.subplots()
    centers = (r.edges[:-1] + r.edges[1:]) / 2
    width = np.diff(r.edges)
    filled = r.counts > 0
    ax.bar(
        centers[filled],
        r.accuracy[filled],
        width=width[filled],
        edgecolor="black",
        color="tab:blue",
        label=f"accuracy (ECE {r.ece:.3f})",
    )
    gap = r.confidence - r.accuracy
    for kind, bins in (("over", filled & (gap > 0)), ("under", filled & (gap < 0))):
        if not bins.any():
            continue  # no legend entry for a gap the figure does not draw
        color, hatch, label = GAP_STYLES[kind]
        ax.bar(
            centers[bins],
            gap[bins],
            bottom=r.accuracy[bins],
            width=width[bins],
            color=color,
            edgecolor="dimgray",
            hatch=hatch,
            label=label,
        )
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (max probability)", ylabel="accuracy")
    ax.set_title(title or "reliability diagram")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def plot_entropy(
    entropy_in, entropy_out=None, *, num_classes: int | None = None, title: str = ""
) -> Figure:
    """Histograms of predictive entropy on in-distribution and (optionally) out-of-distribution
    inputs, normalised to densities so sets of different sizes compare; ``num_classes`` marks the
    maximum entropy log C."""
    sets = [("in-distribution", entropy_in)]
    if entropy_out is not None:
        sets.append(("out-of-distribution", entropy_out))
    arrays = []
    for label, values in sets:
        t = as_tensor(f"entropy ({label})", values)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(
                f"entropy ({label}) must have shape (n,) with n ≥ 1; got {tuple(t.shape)}. Pass "
                "one entropy per example (metrics.predictive_entropy(probs))."
            )
        check_finite_values(
            f"entropy ({label})",
            t.double(),
            "Compute it with ood.predictive_entropy of finite probabilities.",
        )
        arrays.append((label, t.detach().double().cpu().numpy()))
    top = max(float(a.max()) for _, a in arrays)
    if num_classes is not None:
        top = max(top, float(np.log(num_classes)))
    bins = np.linspace(0.0, max(top, 1e-6) * 1.02, 31)
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.subplots()
    for (label, a), color in zip(arrays, ("tab:blue", "tab:orange")):
        ax.hist(
            a,
            bins=bins.tolist(),
            density=True,
            alpha=0.55,
            color=color,
            label=f"{label} (n={len(a)})",
        )
    if num_classes is not None:
        ax.axvline(np.log(num_classes), color="k", ls="--", lw=1, label="max entropy log C")
    ax.set(xlabel="predictive entropy (nats)", ylabel="density")
    ax.set_title(title or "predictive entropy")
    ax.legend(fontsize="small")
    return fig


def _smallest_posterior_variable(posterior) -> str | None:
    sizes = {
        name: int(np.prod([posterior[name].sizes[d] for d in posterior[name].dims[2:]] or [1]))
        for name in posterior.data_vars
    }
    return min(sizes, key=lambda n: sizes[n]) if sizes else None


def save_arviz_plots(
    data, folder: str | os.PathLike, *, prefix: str = "", var_names: list[str] | None = None
) -> list[Path]:
    """ArviZ's own plots on exported data (ArviZ 0.x or ≥ 1), saved as PNG into ``folder``:

    - ``<prefix>ppc.png``: posterior predictive against the observed data (``plot_ppc``, or
      ``plot_ppc_dist`` on ArviZ ≥ 1);
    - ``<prefix>loo-khat.png``: pointwise PSIS-LOO k̂ (``plot_khat`` on :func:`~.psis.loo`;
      left out with fewer than two draws, which leave PSIS nothing to fit);
    - ``<prefix>forest.png``: credible intervals of ``var_names`` (default: the smallest
      posterior variable, to keep the figure readable for networks).

    :returns: the paths written.
    """
    if not arviz_compat.is_data(data):
        raise TypeError(
            f"data must be arviz.InferenceData or xarray.DataTree; got {type(data).__name__}. "
            "Create it with to_inference_data."
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    groups = set(arviz_compat.group_names(data))
    if {"posterior_predictive", "observed_data"} <= groups:
        predictive = arviz_compat.group(data, "posterior_predictive")
        path = folder / f"{prefix}ppc.png"
        num_samples = min(50, arviz_compat.num_draws(predictive))
        written.append(arviz_compat.plot_ppc(data, path, num_samples=num_samples))
    log_likelihood = (
        arviz_compat.group(data, "log_likelihood") if "log_likelihood" in groups else None
    )
    if log_likelihood is not None and arviz_compat.num_draws(log_likelihood) > 1:
        result = arviz_compat.loo(data, pointwise=True)
        written.append(arviz_compat.plot_khat(result, folder / f"{prefix}loo-khat.png"))
    if "posterior" in groups:
        posterior = arviz_compat.group(data, "posterior")
        names = var_names or [v for v in [_smallest_posterior_variable(posterior)] if v]
        if names:
            written.append(arviz_compat.plot_forest(data, names, folder / f"{prefix}forest.png"))
    return written
