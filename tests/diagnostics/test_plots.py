import pytest
import torch
from matplotlib.figure import Figure
from pyro.infer.autoguide import AutoDelta, AutoNormal

from pyro_bdl.diagnostics import export, metrics, ood, plots
from tests.diagnostics.test_export import tiny_classifier

PNG = b"\x89PNG\r\n\x1a\n"


def test_reliability_and_entropy_figures(tmp_path):
    g = torch.Generator().manual_seed(0)
    probs = (2 * torch.randn(60, 4, generator=g)).softmax(-1)
    y = torch.randint(0, 4, (60,), generator=g)
    flat = (0.2 * torch.randn(30, 4, generator=g)).softmax(-1)
    fig = plots.plot_reliability(metrics.reliability(probs, y), title="test")
    assert isinstance(fig, Figure)
    fig.savefig(tmp_path / "rel.png")
    fig = plots.plot_entropy(
        ood.predictive_entropy(probs), ood.predictive_entropy(flat), num_classes=4
    )
    fig.savefig(tmp_path / "ent.png")
    assert [len(ax.patches) > 0 for ax in fig.axes] == [True]
    for name in ("rel.png", "ent.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    with pytest.raises(TypeError, match="Reliability"):
        plots.plot_reliability((probs, y))
    with pytest.raises(ValueError, match=r"shape \(n,\)"):
        plots.plot_entropy(torch.zeros(0))


@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoDelta])
def test_arviz_plots_on_exported_data(tmp_path, guide_cls):
    model, x, y = tiny_classifier()
    guide = guide_cls(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=8)
    paths = plots.save_arviz_plots(data, tmp_path, prefix="m-")
    assert [p.name for p in paths] == ["m-ppc.png", "m-loo-khat.png", "m-forest.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG
    with pytest.raises(TypeError, match="InferenceData"):
        plots.save_arviz_plots({"posterior": None}, tmp_path)


def test_arviz_plots_of_one_draw_leave_out_the_loo_plot(tmp_path):
    # One draw leaves nothing for PSIS-LOO to fit (ArviZ 0.x raised IndexError, and every plot
    # was lost); the other plots still come.
    model, x, y = tiny_classifier()
    guide = AutoNormal(model)
    guide(x, y)
    data = export.to_inference_data(model, guide, x, y, num_samples=1)
    paths = plots.save_arviz_plots(data, tmp_path, prefix="m-")
    assert [p.name for p in paths] == ["m-ppc.png", "m-forest.png"]
