"""sample_outputs / Predictive(parallel=True) with every guide of the library."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO

from pyro_bdl import bayesianize, infer, init_to_network, models
from pyro_bdl.app.compare.problem import cnn, mlp
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.predictive import forget_output_sizes, sample_outputs
from tests.common import rows_per_forward

N = 40


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 1, 6, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def _fit(kind: str, net_kind: str):
    """``(model, guide)`` on a small digits-shaped net, fitted through public APIs only."""
    torch.manual_seed(0)
    build = {"mlp": mlp, "cnn": cnn}[net_kind]
    net = bayesianize(build((1, 6, 6), 3))
    model = models.classifier(net, dataset_size=N)
    x, y = _data()
    if kind == "vogn":
        vogn = infer.VOGN(model, dataset_size=N, lr=1e-3)
        for _ in range(2):
            vogn.step(x, y)
        guide = vogn.guide
    elif kind == "swag":
        guide = AutoSWAG(model, rank=2)
        svi = SVI(model, guide, pyro.optim.SGD({"lr": 1e-2}), Trace_ELBO())
        for _ in range(2):
            svi.step(x, y)
            guide.collect()
    elif kind == "laplace":
        guide = AutoSubnetLaplace(model, subnetwork="largest_variance", size=20)
        SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO()).step(x, y)
        guide.fit((x, y))
    else:
        guide = {"meanfield": AutoMeanField, "radial": AutoRadial}[kind](model, init_scale=0.1)
        guide(x, y)
    net.eval()
    return model, guide, x


GUIDES = ["meanfield", "radial", "swag", "vogn", "laplace"]


@pytest.mark.parametrize("net_kind", ["mlp", "cnn"])
@pytest.mark.parametrize("kind", GUIDES)
def test_parallel_and_sequential_predictive_agree_in_distribution(kind, net_kind):
    model, guide, x = _fit(kind, net_kind)
    s = 200
    with torch.no_grad():
        par = sample_outputs(model, guide, x, num_samples=s).softmax(-1)
        seq = sample_outputs(model, guide, x, num_samples=s, parallel=False).softmax(-1)
    assert par.shape == seq.shape == (s, 12, 3)
    assert par.std(0).max() > 0  # the draws differ: it is a distribution, not a point
    # Predictive means of two independent s-sample estimates: the difference has standard error
    # sqrt(var_par/s + var_seq/s) per entry; 6 SE over 36 entries keeps a false failure below
    # 36 * 2e-9 for Gaussian means (s = 200 makes the CLT accurate for probabilities in [0, 1]).
    se = ((par.var(0) + seq.var(0)) / s).sqrt()
    assert ((par.mean(0) - seq.mean(0)).abs() <= 6 * se + 1e-6).all()


def test_chunks_of_max_parallel_give_all_samples():
    model, guide, x = _fit("meanfield", "mlp")
    with torch.no_grad():
        out = sample_outputs(model, guide, x, num_samples=7, max_parallel=3)  # chunks 3, 3, 1
    assert out.shape == (7, 12, 3)
    assert not torch.allclose(out[0], out[6])


def test_one_sample_is_one_forward_pass():
    # S = 1: the draw that checks the output's memory is the sample itself (an ensemble member's
    # prediction is one forward pass). S > 1: one row checks it, then one vectorized pass of S.
    model, guide, x = _fit("meanfield", "mlp")
    rows, handle = rows_per_forward(model.net)
    try:
        out = sample_outputs(model, guide, x, num_samples=1)
        assert out.shape == (1, 12, 3) and rows == [12]
        rows.clear()
        sample_outputs(model, guide, x, num_samples=4)
        assert rows == [1, 12]
        rows.clear()
        sample_outputs(model, guide, x, _data()[1], num_samples=4)  # labels: one row of them too
        assert rows == [1, 12]
        rows.clear()
        sample_outputs(model, guide, x, num_samples=4, parallel=False)
        assert rows == [12] * 4  # the first draw checks the memory: no pass of its own
    finally:
        handle.remove()


def test_the_one_row_check_changes_no_draw_and_a_hand_written_model_checks_whole():
    # The one-row draw's random streams are put back: the S draws are the plain vectorized
    # draws, those of one plate over the guide replayed into the network.
    model, guide, x = _fit("meanfield", "mlp")
    rows, handle = rows_per_forward(model.net)
    try:
        pyro.set_rng_seed(4)
        ours = sample_outputs(model, guide, x, num_samples=5)
        assert rows == [1, 12]
        pyro.set_rng_seed(4)
        with torch.no_grad(), pyro.plate("_num_predictive_samples", 5, dim=-2):
            trace = poutine.trace(poutine.mask(guide, mask=False)).get_trace(x)
            plain = poutine.replay(model.network_output, trace=trace)(x)
        assert torch.equal(ours, plain)
        # Of a hand-written model nothing says that dim 0 holds the examples: its check runs
        # the whole batch (after Pyro's guess of its plate nesting, a run of the model).
        rows.clear()
        sample_outputs(lambda x, y=None: model(x, y), guide, x, num_samples=5)
        assert rows == [12, 12, 12]
    finally:
        handle.remove()


def test_the_output_size_is_measured_once_per_model_and_row_shape():
    # A second call on batches shaped alike makes no one-row pass, nor one on another batch
    # size (its row is shaped alike); other arguments (labels too) or forget_output_sizes
    # measure again.
    model, guide, x = _fit("meanfield", "mlp")
    rows, handle = rows_per_forward(model.net)
    try:
        sample_outputs(model, guide, x, num_samples=4)
        assert rows == [1, 12]
        rows.clear()
        sample_outputs(model, guide, x, num_samples=4)
        sample_outputs(model, guide, x[:5], num_samples=3)
        assert rows == [12, 5]
        rows.clear()
        sample_outputs(model, guide, x, _data()[1], num_samples=2)
        assert rows == [1, 12]  # labels too: other arguments, measured
        rows.clear()
        forget_output_sizes(model)
        sample_outputs(model, guide, x, num_samples=4)
        assert rows == [1, 12]
        rows.clear()
        forget_output_sizes()
        sample_outputs(model, guide, x, num_samples=4)
        assert rows == [1, 12]
    finally:
        handle.remove()


def test_a_kept_output_size_gives_the_same_draws_and_still_refuses():
    model, guide, x = _fit("meanfield", "mlp")
    forget_output_sizes(model)
    pyro.set_rng_seed(3)
    measured = sample_outputs(model, guide, x, num_samples=4)
    pyro.set_rng_seed(3)
    kept = sample_outputs(model, guide, x, num_samples=4)
    assert torch.equal(measured, kept)
    # 10**6 draws of a (12, 3) float32 output: 1.44e8 bytes, above a 1e8-byte bound; refused
    # from the kept size, before any pass and with the random stream untouched.
    rows, handle = rows_per_forward(model.net)
    try:
        rng = torch.get_rng_state()
        with pytest.raises(ValueError, match="num_samples=1000000 outputs of shape \\(12, 3\\)"):
            sample_outputs(model, guide, x, num_samples=10**6, max_memory=10**8)
        assert rows == [] and torch.equal(torch.get_rng_state(), rng)
    finally:
        handle.remove()


def test_a_hand_written_model_returning_the_network_output_works_too():
    model, guide, x = _fit("meanfield", "cnn")

    def mine(x, y=None):
        return model(x, y)

    with torch.no_grad():
        out = sample_outputs(mine, guide, x, num_samples=4)
    assert out.shape == (4, 12, 3)

    def bad(x, y=None):
        model(x, y)
        return torch.zeros(2)

    with pytest.raises(ValueError, match="needs a model that returns the network output"):
        sample_outputs(bad, guide, x, num_samples=4)


def test_parallel_predictive_with_a_seed_is_reproducible():
    model, guide, x = _fit("radial", "cnn")
    outs = []
    for _ in range(2):
        pyro.set_rng_seed(3)
        with torch.no_grad():
            outs.append(sample_outputs(model, guide, x, num_samples=5))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("parallel", [True, False])
def test_the_batch_passed_by_keyword_gives_the_draws_of_the_positional_call(parallel):
    # The batch by keyword, as a model is called (svi.step(x=x, y=y), Predictive(...)(x=x)).
    model, guide, x = _fit("meanfield", "mlp")
    outs = []
    for args, kwargs in [((x,), {}), ((), {"x": x})]:
        pyro.set_rng_seed(3)
        with torch.no_grad():
            outs.append(
                sample_outputs(model, guide, *args, num_samples=4, parallel=parallel, **kwargs)
            )
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_bad_num_samples_is_refused():
    model, guide, x = _fit("meanfield", "mlp")
    with pytest.raises(TypeError, match="num_samples must be an int >= 1"):
        sample_outputs(model, guide, x, num_samples=0.5)
    with pytest.raises(ValueError, match="max_parallel"):
        sample_outputs(model, guide, x, num_samples=4, max_parallel=0)


#: task -> (the model of a lifted net, the net's outputs, its labels, the returned shape)
_ONE_COLUMN = {
    "regressor": (lambda net: models.regressor(net, N, noise_scale=0.5), 1, torch.randn(12), (12,)),
    "binary": (lambda net: models.binary_classifier(net, N), 1, torch.arange(12.0) % 2, (12,)),
    "heteroscedastic": (
        lambda net: models.heteroscedastic_regressor(net, N),
        2,
        torch.randn(12),
        (12, 2),
    ),
    "classifier": (lambda net: models.classifier(net, N), 3, torch.arange(12) % 3, (12, 3)),
}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("task", list(_ONE_COLUMN))
def test_the_draws_have_the_shape_and_values_of_predictives_return(task, parallel):
    """sample_outputs gives what the model returns, as Predictive's "_RETURN" holds it: a
    one-output regressor's or binary classifier's (B, 1) network output as (B,), so
    ``draws.mean(0) - y`` cannot broadcast to (B, B). A point guide makes both draws the network
    at its weights, so their values agree exactly."""
    build, outputs, y, shape = _ONE_COLUMN[task]
    torch.manual_seed(0)
    net = bayesianize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, outputs)))  # fmt: skip
    model = build(net)
    guide = pyro.infer.autoguide.AutoDelta(model, init_loc_fn=init_to_network)
    x = torch.randn(12, 4)
    guide(x, y)  # Pyro's AutoDelta sets up on a call with the labels observed
    draws = sample_outputs(model, guide, x, num_samples=3, parallel=parallel)
    returned = pyro.infer.Predictive(model, guide=guide, num_samples=3, return_sites=["_RETURN"])(
        x
    )["_RETURN"]
    assert draws.shape == returned.shape == (3, *shape)
    torch.testing.assert_close(draws, returned)


@pytest.mark.parametrize("kept", [False, True], ids=["measured", "kept"])
def test_max_memory_bounds_the_bytes_of_the_whole_batchs_outputs(kept):
    # 4 draws of the (12, 3) float32 logits are 4·12·3·4 = 576 bytes, though the measuring
    # draw sees one row (48 bytes for the 4 draws): a bound of 576 takes them, 575 does not.
    model, guide, x = _fit("meanfield", "mlp")

    def draws(max_memory):
        forget_output_sizes(model)
        if kept:  # a first call measures the row's output and keeps its size
            sample_outputs(model, guide, x, num_samples=2)
        return sample_outputs(model, guide, x, num_samples=4, max_memory=max_memory)

    assert draws(576).shape == (4, 12, 3)
    with pytest.raises(ValueError, match=r"need 576 bytes .* more than max_memory=575"):
        draws(575)
