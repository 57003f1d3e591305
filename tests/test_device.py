"""Device discipline: a batch on another device than the network is refused, naming both devices
and the fix, before anything changes; every method's state follows ``.to(device)``. No GPU is
needed: the ``meta`` device stands in for "another device"."""

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from torch import nn

from pyro_bdl import bayesianize, infer, models
from pyro_bdl.guides import AutoLaplace, AutoMeanField, AutoRadial
from tests.guides import test_contract as contract
from tests.guides import test_ensemble


class _TwoInputs(nn.Module):
    """A network taking two tensors (a structured batch: a dict or a tuple)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, first, second):
        return self.norm(self.a(first) + self.b(second))


def _snapshot(net: nn.Module) -> dict:
    store = pyro.get_param_store()
    return {
        "params": {k: v.detach().clone() for k, v in store.items()},
        "rng": torch.get_rng_state(),
        "buffers": {k: b.clone() for k, b in net.named_buffers()},
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for k, v in before["params"].items():
        assert torch.equal(v, after["params"][k]), k
    assert torch.equal(before["rng"], after["rng"])
    assert before["buffers"].keys() == after["buffers"].keys()
    for k, b in before["buffers"].items():
        assert torch.equal(b, after["buffers"][k]), k


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "later-call"])
@pytest.mark.parametrize(
    "structure, expect",
    [
        ("tensor", r"x is on device meta but the network is on cpu.*x\.to\('cpu'\)"),
        ("dict", r"x\['first'\] is on device meta .* on cpu.*v\.to\('cpu'\) for k, v in x"),
        ("tuple", r"x\[1\] is on device meta .* on cpu.*t\.to\('cpu'\) for t in x"),
    ],
)
def test_batch_on_another_device_is_refused_before_anything_changes(structure, expect, warm):
    if structure == "tensor":
        net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        x = torch.randn(8, 3)
        moved = _meta(x)
    else:
        net = bayesianize(_TwoInputs())
        first, second = torch.randn(8, 3), torch.randn(8, 2)
        if structure == "dict":
            x = {"first": first, "second": second}
            moved = {"first": _meta(first), "second": second}
        else:
            x = (first, second)
            moved = (first, _meta(second))
    model = models.classifier(net, dataset_size=100)
    y = torch.randint(0, 4, (8,))
    if warm:  # after a first call: the param store and running statistics hold values
        model(x, y)
    before = _snapshot(net)
    with pytest.raises(ValueError, match=expect):
        model(moved, y)
    _assert_same(before, _snapshot(net))


def test_labels_on_another_device_are_refused():
    model = models.classifier(bayesianize(nn.Linear(3, 4)), dataset_size=100)
    x, y = torch.randn(8, 3), torch.randint(0, 4, (8,), device="meta")
    before = _snapshot(model.net)
    with pytest.raises(ValueError, match=r"y is on device meta .* on cpu.*y\.to\('cpu'\)"):
        model(x, y)
    _assert_same(before, _snapshot(model.net))


def test_the_check_follows_the_network_moved_after_the_model_was_built():
    net = bayesianize(nn.Linear(3, 1))
    model = models.regressor(net, dataset_size=100, noise_scale=0.5)
    net.to("meta")
    with pytest.raises(ValueError, match=r"x is on device cpu but the network is on meta"):
        model(torch.randn(8, 3), torch.randn(8))


def test_a_network_that_moves_its_inputs_itself_opts_out_with_check_inputs():
    model = models.regressor(bayesianize(nn.Linear(3, 1)), dataset_size=100, noise_scale=0.5)
    model.check_inputs = False
    # Unchecked, the batch reaches the first read of its values, which a meta tensor refuses.
    with pytest.raises(RuntimeError, match=r"cannot be called on meta tensors"):
        model(torch.randn(8, 3, device="meta"), torch.randn(8))


# --------------------------------------------------------------- every method's state follows .to()


def _state_tensors(obj, skip: set[int], path: str = "guide", out=None) -> dict[str, torch.Tensor]:
    """Every tensor an object holds (attributes, containers, submodules), by path; objects in
    ``skip`` (the user's model and network, which the user moves) are not entered."""
    out = {} if out is None else out
    if id(obj) in skip:
        return out
    skip.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            # Not repr(k) for any key: a key holding a layer (VOGN's gradient buffers are keyed
            # by (layer, name)) would print the layer, whose lifted weights cannot be read on meta.
            key = repr(k) if isinstance(k, (str, int)) else type(k).__name__
            _state_tensors(v, skip, f"{path}[{key}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _state_tensors(v, skip, f"{path}[{i}]", out)
    elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("pyro_bdl"):
        for k, v in vars(obj).items():
            _state_tensors(v, skip, f"{path}.{k}", out)
    return out


def _assert_all_moved(guide, model, device="meta") -> None:
    skip = {id(model), *(id(m) for m in model.net.modules())}
    found = _state_tensors(guide, skip)
    prefix = getattr(guide, "_pyro_name", None)
    store = pyro.get_param_store()
    found.update({f"param store {k!r}": v for k, v in store.items() if k.startswith(f"{prefix}.")})
    assert found, "the scan found no state"
    stray = sorted(k for k, v in found.items() if v.device.type != device)
    assert not stray, f"left behind on the old device: {stray}"


def _fit_locscale(cls):
    model = contract.small_model()
    guide = cls(model, init_scale=0.05)
    contract.svi_fit(model, guide)(*contract.data())
    return model, guide


def _fit_case(make):
    """A guide of the contract registry (``make() -> Case``), trained briefly."""
    case = make()
    case.fit(*contract.data())
    return case.model, case.guide


def _fit_laplace(structure: str = "kron"):
    model = contract.small_model()
    guide = AutoLaplace(model, hessian_structure=structure)
    x, y = contract.data()
    SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO()).step(x, y)
    guide.fit((x, y), check_mode=False)  # one step is no MAP estimate; devices are the point
    return model, guide


def _loaded_laplace(structure: str):
    """A fresh guide holding a fitted one's state, its posterior not yet rebuilt from it."""
    model, fitted = _fit_laplace(structure)
    return model, _load(AutoLaplace(model, hessian_structure=structure), fitted.state_dict())


def _load(guide, state):
    guide(*contract.data())  # set up on the model, as loading needs
    guide.load_state_dict(state)
    return guide


def _set_up_ensemble():
    model, guide = test_ensemble.make_ensemble()
    guide(*contract.data())  # the members move from their values into the buffer
    return model, guide


def _moved_guides():
    return [
        pytest.param(lambda: _fit_locscale(AutoMeanField), id="meanfield"),
        pytest.param(lambda: _fit_locscale(AutoRadial), id="radial"),
        pytest.param(lambda: _fit_case(contract.make_swag), id="swag"),
        pytest.param(lambda: _fit_case(contract.make_vogn), id="natural-gradient-guide"),
        pytest.param(test_ensemble.make_ensemble, id="ensemble"),
        pytest.param(_set_up_ensemble, id="ensemble-set-up"),
        pytest.param(_fit_laplace, id="laplace"),
        pytest.param(lambda: _fit_laplace("diag"), id="laplace-diag"),
        pytest.param(lambda: _fit_laplace("full"), id="laplace-full"),
        pytest.param(lambda: _loaded_laplace("kron"), id="laplace-loaded"),
        pytest.param(lambda: _loaded_laplace("diag"), id="laplace-diag-loaded"),
    ]


@pytest.mark.parametrize("fit", _moved_guides())
def test_every_state_tensor_of_a_guide_follows_to_device(fit):
    model, guide = fit()
    guide.to("meta")
    _assert_all_moved(guide, model)


@pytest.mark.parametrize("fit", _moved_guides()[:2])
def test_a_moved_loc_scale_guide_trains_the_moved_parameters(fit):
    # The param store is what SVI's optimizer updates: after .to(float64) a step must change the
    # guide's own (converted) parameters, in float64.
    model, guide = fit()
    model.net.double()
    guide.to(torch.float64)
    x, y = contract.data()
    before = guide.loc.detach().clone()
    SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), TraceMeanField_ELBO()).step(x.double(), y)
    assert guide.loc.dtype == torch.float64
    assert not torch.equal(guide.loc.detach(), before)
    _assert_all_moved(guide, model, device="cpu")


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_a_converted_laplace_posterior_keeps_its_values_and_round_trips(structure):
    # .double() converts the posterior beside the buffers, whether fitted or loaded and not yet
    # rebuilt, and a state saved afterwards holds the same posterior.
    model, fitted = _fit_laplace(structure)
    expected = fitted.posterior.variances()
    assert expected.dtype == torch.float64  # the fit accumulates in float64
    guide = _load(AutoLaplace(model, hessian_structure=structure), fitted.state_dict()).double()
    again = _load(AutoLaplace(model, hessian_structure=structure), guide.state_dict())
    fitted.double()
    for each in (fitted, guide, again):
        assert each.map_loc.dtype == torch.float64
        # float64 all the way: the values are copied, never rounded.
        assert torch.equal(each.posterior.variances(), expected)


