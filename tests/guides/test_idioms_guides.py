"""The non-Laplace guides, ``sample_outputs``, the BatchNorm refresh and checkpoints under the
habits of everyday PyTorch code: ``copy.deepcopy`` of a guide, a guide first called under
``torch.inference_mode()``, inputs of another dtype or device, BatchNorm left in training mode,
and a checkpoint loaded under inference mode."""

from __future__ import annotations

import copy

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_bdl.checkpoint import load_checkpoint, save_checkpoint
from pyro_bdl.guides import AutoEnsemble, AutoMeanField, AutoMultiSWAG, AutoRadial, AutoSWAG
from pyro_bdl.guides.batchnorm import predict_with_bn_refresh, refresh_batchnorm
from pyro_bdl.predictive import sample_outputs
from tests.guides.test_contract import BATCH, data, small_model
from tests.guides.test_swag import trained_guide

GUIDES = {
    "meanfield": lambda model: AutoMeanField(model),
    "radial": lambda model: AutoRadial(model),
    "swag": lambda model: AutoSWAG(model, rank=2),
}


def _steps(svi, guide, x, y, steps: int) -> list[float]:
    """``steps`` SVI steps, each followed by a SWAG snapshot for a SWAG guide; the losses."""
    losses = []
    for _ in range(steps):
        losses.append(svi.step(x[:BATCH], y[:BATCH]))
        if isinstance(guide, AutoSWAG):
            guide.collect()
    return losses


def _train(model, guide, x, y, steps: int = 3) -> list[float]:
    """A few steps of a fresh SVI with Adam; the losses."""
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    return _steps(svi, guide, x, y, steps)


def _draws(model, guide, x) -> torch.Tensor:
    pyro.set_rng_seed(7)
    return sample_outputs(model, guide, x[:4], num_samples=3)


# ----------------------------------------------------------------------------- copy.deepcopy


@pytest.mark.parametrize("trained", [False, True], ids=["set_up", "trained"])
@pytest.mark.parametrize("kind", list(GUIDES))
def test_a_deep_copy_of_a_guide_draws_what_the_guide_draws(kind, trained):
    # The prototype trace held the model's outputs inside their graph, which torch refuses to
    # deepcopy ("Only Tensors created explicitly by the user (graph leaves) support the
    # deepcopy protocol").
    x, y = data()
    model = small_model()
    guide = GUIDES[kind](model)
    guide(x[:BATCH], y[:BATCH])
    if trained:
        _train(model, guide, x, y)
    twin = copy.deepcopy(guide)
    assert torch.equal(_draws(model, twin, x), _draws(model, guide, x))
    own = {name: t.data_ptr() for name, t in guide.named_buffers()}
    assert all(t.data_ptr() != own[name] for name, t in twin.named_buffers())


def test_a_deep_copy_of_swag_collects_without_changing_the_original():
    x, y = data()
    model = small_model()
    guide = AutoSWAG(model, rank=2)
    _train(model, guide, x, y)
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    twin = copy.deepcopy(guide)
    twin.collect()
    assert twin.num_collected == guide.num_collected + 1
    for key, value in guide.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("cls", [AutoEnsemble, AutoMultiSWAG])
def test_a_deep_copy_of_an_ensemble_draws_what_it_draws(cls):
    x, y = data()
    members, model = [], None
    for k in range(2):
        pyro.set_rng_seed(k)
        pyro.clear_param_store()
        member_model = small_model(k)
        model = model or member_model
        member = AutoDelta(member_model) if cls is AutoEnsemble else AutoSWAG(member_model, rank=2)
        _train(member_model, member, x, y)
        members.append(member.median() if cls is AutoEnsemble else member)
    guide = cls(model, members)
    guide(x[:BATCH], y[:BATCH])
    assert torch.equal(_draws(model, copy.deepcopy(guide), x), _draws(model, guide, x))


# ----------------------------------------------------------------------------- grad modes


