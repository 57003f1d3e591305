"""Warnings of the library point at the user's line (pyro_bdl/_caller.py), however many of the
library's frames, decorators included, lie between (the Laplace mode check's:
tests/guides/test_laplace_mode_check.py)."""

from __future__ import annotations

import pyro
import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl._caller import user_stacklevel
from pyro_bdl.guides.laplace import PriorPrecisionBoundWarning


def _classifier():
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = (x[:, 0] > 0).long()
    net = bdl.bayesianize(nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)))
    return bdl.models.classifier(net, 40), x, y


def _laplace():
    pyro.clear_param_store()
    model, x, y = _classifier()
    guide = bdl.guides.AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(x, y)
    return guide, x, y


def test_a_grid_edge_warns_at_the_callers_line():
    guide, x, y = _laplace()
    guide.fit((x, y), check_mode=False)
    grid = torch.tensor([1e6, 1e7])  # far above any evidence maximum here: the lower edge wins
    with pytest.warns(PriorPrecisionBoundWarning) as caught:
        guide.tune_prior_precision(search="grid", grid=grid)
    assert caught[0].filename == __file__


def test_a_vogn_batch_of_one_warns_at_the_callers_line():
    pyro.clear_param_store()
    model, x, y = _classifier()
    vogn = bdl.infer.VOGN(model, dataset_size=40, betas=(0.9, 0.999))
    with pytest.warns(UserWarning, match="B/β₂") as caught:
        vogn.step(x[:1], y[:1])
    assert caught[0].filename == __file__


def test_user_stacklevel_counts_the_packages_frames_only():
    assert user_stacklevel() == 1  # called from outside the package: this very frame
