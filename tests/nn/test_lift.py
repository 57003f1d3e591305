import copy
import math
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
import torchvision
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDelta
from pyro.nn import PyroModule, PyroSample
from torch import nn
from torch.func import functional_call, jacrev
from torch.testing import assert_close

from pyro_bdl import bayesianize, init_to_network, models, priors, sites
from pyro_bdl.guides import AutoMeanField, AutoSubnetLaplace
from pyro_bdl.nn import site_spec
from pyro_bdl.nn.lift import constant_buffers
from tests.common import TiedLinear


def _trace(net, x):
    tr = poutine.trace(net).get_trace(x)
    samples = {n: s for n, s in tr.nodes.items() if s["type"] == "sample"}
    params = {n for n, s in tr.nodes.items() if s["type"] == "param"}
    return samples, params


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 3),
    )


def test_mlp_every_parameter_becomes_a_site_with_its_shape_as_event_shape():
    net = _mlp()
    shapes = {n: p.shape for n, p in net.named_parameters()}
    bayesianize(net)
    samples, params = _trace(net, torch.randn(5, 4))
    assert set(samples) == set(shapes) == set(sites(net))
    for name, site in samples.items():
        assert site["fn"].event_shape == shapes[name]
        assert site["fn"].batch_shape == torch.Size()
        assert site["value"].shape == shapes[name]
    assert not params


def test_cnn_hides_batchnorm_by_default():
    net = bayesianize(_cnn())
    samples, params = _trace(net, torch.randn(2, 1, 8, 8))
    assert set(samples) == {"0.weight", "0.bias", "4.weight", "4.bias"}
    assert params == {"1.weight", "1.bias"}  # BatchNorm stays a point estimate


def test_resnet18_sites_and_predictive():
    net = torchvision.models.resnet18(num_classes=10)
    convs_and_linear = {
        f"{m}.weight" for m, mod in net.named_modules() if isinstance(mod, (nn.Conv2d, nn.Linear))
    }
    expected = {n: p.shape for n, p in net.named_parameters() if n in convs_and_linear}
    expected["fc.bias"] = net.fc.bias.shape
    bayesianize(net, priors.Normal(scale=1.0))
    net.eval()
    x = torch.randn(2, 3, 32, 32)
    samples, params = _trace(net, x)
    assert {n: s["fn"].event_shape for n, s in samples.items()} == expected
    assert all(".bn" in p or "downsample.1" in p or p.startswith("bn1") for p in params)
    model = models.classifier(net, dataset_size=100)
    guide = AutoDelta(model, init_loc_fn=init_to_network)
    guide(x, torch.tensor([1, 2]))  # autoguides set up on a call where "y" is observed
    out = Predictive(model, guide=guide, num_samples=2, return_sites=["y", "_RETURN"])(x)
    assert out["y"].shape == (2, 2)
    assert out["_RETURN"].shape == (2, 2, 10)


def test_site_names_are_stable_across_calls_and_idempotent():
    net = bayesianize(_mlp())
    first, _ = _trace(net, torch.randn(1, 4))
    second, _ = _trace(net, torch.randn(1, 4))
    assert list(first) == list(second)
    bayesianize(net)  # lifting again changes nothing
    assert list(_trace(net, torch.randn(1, 4))[0]) == list(first)


def test_initial_location_is_the_networks_own_weights():
    net = _mlp()
    w = net[0].weight.detach().clone()
    bayesianize(net)
    assert torch.equal(sites(net)["0.weight"].init_value, w)
    tr = poutine.trace(net).get_trace(torch.randn(1, 4))
    assert site_spec(tr.nodes["0.weight"]).name == "0.weight"
    assert torch.equal(init_to_network(tr.nodes["0.weight"]), w)


def test_hide_by_type_glob_and_predicate_and_expose_overrides():
    by_type = bayesianize(_mlp(), hide=[nn.Linear], expose=["2.bias"])
    assert set(sites(by_type)) == {"2.bias"}
    by_glob = bayesianize(_mlp(), hide=["*.bias"])
    assert set(sites(by_glob)) == {"0.weight", "2.weight"}
    by_pred = bayesianize(_mlp(), hide=[lambda m, name, p: p.dim() == 2])
    assert set(sites(by_pred)) == {"0.bias", "2.bias"}
    exposed_bn = bayesianize(_cnn(), expose=[nn.BatchNorm2d])
    assert {"1.weight", "1.bias"} <= set(sites(exposed_bn))