def test_ensemble_members_given_as_values_follow_to_before_set_up():
    model, guide = test_ensemble.make_ensemble()
    model.net.double()
    guide.double()
    x, y = contract.data()
    guide(x.double(), y)
    assert guide.ensemble_locs.dtype == torch.float64


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_vogn_and_ivon_state_follows_to_device(method):
    model = contract.small_model()
    runner = getattr(infer, method)(model, dataset_size=contract.N, lr=1e-2)
    x, y = contract.data()
    runner.step(x[: contract.BATCH], y[: contract.BATCH])
    runner.to("meta")
    _assert_all_moved(runner, model)


@pytest.mark.parametrize("method", ["VOGN", "IVON"])
def test_vogn_and_ivon_refuse_a_half_precision_state_and_train_on_after_to_float64(method):
    model = contract.small_model()
    runner = getattr(infer, method)(model, dataset_size=contract.N, lr=1e-2)
    x, y = contract.data()
    x, y = x[: contract.BATCH], y[: contract.BATCH]
    runner.step(x, y)
    before = {k: v.clone() for k, v in runner.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match=r"float32 or torch.float64.*got torch.bfloat16.*autocast"):
        runner.to(torch.bfloat16)
    after = runner.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # nothing moved
    runner.to(torch.float64)
    assert runner.guide.loc is runner.state.mean  # the guide serves the moved state
    moved = [runner.state.mean, runner.state.curvature, runner.guide.scale, *runner.state.hidden]
    assert all(t.dtype == torch.float64 for t in moved)
    assert all(p.dtype == torch.float64 for p in model.net.parameters())
    loc = runner.guide.loc.clone()
    assert torch.equal(loc, before["mean"].double())  # converted, not changed
    runner.step(x.double(), y)
    assert runner.guide.loc.dtype == torch.float64 and not torch.equal(runner.guide.loc, loc)
    assert runner.step_count == 2
