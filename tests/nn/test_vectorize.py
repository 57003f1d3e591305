"""Lifted networks under sample dims: one vmapped forward equals the per-sample forwards."""

import copy
import pickle

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from pyro.nn import PyroModule
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.app.compare.problem import cnn, mlp
from pyro_bdl.guides import AutoMeanField
from pyro_bdl.infer import TraceSuffStat_ELBO
from pyro_bdl.nn.vectorize import batched_forward, restore_plate_dims
from tests.common import assert_close

K = 4


def _net(kind: str) -> nn.Module:
    build = {"mlp": mlp, "cnn": cnn}[kind]
    return bayesianize(build((1, 6, 6), 3)).eval()


def _draws(guide, x, num: int) -> list[dict[str, torch.Tensor]]:
    """``num`` independent draws of every latent site from the guide, one guide run each."""
    y = torch.zeros(x.shape[0], dtype=torch.long)
    draws = []
    for _ in range(num):
        tr = poutine.trace(guide).get_trace(x, y)
        draws.append({n: s["value"].detach() for n, s in tr.nodes.items() if s["type"] == "sample"})
    return draws


def _stack(draws, dim: int = -2) -> dict[str, torch.Tensor]:
    """The draws stacked as a particle plate at ``dim`` lays them out: ``(K, 1, *shape)``."""
    out = {}
    for name in draws[0]:
        v = torch.stack([d[name] for d in draws])
        out[name] = v.reshape(v.shape[:1] + (1,) * (-dim - 1) + v.shape[1:])
    return out


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_batched_weights_give_the_per_sample_outputs_and_log_likelihoods(kind):
    net = _net(kind)
    model = models.classifier(net, dataset_size=100)
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 3, (5,))
    guide = AutoMeanField(model, init_scale=0.1)
    draws = _draws(guide, x, K)

    seq_out, seq_ll = [], []
    for d in draws:
        tr = poutine.trace(poutine.condition(model, data=d)).get_trace(x, y)
        seq_out.append(tr.nodes["_RETURN"]["value"])
        seq_ll.append(tr.nodes["y"]["fn"].log_prob(y).sum())

    def vectorized(x, y):
        with pyro.plate("particles", K, dim=-2):
            return model(x, y)

    tr = poutine.trace(poutine.condition(vectorized, data=_stack(draws))).get_trace(x, y)
    out = tr.nodes["_RETURN"]["value"]
    assert out.shape == (K, 5, 3)
    # The same arithmetic batched: agreement to float32 round-off of a few reductions.
    assert_close(out, torch.stack(seq_out), rtol=1e-5, atol=1e-5)
    ll = tr.nodes["y"]["fn"].log_prob(y).sum(-1)
    assert_close(ll, torch.stack(seq_ll), rtol=1e-5, atol=1e-4)


def test_unbatched_calls_run_the_class_forward_and_a_plate_alone_changes_nothing():
    net = _net("mlp")
    model = models.classifier(net, dataset_size=10)
    x = torch.randn(3, 1, 6, 6)
    guide = AutoMeanField(model)
    (d,) = _draws(guide, x, 1)
    plain = poutine.condition(model, data=d)(x)

    def under_plate(x):
        with pyro.plate("particles", 1, dim=-2):
            return model(x)

    one = poutine.condition(under_plate, data=_stack([d]))(x)
    # The same float32 forward pass with a size-1 particle dim: identical kernels give equal
    # outputs (0 difference measured); 1e-6 (~8 ulps at ε = 1.2e-7 on outputs ≤ 1) allows a
    # batched kernel that sums in another order.
    assert_close(one, plain, rtol=1e-6, atol=1e-6)
    assert one.shape == plain.shape


def test_vectorized_particles_run_and_match_the_sequential_elbo_in_mean():
    torch.manual_seed(0)
    net = _net("mlp")
    model = models.classifier(net, dataset_size=20)
    x, y = torch.randn(6, 1, 6, 6), torch.randint(0, 3, (6,))
    guide = AutoMeanField(model, init_scale=0.05)
    guide(x, y)
    n = 50
    vec = Trace_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=1)
    # The sequential estimator with n particles is the mean of n single-particle losses; their
    # spread gives the standard error of the difference of the two independent n-means.
    single = torch.tensor([Trace_ELBO().loss(model, guide, x, y) for _ in range(n)])
    se = single.std() * (2.0 / n) ** 0.5
    diff = vec.loss(model, guide, x, y) - single.mean()
    # 5 standard errors: a false failure has probability below 1e-6 for Gaussian means (the
    # sd estimated from n = 50 losses is within 30% of the truth with overwhelming probability).
    assert abs(diff) < 5 * float(se), (diff, float(se))