def test_last_matching_rule_wins():
    net = bayesianize(_mlp(), hide=["*", "0.*"], expose=["0.*", "0.bias"])
    assert set(sites(net)) == {"0.weight", "0.bias"}


def test_partly_pyro_module():
    class Net(PyroModule):
        def __init__(self):
            super().__init__()
            self.scale = PyroSample(dist.LogNormal(0.0, 1.0))
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x) * self.scale

    net = bayesianize(Net())
    samples, _ = _trace(net, torch.randn(4, 3))
    assert set(samples) == {"scale", "fc.weight", "fc.bias"}
    assert set(sites(net)) == {"fc.weight", "fc.bias"}


def test_prior_follows_device_and_dtype_moves():
    net = bayesianize(_mlp(), priors.Normal(0.0, 2.0))
    net.double()
    samples, _ = _trace(net, torch.randn(1, 4, dtype=torch.float64))
    assert samples["0.weight"]["value"].dtype == torch.float64
    assert samples["0.weight"]["fn"].base_dist.scale.dtype == torch.float64


def test_lifted_network_trains_with_svi():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    net = bayesianize(nn.Sequential(nn.Linear(4, 2)))
    model = models.classifier(net, dataset_size=64)
    guide = AutoDelta(model, init_loc_fn=init_to_network)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(100)]
    # Deterministic (AutoDelta draws nothing). The first loss is the initial network's NLL plus
    # its prior term, 55; a network that does not learn cannot go below chance, 64·ln 2 = 44
    # (0.8 of it), while the separable labels take the trained loss to 24 (0.44 of it; 0.24–0.44
    # over seeds 0–4).
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(hide=[int]), TypeError),
        (dict(expose=[3.5]), TypeError),
        (dict(prior=42), TypeError),
        (dict(prior=lambda m, n, p: dist.Normal(0.0, 1.0)), ValueError),
        # The weight's event shape, but a batch of 2 draws: every weight would get a dim more.
        (
            dict(
                prior=lambda m, n, p: dist.Normal(0.0, 1.0).expand((2, *p.shape)).to_event(p.dim())
            ),
            ValueError,
        ),
    ],
)
def test_bad_rules_and_priors_raise_before_changing_the_module(bad, error):
    net = _mlp()
    with pytest.raises(error):
        bayesianize(net, **bad)
    assert not isinstance(net, PyroModule)
    assert len(list(net.parameters())) == 4


@pytest.mark.parametrize(
    "prior, match",
    [
        (dist.Normal(0.0, 1.0), r"got the distribution Normal.*bdl\.priors\.Normal\(loc, scale\)"),
        (priors.Normal, r"got the class Normal\. Pass an instance: bdl\.priors\.Normal\(\)"),
    ],
    ids=["a Pyro distribution", "a prior class"],
)
def test_a_prior_that_is_callable_but_not_a_prior_names_the_fix(prior, match):
    # Both are callable, so they passed the check and failed at the first site with torch's
    # "takes from 1 to 2 positional arguments but 4 were given".
    net = _mlp()
    with pytest.raises(TypeError, match=match):
        bayesianize(net, prior=prior)
    assert not isinstance(net, PyroModule)


def test_non_module_and_unlifted_module_errors():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        bayesianize(lambda x: x)
    with pytest.raises(ValueError, match="bayesianize"):
        sites(nn.Linear(2, 2))


# -- tied weights ------------------------------------------------------------------------------


class _LanguageModel(nn.Module):
    """An embedding and an output head sharing one matrix."""

    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


def test_tied_embedding_and_head_are_one_site_read_by_both_layers():
    net = bayesianize(_LanguageModel())
    assert list(sites(net)) == ["emb.weight"]
    assert sites(net)["emb.weight"].aliases == ("head.weight",)
    assert sites(net)["emb.weight"].alias_layers == ((net.head, "weight"),)
    tokens = torch.tensor([1, 4, 2])
    tr = poutine.trace(net).get_trace(tokens)
    samples = [n for n, s in tr.nodes.items() if s["type"] == "sample"]
    params = [n for n, s in tr.nodes.items() if s["type"] == "param"]
    assert samples == ["emb.weight"] and not params
    w = tr.nodes["emb.weight"]["value"]
    assert torch.equal(tr.nodes["_RETURN"]["value"], torch.tanh(w[tokens]) @ w.T)


