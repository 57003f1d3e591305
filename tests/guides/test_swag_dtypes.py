"""The running mean of :class:`~pyro_bdl.guides.AutoSWAG` stays float64 when the guide is cast
(``guide.float()``, ``guide.to(device, dtype)``), as the module promises "whatever the weights'
dtype": the variances of float32 weights far from zero depend on it."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_bdl.guides import AutoSWAG


@pytest.mark.parametrize("cast", ["float", "to_dtype", "to_device_dtype"])
def test_a_cast_keeps_the_float64_mean_and_the_accurate_variances(cast):
    d, t = 200, 20

    def model():
        pyro.sample("theta", dist.Normal(torch.zeros(d), 1.0).to_event(1))

    pyro.clear_param_store()
    guide = AutoSWAG(model, rank=4)
    guide()
    g = torch.Generator().manual_seed(0)
    base = 1e4 * (1 + torch.rand(d, generator=g, dtype=torch.float64))
    iterates = (base + 1e-3 * torch.randn(t, d, generator=g, dtype=torch.float64)).float()
    for k, theta in enumerate(iterates):
        with torch.no_grad():
            guide.loc.copy_(theta)
        guide.collect()
        if k == t // 2:  # halfway: the mean so far must survive the cast too
            if cast == "float":
                guide.float()
            elif cast == "to_dtype":
                guide.to(torch.float32)
            else:
                guide.to("cpu", torch.float32)
    assert guide.swag_mean.dtype == torch.float64
    assert guide.swag_m2.dtype == torch.float32
    exact = iterates.double().var(0, unbiased=False)
    got = guide.swag_m2.double() / t
    # As in test_float32_weights_far_from_zero_get_accurate_variances: ≲ T·u = 1.2e-6 from the
    # float32 sum of squares; a float32 mean (spacing 1e-3 at 1e4) would err by 50% and more.
    assert float(((got - exact).abs() / exact).max()) < 1e-5
