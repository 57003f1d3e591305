"""Fault injection against ``bayesianize`` (issue class 5, silent changes of meaning): every
refusal names the problem and the fix and leaves the network exactly as it was."""

import random

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.nn import PyroModule
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.curvature import substitute
from pyro_bdl.nn.tied import TiedWeightsError
from tests.common import TiedLinear


def snapshot(*objects):
    """Everything a refusal must leave alone: for each module its class, state_dict (keys and
    values), the parameters and PyroSamples of every layer and the site registry; the RNG
    states of torch, random and numpy."""
    out = []
    for obj in objects:
        layers = {
            name: (
                type(sub),
                {
                    k: (id(p), p if p is None else p.detach().clone())
                    for k, p in sub._parameters.items()
                },
                tuple(sub.__dict__.get("_pyro_samples", {})),
                tuple(sub._buffers),
            )
            for name, sub in obj.named_modules(remove_duplicate=False)
        }
        registry = {
            n: (id(s), s.prior, s.aliases) for n, s in obj.__dict__.get("_bdl_sites", {}).items()
        }
        state = {k: v.detach().clone() for k, v in obj.state_dict().items()}
        out.append((layers, registry, state))
    out.append((torch.get_rng_state(), random.getstate(), np.random.get_state()))  # noqa: NPY002 (the global state is what must not move)
    return out


def assert_unchanged(before, after):
    assert len(before) == len(after)
    for (lb, rb, sb), (la, ra, sa) in zip(before[:-1], after[:-1]):
        assert rb == ra
        assert list(sb) == list(sa)
        assert all(torch.equal(sb[k], sa[k]) for k in sb)
        assert list(lb) == list(la)
        for name in lb:
            tb, pb, samples_b, buffers_b = lb[name]
            ta, pa, samples_a, buffers_a = la[name]
            assert (tb, samples_b, buffers_b) == (ta, samples_a, buffers_a), name
            assert list(pb) == list(pa), name
            for k in pb:
                assert pb[k][0] == pa[k][0], (name, k)
                assert (pb[k][1] is None and pa[k][1] is None) or torch.equal(pb[k][1], pa[k][1])
    rng_b, rng_a = before[-1], after[-1]
    assert torch.equal(rng_b[0], rng_a[0]) and rng_b[1] == rng_a[1]
    assert all(np.array_equal(a, b) for a, b in zip(rng_b[2][1:2], rng_a[2][1:2]))


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _refused(net, error, match, **kwargs):
    before = snapshot(net)
    with pytest.raises(error, match=match):
        bdl.bayesianize(net, **kwargs)
    assert_unchanged(before, snapshot(net))


# -- tied weights ----------------------------------------------------------------------------


def test_tied_weight_with_conflicting_rules_is_refused():
    _refused(
        TiedLinear(),
        ValueError,
        r"parameter 'a\.weight' is tied .*'b\.weight'.*expose \['b\.weight'\] and hide "
        r"\['a\.weight'\].*make the rules agree",
        hide=["a.*"],
    )


def test_lifting_the_rest_of_a_network_tied_to_an_earlier_partial_lift_is_refused():
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    net = LM()
    bdl.bayesianize(net.head)
    _refused(
        net,
        ValueError,
        r"'emb\.weight' is the tensor that an earlier bayesianize call lifted as site 'weight' "
        r"of PyroLinear; this call would untie them.*in one bayesianize call",
    )


def test_vogn_refuses_tied_weights_and_leaves_the_network_alone():
    torch.manual_seed(0)
    net = bdl.bayesianize(TiedLinear())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    vogn = bdl.infer.VOGN(bdl.models.classifier(net, 8), dataset_size=8)
    before = snapshot(net)
    with pytest.raises(TiedWeightsError, match=r"'a\.weight' is tied: layer 'b\.weight'.*VOGN"):
        vogn.step(x, y)
    after = snapshot(net)
    assert_unchanged([*before[:-1], after[-1]], after)  # VOGN draws noise: RNG not compared


def test_substitute_on_the_owner_only_refuses_to_read_the_alias():
    net, x = bdl.bayesianize(TiedLinear()), torch.randn(2, 4)
    before = snapshot(net)
    with pytest.raises(TiedWeightsError, match=r"'a\.weight' is tied.*untie them"):
        # a.bias too: layer b's weight is then the first value the forward would draw.
        with substitute(net, {"a.weight": torch.zeros(4, 4), "a.bias": torch.zeros(4)}):
            net(x)
    assert_unchanged(before, snapshot(net))


# -- dtype and device --------------------------------------------------------------------------


def test_exposing_an_integer_parameter_is_refused():
    net = _mlp()
    net[0].register_parameter("steps", nn.Parameter(torch.zeros(3, dtype=torch.long), False))
    _refused(net, TypeError, r"'0\.steps' has dtype torch\.int64.*expose=", expose=["0.steps"])


def test_frozen_bool_parameter_stays_hidden_without_a_warning():
    net = _mlp()
    net[0].register_parameter("mask", nn.Parameter(torch.ones(3, dtype=torch.bool), False))
    bdl.bayesianize(net)
    assert "0.mask" not in bdl.sites(net)
    assert net[0].mask.dtype == torch.bool


