"""A SWAG state whose statistics no run of :meth:`~pyro_bdl.guides.AutoSWAG.collect` gives (a
negative counter, NaN or inf moments, a negative sum of squared deviations) is refused before
anything loads, naming the key."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_bdl.guides import AutoSWAG
from pyro_bdl.guides.state_checks import StateDictMismatchError


def _model():
    pyro.sample("theta", dist.Normal(torch.zeros(5), 1.0).to_event(1))


def _guide(collections: int) -> AutoSWAG:
    guide = AutoSWAG(_model, rank=3)
    guide()
    g = torch.Generator().manual_seed(0)
    for _ in range(collections):
        with torch.no_grad():
            guide.loc.copy_(torch.randn(5, generator=g))
        guide.collect()
    return guide


def _nan_first(t: torch.Tensor) -> torch.Tensor:
    return t.flatten().index_fill(0, torch.tensor([0]), float("nan")).reshape(t.shape)


@pytest.mark.parametrize(
    ("key", "corrupt", "match"),
    [
        ("swag_num_collected", lambda t: -t, r"'swag_num_collected': must be >= 0; got -4"),
        ("swag_m2", lambda t: -t, r"'swag_m2': .* must be >= 0"),
        ("swag_m2", _nan_first, r"'swag_m2': contains NaN or inf"),
        ("swag_mean", _nan_first, r"'swag_mean': contains NaN or inf"),
        ("swag_deviations", _nan_first, r"'swag_deviations': contains NaN or inf"),
    ],
    ids=["negative_count", "negative_m2", "nan_m2", "nan_mean", "nan_deviations"],
)
def test_corrupt_statistics_are_refused_before_anything_loads(key, corrupt, match):
    pyro.clear_param_store()
    state = _guide(4).state_dict()
    state[key] = corrupt(state[key])
    pyro.clear_param_store()
    fresh = _guide(0)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=match):
        fresh.load_state_dict(state)
    assert fresh.num_collected == 0
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_sound_state_still_loads():
    pyro.clear_param_store()
    guide = _guide(4)
    pyro.clear_param_store()
    fresh = _guide(0)
    fresh.load_state_dict(guide.state_dict())
    assert fresh.num_collected == 4
    assert torch.equal(fresh.swag_m2, guide.swag_m2)