def test_one_layer_used_twice_is_one_site_named_by_its_first_path():
    def shared():
        lin = nn.Linear(3, 3)
        return bayesianize(nn.Sequential(lin, nn.ReLU(), lin))

    net = shared()
    assert list(sites(net)) == ["0.weight", "0.bias"]
    assert sites(net)["0.weight"].aliases == ("2.weight",)
    assert sites(net)["0.weight"].alias_layers == ()
    samples, params = _trace(net, torch.randn(2, 3))
    assert list(samples) == ["0.weight", "0.bias"] and not params

    class Outer(PyroModule):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    outer = Outer(shared())  # Pyro renames the tree; the first path still names the site
    samples, _ = _trace(outer, torch.randn(2, 3))
    assert list(samples) == ["inner.0.weight", "inner.0.bias"]


def test_tied_site_under_mean_field_svi_and_vectorized_particles():
    torch.manual_seed(0)
    pyro.clear_param_store()
    net = bayesianize(TiedLinear())
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = models.classifier(net, dataset_size=16)
    guide = AutoMeanField(model, init_scale=0.1)
    elbo = pyro.infer.Trace_ELBO(num_particles=3, vectorize_particles=True)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    assert math.isfinite(svi.step(x, y))
    assert guide.site_names == ["a.weight", "a.bias", "b.bias", "out.weight", "out.bias"]

    # K particles in one vectorized forward equal K plain forwards on the same draws.
    traces = [poutine.trace(guide).get_trace(x, y) for _ in range(3)]
    draws = [
        {n: s["value"].detach() for n, s in t.nodes.items() if s["type"] == "sample"}
        for t in traces
    ]
    plain = [poutine.condition(net, data=d)(x) for d in draws]

    def vectorized(x):
        with pyro.plate("particles", 3, dim=-2):
            return net(x)

    stacked = {k: torch.stack([d[k] for d in draws]).unsqueeze(1) for k in draws[0]}
    out = poutine.condition(vectorized, data=stacked)(x)
    # The same arithmetic batched under vmap: float32 round-off of a few small matmuls.
    assert_close(out, torch.stack(plain), rtol=1e-5, atol=1e-5)


def test_laplace_on_a_tied_embedding_head_matches_the_brute_force_ggn():
    torch.manual_seed(0)
    pyro.clear_param_store()
    net = bayesianize(_LanguageModel())
    tokens, y = torch.randint(0, 7, (10,)), torch.randint(0, 7, (10,))
    model = models.classifier(net, dataset_size=10)
    guide = AutoSubnetLaplace(model, subnetwork="all", prior_precision=1.0)
    guide(tokens, y)
    guide.fit((tokens, y))
    plain = _LanguageModel()

    def f(theta):
        w = guide.layout.unpack(theta)["emb.weight"]
        return functional_call(plain, {"emb.weight": w}, (tokens,), tie_weights=True)

    theta = guide.loc.detach()
    jac, p = jacrev(f)(theta), f(theta).softmax(-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("bcd,bce,bef->df", jac, lam, jac).to(guide.ggn.dtype)
    # float32 Jacobians of a 28-weight net: agreement to a few float32 ulps of the entries.
    assert_close(guide.ggn, ggn, rtol=1e-5, atol=1e-6)


def test_laplace_on_weights_tied_between_two_linear_layers_matches_the_brute_force_ggn():
    torch.manual_seed(0)
    pyro.clear_param_store()
    net = bayesianize(TiedLinear())
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    guide = AutoSubnetLaplace(models.classifier(net, 12), subnetwork="all", prior_precision=1.0)
    guide(x, y)
    guide.fit((x, y))
    plain = TiedLinear()

    def f(theta):
        return functional_call(plain, guide.layout.unpack(theta), (x,), tie_weights=True)

    theta = guide.loc.detach()
    jac, p = jacrev(f)(theta), f(theta).softmax(-1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("bcd,bce,bef->df", jac, lam, jac).to(guide.ggn.dtype)
    # The brute-force GGN is a float32 product of 12 rows' Jacobians (entries ≤ 3): its relative
    # round-off is ~12 roundings of ε = 1.2e-7 (3.5e-5 of the smallest entries, 3.9e-7 absolute,
    # measured); atol 1e-6 + rtol 1e-5 covers that, not a missing or doubled tied share (O(1)).
    assert_close(guide.ggn, ggn, rtol=1e-5, atol=1e-6)


def test_tied_lifted_network_survives_pickle_and_deepcopy():
    net = bayesianize(_LanguageModel())
    for clone in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        tr = poutine.trace(clone).get_trace(torch.tensor([0, 3]))
        assert [n for n, s in tr.nodes.items() if s["type"] == "sample"] == ["emb.weight"]
        assert sites(clone)["emb.weight"].alias_layers == ((clone.head, "weight"),)


# -- frozen parameters -------------------------------------------------------------------------


def test_frozen_parameters_stay_hidden_fixed_and_out_of_the_param_store():
    torch.manual_seed(0)
    pyro.clear_param_store()
    net = nn.Sequential(nn.Linear(4, 2))
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    bayesianize(net)
    assert list(sites(net)) == ["0.bias"]
    assert torch.equal(net.state_dict()["0.weight"], frozen)  # same key, same value
    samples, params = _trace(net, torch.randn(3, 4))
    assert list(samples) == ["0.bias"] and not params
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    model = models.classifier(net, dataset_size=32)
    guide = AutoDelta(model, init_loc_fn=init_to_network)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), pyro.infer.Trace_ELBO())
    for _ in range(5):
        svi.step(x, y)
    assert torch.equal(net[0].weight, frozen) and not net[0].weight.requires_grad
    assert "0.weight" not in pyro.get_param_store()


