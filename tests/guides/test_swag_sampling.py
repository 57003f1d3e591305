"""AutoSWAG's sampling path: no value read back to the host (a CPU proxy, and on a GPU the sync
debug mode and the profiler), the optional σ cache, and the streamlined guide call against Pyro's
generic one."""

from __future__ import annotations

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from torch.utils._python_dispatch import TorchDispatchMode

from pyro_bdl.guides import AutoSWAG
from tests.common import assert_close
from tests.guides.test_swag import F64, feed, trained_guide, vector_model


class HostReads(TorchDispatchMode):
    """Counts operators that read a tensor's value back to the host: ``_local_scalar_dense``
    (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``) and ``_to_copy`` (``.to(device)``). On a
    GPU each is a device→host copy and a synchronisation; counting them works on the CPU too."""

    READS = {"_local_scalar_dense", "_to_copy"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def no_host_reads(fn, monkeypatch) -> None:
    """Run ``fn`` and fail if it reads a tensor back to the host: dispatch-level reads are
    counted, and the methods that skip the dispatcher for CPU tensors are made to raise."""
    with monkeypatch.context() as patch:
        for method in ("cpu", "tolist", "numpy"):

            def refuse(*args, _method=method, **kwargs):
                raise AssertionError(f"Tensor.{_method}() called while sampling")

            patch.setattr(torch.Tensor, method, refuse)
        with HostReads() as reads:
            fn()
    assert reads.seen == [], reads.seen


def test_host_read_proxy_catches_a_read(monkeypatch):
    # The proxy is not vacuous: .item(), bool() and .tolist() are caught.
    for read in (lambda t: t.item(), lambda t: bool(t.sum() > 0), lambda t: t.tolist()):
        with pytest.raises(AssertionError):
            no_host_reads(lambda read=read: read(torch.ones(1)), monkeypatch)


@pytest.mark.parametrize("cache_std, diag_only", [(False, False), (True, False), (False, True)])
def test_sampling_reads_nothing_back_to_the_host(cache_std, diag_only, monkeypatch):
    _, _, guide, x, y = trained_guide(rank=3, diag_only=diag_only, collections=4)
    guide.cache_std = cache_std
    guide.sample_weights()  # fills the σ cache, which may (once per collection) compute

    def sample():
        guide.get_posterior().sample()
        guide.get_posterior().sample((3,))
        guide.sample_weights()
        with torch.no_grad(), guide.sampling():
            guide(x, y)

    # Pyro's validation is on (conftest), as it is by default for users.
    no_host_reads(sample, monkeypatch)


def test_cached_std_gives_the_same_samples_and_follows_the_statistics():
    d = 30
    iterates = torch.randn(12, d, dtype=F64)
    plain = AutoSWAG(vector_model(d), rank=4)
    cached = AutoSWAG(vector_model(d), rank=4, cache_std=True)

    def same_draws(a, b, seed):
        pyro.set_rng_seed(seed)
        x = a.get_posterior().sample()
        pyro.set_rng_seed(seed)
        return torch.equal(x, b.get_posterior().sample())

    for guide in (plain, cached):
        guide()
        feed(guide, iterates[:6])
    assert same_draws(plain, cached, 1) and same_draws(plain, cached, 2)
    # A collection changes Σ_diag: a stale cache would keep drawing with the old σ.
    for guide in (plain, cached):
        feed(guide, iterates[6:7])
    assert same_draws(plain, cached, 3)
    # So does loading another state (in-place copies into the buffers).
    feed(plain, iterates[7:])
    cached.load_state_dict(plain.state_dict())
    assert same_draws(plain, cached, 4)
    # The cache is not state: the state_dict holds exactly the (rank + 2)·D statistics.
    state = cached.state_dict()
    assert set(state) == set(plain.state_dict())
    assert sum(v.numel() for k, v in state.items() if k.startswith("swag_")) == (4 + 2) * d + 1


def test_cache_is_dropped_when_switched_off_and_inference_mode_buffers_work():
    d = 8
    guide = AutoSWAG(vector_model(d), rank=3, cache_std=True)
    guide()
    feed(guide, torch.randn(4, d, dtype=F64))
    guide.get_posterior().sample()
    assert guide._std is not None and guide._std[1].shape == (d,)
    guide.cache_std = False
    guide.get_posterior().sample()
    assert guide._std is None  # the D numbers are given back
    # A guide set up under inference_mode makes ordinary buffers (a set-up ignores the grad
    # mode), whose σ is cached as any other's.
    with torch.inference_mode():
        fresh = AutoSWAG(vector_model(d), rank=3, cache_std=True)
        fresh()
        feed(fresh, torch.randn(4, d, dtype=F64))
    assert not any(b.is_inference() for b in fresh.buffers())
    assert torch.isfinite(fresh.get_posterior().sample()).all() and fresh._std is not None
    # Buffers remade under inference_mode (a conversion there) keep no version counter: the σ
    # is then not cached.
    fresh = AutoSWAG(vector_model(d), rank=3, cache_std=True)
    fresh()
    with torch.inference_mode():
        fresh._apply(torch.clone)
        feed(fresh, torch.randn(4, d, dtype=F64))
    assert all(b.is_inference() for b in fresh.buffers())
    assert torch.isfinite(fresh.get_posterior().sample()).all() and fresh._std is None


def test_forward_matches_pyro_autocontinuous_forward():
    """The streamlined forward against Pyro's generic one on a model with a real site, a positive
    site (an exp transform with its log-Jacobian) and a site inside a plate."""
    from pyro.infer.autoguide import AutoContinuous

    def model():
        pyro.sample("w", dist.Normal(torch.zeros(2, 3, dtype=F64), 1.0).to_event(2))
        pyro.sample("s", dist.LogNormal(torch.zeros(4, dtype=F64), 1.0).to_event(1))
        with pyro.plate("p", 5):
            pyro.sample("u", dist.Normal(torch.zeros((), dtype=F64), 1.0))

    guide = AutoSWAG(model, rank=3)
    guide()
    feed(guide, torch.randn(5, guide.latent_dim, dtype=F64))
    for mode in ("point", "swag"):
        guide.mode = mode
        pyro.set_rng_seed(0)
        ours = poutine.trace(guide).get_trace()
        pyro.set_rng_seed(0)
        pyros = poutine.trace(lambda: AutoContinuous.forward(guide)).get_trace()
        ours.compute_log_prob()
        pyros.compute_log_prob()
        for name in ("w", "s", "u"):
            assert torch.equal(ours.nodes[name]["value"], pyros.nodes[name]["value"]), name
            assert_close(ours.nodes[name]["log_prob"], pyros.nodes[name]["log_prob"], rtol=1e-12)
            assert [f.name for f in ours.nodes[name]["cond_indep_stack"]] == (
                ["p"] if name == "u" else []
            )
        assert (ours.nodes["s"]["value"] > 0).all()
        assert ours.nodes["s"]["log_prob"].abs().sum() > 0  # the Jacobian term is there
        latent = f"_{guide._pyro_name}_latent"
        assert_close(ours.nodes[latent]["log_prob"], pyros.nodes[latent]["log_prob"], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_std", [False, True])
def test_sampling_stays_on_the_gpu_without_host_device_copies(cache_std):
    from torch.profiler import ProfilerActivity, profile

    d = 1000
    guide = AutoSWAG(vector_model(d, torch.float32, "cuda"), rank=5, cache_std=cache_std)
    guide()
    feed(guide, torch.randn(6, d, device="cuda"))
    assert guide.swag_mean.device.type == "cuda" and guide.swag_deviations.device.type == "cuda"
    assert guide.marginal_variances()["theta"].device.type == "cuda"
    guide.sample_weights()  # warm-up: CUDA context, generator, the σ cache

    def sample():
        assert guide.get_posterior().sample((2,)).device.type == "cuda"
        assert guide.sample_weights()["theta"].device.type == "cuda"
        with torch.no_grad(), guide.sampling():
            guide()

    torch.cuda.synchronize()
    # "error": any synchronising CUDA call (a device→host copy, .item(), a blocking copy from
    # pageable host memory) raises inside sample(). Switching it on warns once that the mode is
    # a prototype (an error under filterwarnings=error), so the switch sits inside the try: a
    # mode left on would fail every later CUDA test at its first host→device copy.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")
        sample()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # And no copy in either direction at all, synchronising or not.
    # torch ≥ 2.11 warns at exit that the profiler "clears events at the end of each cycle",
    # which does not concern a single cycle (an error under filterwarnings=error).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sample()
            torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "HtoD" in e.name or "DtoH" in e.name]
    assert copies == []