@pytest.mark.parametrize("kind", list(GUIDES))
def test_a_guide_first_called_under_inference_mode_trains_as_one_set_up_outside(kind):
    # Set up under inference mode, its parameters were inference tensors: the first optimizer
    # step failed with "Inference tensors do not track version counter".
    x, y = data()
    pyro.set_rng_seed(0)
    model = small_model()
    guide = GUIDES[kind](model)
    guide(x[:BATCH], y[:BATCH])
    expected = _train(model, guide, x, y)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = small_model()
    guide = GUIDES[kind](model)
    with torch.inference_mode():
        guide(x[:BATCH], y[:BATCH])
    assert not any(t.is_inference() for t in (*guide.parameters(), *guide.buffers()))
    assert _train(model, guide, x, y) == expected


@pytest.mark.parametrize("kind", ["meanfield", "swag"])
def test_a_checkpoint_loaded_under_inference_mode_resumes_bit_for_bit(tmp_path, kind):
    # The optimizer state loaded under inference mode was made of inference tensors: the next
    # step failed with "Inplace update to inference tensor outside InferenceMode".
    x, y = data()
    path = tmp_path / "run.ckpt"
    model = small_model()
    guide = GUIDES[kind](model)
    optim = pyro.optim.Adam({"lr": 1e-2})
    svi = SVI(model, guide, optim, Trace_ELBO())
    svi.step(x[:BATCH], y[:BATCH])
    save_checkpoint(path, guide=guide, optim=optim, step=1)
    expected = _steps(svi, guide, x, y, 2)

    pyro.clear_param_store()
    model = small_model()
    guide = GUIDES[kind](model)
    optim = pyro.optim.Adam({"lr": 1e-2})
    svi = SVI(model, guide, optim, Trace_ELBO())
    with torch.inference_mode():
        load_checkpoint(path, guide=guide, optim=optim, example_args=(x[:BATCH], y[:BATCH]))
    assert _steps(svi, guide, x, y, 2) == expected


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda x: x.double(),
            TypeError,
            r"x has dtype torch.float64 .* Use x.to\(torch.float32\)",
        ),
        (lambda x: x.long(), TypeError, r"x has dtype torch.int64 .* Use x.to\(torch.float32\)"),
        (lambda x: x.to("meta"), ValueError, r"x is on device meta but the network is on cpu"),
        (lambda x: x[:, :3], ValueError, r"x has 3 features .* expects 5"),
    ],
    ids=["float64", "int64", "meta", "width"],
)
def test_sample_outputs_refuses_a_batch_the_network_cannot_take_before_drawing(
    change, error, match, parallel
):
    # It replayed the network alone, past the model's checks: torch's "mat1 and mat2 must have
    # the same dtype" or "Tensor on device cpu is not on the expected device meta!".
    x, y = data()
    model = small_model()
    guide = AutoMeanField(model)
    guide(x[:BATCH], y[:BATCH])
    state = torch.get_rng_state()
    with pytest.raises(error, match=match):
        sample_outputs(model, guide, change(x[:4]), num_samples=3, parallel=parallel)
    assert torch.equal(torch.get_rng_state(), state)


def test_vectorized_sample_outputs_refuses_batchnorm_in_training_mode_naming_the_fix():
    # It failed in the one-row measuring draw with torch's "Expected more than 1 value per
    # channel when training".
    bnn, model, guide, x, _ = trained_guide(bn=True, collections=2)
    bnn.train()
    with pytest.raises(ValueError, match=r"BatchNorm layer '1' is in training mode.*net.eval\(\)"):
        sample_outputs(model, guide, x[:4], num_samples=3)
    assert bnn.training
    bnn.eval()
    assert sample_outputs(model, guide, x[:4], num_samples=3).shape == (3, 4, 3)


@pytest.mark.parametrize(
    "bad",
    [lambda x: x.double(), lambda x: [x[:20], x[20:].double()], lambda x: x[:, :3]],
    ids=["float64", "float64_second_batch", "width"],
)
def test_a_refused_batchnorm_refresh_keeps_the_statistics(bad):
    # The statistics were reset before torch refused the batch, and stayed reset.
    bnn, _, guide, x, _ = trained_guide(bn=True, collections=2)
    bn = bnn[1]
    saved = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises((TypeError, ValueError), match=r"x has "):
        refresh_batchnorm(bnn, bad(x), weights=guide.sample_weights())
    for key, value in bn.state_dict().items():
        assert torch.equal(value, saved[key]), key
    with pytest.raises(TypeError, match=r"x has dtype torch.float64"):
        predict_with_bn_refresh(guide, bnn, x.double(), num_samples=2, bn_data=x)