def test_frozen_parameter_exposed_explicitly_becomes_random():
    net = _mlp()
    net[0].weight.requires_grad_(False)
    bayesianize(net, expose=["0.weight"])
    spec = sites(net)["0.weight"]
    assert not spec.trainable and sites(net)["0.bias"].trainable
    samples, _ = _trace(net, torch.randn(1, 4))
    assert "0.weight" in samples


# -- a second call -----------------------------------------------------------------------------


def test_relift_applies_the_new_prior_and_keeps_the_initial_locations():
    net = bayesianize(_mlp(), priors.Normal(scale=1.0))
    inits = {n: s.init_value.clone() for n, s in sites(net).items()}
    specs = dict(sites(net))
    bayesianize(net, priors.Normal(scale=0.1), relift=True)
    assert all(sites(net)[n] is specs[n] for n in specs)
    samples, _ = _trace(net, torch.randn(1, 4))
    assert float(samples["0.weight"]["fn"].base_dist.scale.max()) == pytest.approx(0.1)
    assert all(torch.equal(sites(net)[n].init_value, inits[n]) for n in inits)


def test_relift_with_rules_hides_sites_and_exposes_frozen_parameters():
    net = _mlp()
    net[2].bias.requires_grad_(False)
    bayesianize(net)
    init = sites(net)["0.bias"].init_value.clone()
    bayesianize(net, hide=["0.bias"], expose=["2.bias"], relift=True)
    assert set(sites(net)) == {"0.weight", "0.bias", "2.weight", "2.bias"} - {"0.bias"}
    assert isinstance(net[0].bias, nn.Parameter) and torch.equal(net[0].bias, init)
    assert not sites(net)["2.bias"].trainable
    samples, params = _trace(net, torch.randn(1, 4))
    assert set(samples) == {"0.weight", "2.weight", "2.bias"} and params == {"0.bias"}


