"""Smoke test of benchmarks/resnet.py on a tiny network: every variant builds, steps, is timed,
has a peak memory, and every ratio is formed (the figures themselves are not checked)."""

import pyro
import pytest
import torch

from benchmarks import resnet


@pytest.fixture
def tiny_mlp(monkeypatch):
    monkeypatch.setitem(resnet.NETS, "tiny", lambda shape: resnet.wide_mlp(shape, width=16))
    torch.set_num_threads(1)
    yield "tiny"
    pyro.clear_param_store()


def test_every_variant_steps_and_every_ratio_is_formed(tiny_mlp):
    out = resnet.measure(tiny_mlp, 4, "cpu", rounds=1, shape=(3, 4, 4))
    variants = set(resnet.REFERENCE) | set(resnet.REFERENCE.values())
    assert set(out["seconds"]) == variants
    assert all(out["peak_bytes"][k] > 0 for k in variants)
    assert set(out["ratios"]) == {f"{k}/{v}" for k, v in resnet.REFERENCE.items()}
    for r in out["ratios"].values():
        assert r["time"] > 0 and r["peak_memory"] > 0
        assert len(r["time_quartiles_per_round"]) == 3


def test_the_variants_keep_their_own_param_store(tiny_mlp):
    # Each guide's parameters must survive the other variants' steps in between.
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 10, (4,))
    steps = resnet.build_steps(
        lambda: resnet.NETS[tiny_mlp]((3, 4, 4)), x, y, "cpu", ["meanfield", "swag"]
    )
    steps["meanfield"]()
    names = set(pyro.get_param_store().keys())
    steps["swag"]()
    assert set(pyro.get_param_store().keys()) != names
    steps["meanfield"]()
    assert set(pyro.get_param_store().keys()) == names


def test_resnet18_builds_on_small_inputs():
    torch.manual_seed(0)
    net = resnet.NETS["resnet18"]((3, 8, 8))
    assert net(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_main_refuses_an_unknown_net():
    with pytest.raises(SystemExit):
        resnet.main(["--nets", "vgg"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_without_a_device_measures_nothing():
    assert resnet.main(["--device", "cuda", "--no-write"]) == {}


def test_the_paper_gpu_estimate_counts_every_layer_and_form():
    est = resnet.vogn_gpu_estimate(32)
    # ResNet-18 has 20 convolutions and one linear layer; on 32 × 32 inputs the cost model uses
    # every form (see tests/curvature/test_per_example.py), and VOGN does more work than Adam.
    assert sum(est["forms"].values()) == 21 and set(est["forms"]) == {"grouped", "unfold", "pairs"}
    assert est["vogn_seconds"] > est["adam_seconds"] > 0
    assert est["ratio"] == est["vogn_seconds"] / est["adam_seconds"]


def test_under_autocast_runs_the_step_in_bf16():
    seen = []
    step = resnet.under_autocast(
        lambda: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        ),
        "cpu",
        torch.bfloat16,
    )
    step()
    resnet.under_autocast(lambda: seen.append(torch.is_autocast_enabled("cpu")), "cpu", None)()
    assert seen == [torch.bfloat16, False]


def test_a_pair_measures_under_bf16_autocast(tiny_mlp):
    out = resnet.measure(
        tiny_mlp,
        4,
        "cpu",
        rounds=1,
        variants=["ivon", "adam"],
        shape=(3, 4, 4),
        autocast=torch.bfloat16,
    )
    assert set(out["ratios"]) == {"ivon/adam"} and out["ratios"]["ivon/adam"]["time"] > 0


def test_a_pyro_parts_variant_is_set_beside_the_same_reference(tiny_mlp):
    variants = ["sgd", "swag", "swag" + resnet.PYRO_PARTS]
    out = resnet.measure(tiny_mlp, 4, "cpu", rounds=1, variants=variants, shape=(3, 4, 4))
    assert set(out["ratios"]) == {"swag/sgd", "swag@pyro/sgd"}