@pytest.mark.parametrize(
    "prior, match",
    [
        (
            lambda m, n, p: dist.Normal(torch.zeros(p.shape, dtype=torch.float64), 1.0).to_event(
                p.dim()
            ),
            r"'0\.weight' returned a distribution on torch\.float64 / cpu, but the parameter is "
            r"torch\.float32 / cpu",
        ),
        (
            lambda m, n, p: dist.Normal(
                torch.zeros(p.shape, device="meta"),
                torch.ones(p.shape, device="meta"),
                validate_args=False,
            ).to_event(p.dim()),
            r"'0\.weight' returned a distribution on torch\.float32 / meta",
        ),
    ],
    ids=["dtype", "device"],
)
def test_prior_on_another_dtype_or_device_is_refused(prior, match):
    _refused(_mlp(), ValueError, match, prior=prior)


def test_init_loc_of_the_wrong_shape_is_refused():
    class BadInit(bdl.priors.Normal):
        def init_loc(self, module, name, param):
            return torch.zeros(2)

    _refused(
        _mlp(), ValueError, r"init_loc for site '0\.weight' must return .*\(8, 4\)", prior=BadInit()
    )


# -- second call -------------------------------------------------------------------------------


def _lifted():
    return bdl.bayesianize(_mlp(), bdl.priors.Normal(scale=1.0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(prior=bdl.priors.Normal(scale=0.1)),
            r"give the lifted sites \['0\.weight', '0\.bias', '2\.weight', '2\.bias'\] a "
            r"different prior.*relift=True",
        ),
        (dict(prior=bdl.priors.Laplace(scale=1.0)), r"different prior.*relift=True"),
        (
            dict(prior=bdl.priors.Normal(scale=1.0), hide=["*.bias"]),
            r"make the lifted sites \['0\.bias', '2\.bias'\] deterministic.*relift=True",
        ),
    ],
    ids=["other-scale", "other-family", "hides-sites"],
)
def test_second_call_that_would_change_the_sites_is_refused(kwargs, match):
    _refused(_lifted(), ValueError, match, **kwargs)


@pytest.mark.parametrize("init", ["module", "sample"])
def test_second_call_exposing_a_frozen_parameter_is_refused(init):
    net = _mlp()
    net[0].bias.requires_grad_(False)
    bdl.bayesianize(net, bdl.priors.Normal(init=init))
    # init="sample" would draw the new site's initial location: the refusal comes first, so the
    # RNG (compared by _refused) has not moved.
    _refused(
        net,
        ValueError,
        r"lift the parameters \['0\.bias'\].*relift=True",
        prior=bdl.priors.Normal(init=init),
        expose=["0.bias"],
    )


def test_lifting_the_whole_after_a_part_with_another_prior_is_refused():
    net = _mlp()
    bdl.bayesianize(net[0], bdl.priors.Normal(scale=0.5))
    _refused(net, ValueError, r"give the lifted sites \['0\.weight', '0\.bias'\] a different prior")


def test_second_call_with_a_new_callable_prior_is_refused():
    net = bdl.bayesianize(
        _mlp(), lambda m, n, p: dist.Normal(0.0, 1.0).expand(p.shape).to_event(p.dim())
    )
    _refused(net, ValueError, "different prior", prior=lambda m, n, p: None)


# -- rules that match nothing --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hide=["fc.*"]), r"hide glob 'fc\.\*' matches no parameter; the names look like "),
        (dict(expose=["*.wieght"]), r"expose glob '\*\.wieght' matches no parameter"),
    ],
    ids=["hide", "expose"],
)
def test_glob_matching_nothing_warns_with_the_names(kwargs, match):
    net = _mlp()
    with pytest.warns(UserWarning, match=match):
        bdl.bayesianize(net, **kwargs)
    assert set(bdl.sites(net)) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_identical_second_call_is_harmless_and_does_not_warn(recwarn):
    net = bdl.bayesianize(_mlp(), hide=["*.bias"])
    before = snapshot(net)
    bdl.bayesianize(net, hide=["*.bias"])
    assert_unchanged(before, snapshot(net))
    assert not [w for w in recwarn if "glob" in str(w.message)]
    assert isinstance(net, PyroModule)
    pyro.clear_param_store()


# -- frozen parameters -----------------------------------------------------------------------


def test_frozen_parameter_is_neither_random_nor_trained():
    torch.manual_seed(0)
    pyro.clear_param_store()
    net = _mlp()
    net[2].weight.requires_grad_(False)
    frozen = net[2].weight.detach().clone()
    bdl.bayesianize(net)
    assert "2.weight" not in bdl.sites(net)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    model = bdl.models.classifier(net, 16)
    guide = bdl.guides.AutoMeanField(model)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), pyro.infer.Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
    assert torch.equal(net.state_dict()["2.weight"], frozen)
    assert not any(name.endswith("2.weight") for name in pyro.get_param_store())
