"""The fingerprint that tells an untrained run of passes (pyro_bdl.nn.running_stats): every
writer between two passes changes it, and a pass that wrote nothing leaves it."""

from __future__ import annotations

import pyro
import torch
from torch import nn

from pyro_bdl.nn.running_stats import _unchanged, _versions, _walk


def _net() -> nn.Module:
    shared = nn.BatchNorm1d(4)  # reachable under two paths
    return nn.Sequential(nn.Linear(3, 4), shared, nn.Sequential(shared), nn.Linear(4, 2))


def test_the_walk_finds_every_training_norm_layer_and_every_tensor_dict():
    net = _net()
    layers, holders = _walk(net)
    assert {id(layer) for layer in layers} == {id(net[1])}
    tensors = {id(t) for h in holders for t in h.values() if t is not None}
    assert tensors == {id(t) for t in [*net.parameters(), *net.buffers()]}
    net.eval()
    assert _walk(net)[0] == []


def test_every_writer_between_passes_changes_the_fingerprint():
    net = _net()
    pyro.param("guide_loc", torch.zeros(3))
    holders = _walk(net)[1]
    before = _versions(holders)
    assert _unchanged(holders, before)
    assert not _unchanged(holders, None)
    assert not _unchanged(holders, before[:-2])  # a tensor more than then
    assert not _unchanged(holders, [*before, 0, 0])  # a tensor fewer
    writers = [
        lambda: net(torch.randn(5, 3)),  # a training-mode forward moves the statistics
        lambda: dict(pyro.get_param_store().named_parameters())["guide_loc"].add_(1),
        lambda: setattr(net[0], "bias", nn.Parameter(torch.zeros(4))),  # a replaced parameter
        lambda: net[1].running_mean.add_(1),
    ]
    for write in writers:
        before = _versions(holders)
        with torch.no_grad():
            write()
        assert not _unchanged(holders, before)
        assert _unchanged(holders, _versions(holders))


def test_a_tensor_registered_on_a_layer_that_had_none_changes_the_fingerprint():
    net = _net()
    before = _versions(_walk(net)[1])
    net[2].register_buffer("scale", torch.ones(1))  # the inner Sequential had no tensors
    assert not _unchanged(_walk(net)[1], before)
