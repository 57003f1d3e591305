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

from pyro_bdl import bayesianize, init_to_network, models, priors, sites
from pyro_bdl.nn import site_spec


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
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(hide=[int]), TypeError),
        (dict(expose=[3.5]), TypeError),
        (dict(prior=42), TypeError),
        (dict(prior=lambda m, n, p: dist.Normal(0.0, 1.0)), ValueError),
    ],
)
def test_bad_rules_and_priors_raise_before_changing_the_module(bad, error):
    net = _mlp()
    with pytest.raises(error):
        bayesianize(net, **bad)
    assert not isinstance(net, PyroModule)
    assert len(list(net.parameters())) == 4


def test_non_module_and_unlifted_module_errors():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        bayesianize(lambda x: x)
    with pytest.raises(ValueError, match="bayesianize"):
        sites(nn.Linear(2, 2))