@pytest.mark.parametrize("elbo_class", [Trace_ELBO, TraceSuffStat_ELBO])
def test_vectorized_particles_give_gradients_to_every_guide_parameter(elbo_class):
    net = _net("cnn")
    model = models.classifier(net, dataset_size=20)
    x, y = torch.randn(6, 1, 6, 6), torch.randint(0, 3, (6,))
    guide = AutoMeanField(model)
    guide(x, y)
    elbo = elbo_class(num_particles=3, vectorize_particles=True, max_plate_nesting=1)
    loss = elbo.differentiable_loss(model, guide, x, y)
    loss.backward()
    grads = [p.grad for p in guide.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_train_mode_batchnorm_with_batched_weights_is_refused_clearly():
    net = bayesianize(cnn((1, 6, 6), 3))  # training mode
    model = models.classifier(net, dataset_size=20)
    x = torch.randn(4, 1, 6, 6)
    guide = AutoMeanField(model)
    draws = _stack(_draws(guide, x, 2))

    def vectorized(x):
        with pyro.plate("particles", 2, dim=-2):
            return model(x)

    with pytest.raises(RuntimeError, match=r"BatchNorm layer '1' is in training mode.*eval\(\)"):
        poutine.condition(vectorized, data=draws)(x)


def test_a_value_of_the_wrong_event_shape_is_refused_naming_the_site():
    net = _net("mlp")
    model = models.classifier(net, dataset_size=20)
    x = torch.randn(4, 1, 6, 6)

    def vectorized(x):
        with pyro.plate("particles", 2, dim=-2):
            return model(x)

    bad = {"5.bias": torch.zeros(2, 1, 4)}
    with pytest.raises(ValueError, match=r"lifted site '5.bias' has value shape \(2, 1, 4\)"):
        poutine.condition(vectorized, data=bad)(x)


def test_dropout_draws_independently_per_sample():
    net = bayesianize(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 2)))
    x = torch.randn(1, 4)
    w = {name: spec.init_value for name, spec in net._bdl_sites.items()}
    batched = {k: v.expand(3, 1, *v.shape) for k, v in w.items()}

    def vectorized(x):
        with pyro.plate("particles", 3, dim=-2):
            return net(x)

    out = poutine.condition(vectorized, data=batched)(x)
    assert out.shape == (3, 1, 2)
    assert not torch.allclose(out[0], out[1])


def test_the_lifted_forward_survives_deepcopy_and_pickle_and_lifting_twice():
    net = _net("mlp")
    assert net.forward.func is batched_forward
    bayesianize(net)
    assert net.forward.args == (net,)
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert clone.forward.args[0] is clone
        x = torch.randn(2, 1, 6, 6)
        assert clone(x).shape == (2, 3)


def test_restore_plate_dims_puts_back_only_singleton_plate_dims():
    # A (5, 8, 4) draw of a weight whose prior is batched (5, 1): the singleton plate dim
    # comes back, so the value scores (5, 1), not (5, 5).
    value = torch.randn(5, 8, 4)
    restored = restore_plate_dims(value, torch.Size([5, 1]), 2)
    assert restored.shape == (5, 1, 8, 4) and torch.equal(restored.reshape(5, 8, 4), value)
    # Already broadcastable: unchanged (the same tensor).
    assert restore_plate_dims(value, torch.Size([5]), 2) is value
    # Other non-singleton dims (3 draws against a batch of 2): not a missing plate dim, so left
    # for the distribution to refuse, not reshaped into the wrong draws.
    for other, batch in ((torch.randn(3, 4), (2, 1)), (torch.randn(6, 4), (2, 3))):
        assert restore_plate_dims(other, torch.Size(batch), 1) is other


class _CalledTwice(PyroModule):
    """A wrapper whose one forward pass runs the lifted network twice."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x), self.net(x)


def test_a_network_called_twice_in_one_pass_reads_the_same_batched_weights_twice():
    # The vectorized forward writes each sample's slice into Pyro's cache of the pass, and
    # must put the batched draws back: a second call in the same pass reads them again.
    net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    with pyro.plate("particles", 3, dim=-2):
        first, second = poutine.trace(_CalledTwice(net)).get_trace(x).nodes["_RETURN"]["value"]
    assert first.shape == (3, 5, 2) and torch.equal(first, second)
    assert not torch.equal(first[0], first[1])  # three different draws
