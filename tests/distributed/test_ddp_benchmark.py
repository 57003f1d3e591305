"""Smoke test of benchmarks/ddp.py: two gloo ranks run every variant on a tiny network, every
variant is timed and every ratio is formed (the figures themselves are not checked)."""

import pytest

from benchmarks import ddp

pytestmark = pytest.mark.distributed


def test_every_variant_is_timed_and_every_ratio_formed():
    both = ddp.run({"tiny": (8, 4, False), "tiny_packed": (8, 4, True)}, rounds=2, block=2)
    assert set(both) == {"tiny", "tiny_packed"}
    figures = both["tiny"]
    assert set(figures["seconds_per_step"]) == set(ddp.VARIANTS)
    assert all(v["median"] > 0 for v in figures["seconds_per_step"].values())
    assert set(figures["ratio_to_ddp"]) == {"dpsvi", "dpsvi_no_overlap", "dpsvi_pyro_optim"}
    assert figures["dpsvi_over_ddp_per_round"]["median"] > 0


def test_the_hand_written_loss_matches_its_module():
    # The DDP module (packed or not) and the plain function evaluate the same loss at the same
    # initial values: each construction reseeds, so the draw of ε that follows is the same.
    import torch

    x, y = ddp._data(4, 0)
    sizes = [64, 8, 8, 10]
    a = ddp.MeanFieldMLP(sizes)(x, y)
    packed = ddp.MeanFieldMLP(sizes, packed=True)(x, y)
    b = ddp._loss(ddp._init(sizes), x, y, ddp.DATASET_SIZE)
    assert torch.equal(a, b) and torch.equal(packed, b)