def test_a_frozen_parameter_exposed_by_a_relift_is_an_ordinary_site_for_later_calls():
    # Once lifted, the parameter is no longer a hidden frozen buffer: a later call with the same
    # rules changes nothing, and moving the network reads no frozen copy of it.
    net = _mlp()
    net[2].bias.requires_grad_(False)
    bayesianize(net)
    bayesianize(net, expose=["2.bias"], relift=True)
    bayesianize(net, expose=["2.bias"])
    assert set(sites(net)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    net.double()
    samples, _ = _trace(net, torch.randn(1, 4, dtype=torch.float64))
    assert samples["2.bias"]["value"].dtype == torch.float64


def test_relift_of_a_tied_site_restores_one_shared_parameter():
    net = bayesianize(_LanguageModel())
    bayesianize(net, hide=["*"], relift=True)
    assert not sites(net)
    assert net.head.weight is net.emb.weight and isinstance(net.emb.weight, nn.Parameter)
    samples, params = _trace(net, torch.tensor([1]))
    assert not samples and params == {"emb.weight", "head.weight"}


def test_a_callable_prior_with_a_learned_scale_is_rebuilt_every_pass_and_learns():
    # A cached distribution would hold the first step's graph to pyro.param("prior_scale"), and
    # the second backward would run through freed buffers; the library's priors stay cached.
    from pyro.distributions import constraints

    from pyro_bdl.infer import TraceSuffStat_ELBO

    def learned(module, name, param):
        scale = pyro.param("prior_scale", torch.tensor(1.0), constraint=constraints.positive)
        return dist.Normal(0.0, scale).expand(param.shape).to_event(param.dim())

    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))
    for elbo in (pyro.infer.Trace_ELBO(), TraceSuffStat_ELBO()):
        pyro.clear_param_store()
        net = bayesianize(nn.Linear(3, 2), prior=learned)
        model = models.classifier(net, 10)
        svi = pyro.infer.SVI(model, AutoMeanField(model), pyro.optim.Adam({"lr": 0.1}), elbo)
        for _ in range(3):
            svi.step(x, y)
        # Adam moves an unconstrained parameter by about lr per step from the first on, and the
        # KL's gradient in σ, 1/σ − Σ(μ² + s²)/σ³ per weight, keeps one sign while the weights
        # are < 1: log σ moves by ~0.3, |σ − 1| ≈ 0.26, and a σ that gets no gradient stays at 1.
        assert abs(pyro.param("prior_scale").item() - 1.0) > 0.1
        assert all(not spec._cache for spec in sites(net).values())
        spec = next(iter(sites(net).values()))
        assert spec(net) is not spec(net)
    fixed = bayesianize(nn.Linear(3, 2), prior=priors.Normal(scale=1.0))
    spec = next(iter(sites(fixed).values()))
    assert spec(fixed) is spec(fixed)  # the library's priors: built once


def test_a_call_on_a_layer_of_a_lifted_network_is_refused_before_anything_changes():
    # The sites live in the whole network's registry: a call on one of its layers would not see
    # them, and a new prior would be dropped silently.
    net = bayesianize(_mlp(), priors.Normal(scale=1.0))
    prior = sites(net)["0.weight"].prior
    with pytest.raises(ValueError, match=r"'0\.weight'.*bayesianize\(net, .*relift=True"):
        bayesianize(net[0], priors.Normal(scale=0.01))
    assert sites(net)["0.weight"].prior is prior and "_bdl_sites" not in net[0].__dict__
    tied = bayesianize(_LanguageModel())
    with pytest.raises(ValueError, match=r"'emb\.weight'"):
        bayesianize(tied.head)  # an alias layer of the tied site
    bayesianize(net, priors.Normal(scale=0.01), relift=True)  # the way out
    assert sites(net)["0.weight"].prior.scale == 0.01


def test_frozen_parameters_are_read_from_the_layers_after_the_network_moves():
    # .double() / .to(device) replace every buffer: a record of the old tensors would relift a
    # float32 copy and let a rollback copy the moved frozen weights.
    net = _mlp()
    net[0].weight.requires_grad_(False)
    bayesianize(net).double()
    assert any(t is net[0]._buffers["weight"] for t in constant_buffers(net))
    bayesianize(net, expose=["0.weight"], relift=True)
    assert sites(net)["0.weight"].init_value.dtype == torch.float64


def test_a_tied_frozen_weight_stays_one_tensor_when_the_network_moves():
    # Module._apply replaces buffers layer by layer: each layer would get a copy of its own.
    net = _LanguageModel()
    net.emb.weight.requires_grad_(False)
    bayesianize(net)
    for moved in (net.double(), copy.deepcopy(net).float(), pickle.loads(pickle.dumps(net)).half()):
        assert moved.head._buffers["weight"] is moved.emb._buffers["weight"]
    assert net.emb._buffers["weight"].dtype == torch.float64


@pytest.mark.skipif(not hasattr(nn, "RMSNorm"), reason="nn.RMSNorm needs torch >= 2.4")
def test_rms_norm_is_hidden_by_default_like_the_other_normalisation_layers():
    net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.RMSNorm(4), nn.LayerNorm(4)))
    assert list(sites(net)) == ["0.weight", "0.bias"]
