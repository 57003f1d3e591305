"""The library's shared argument and finiteness checks (``pyro_bdl._validation``)."""

from __future__ import annotations

import pytest
import torch

from pyro_bdl._validation import all_finite, check_positive, check_positive_int


def test_all_finite_decides_every_case_in_one_call():
    x = torch.randn(1000)
    assert all_finite([x, x.double(), torch.empty(0)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[617] = bad
        assert not all_finite([x, y]) and not all_finite([y.double()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_is_not_fooled_by_a_norm_that_overflows(dtype):
    # Finite entries whose sum of squares exceeds the dtype's range: the 2-norm is inf, and the
    # element-wise test must answer instead (float32 max 3.4e38, so 64 · 1e20² overflows;
    # float16 norms are accumulated in float32 but returned in float16, max 65504, so the norm
    # 8 · 6e4 does; bfloat16 shares float32's exponent).
    big = {torch.float32: 1e20, torch.float16: 6e4, torch.bfloat16: 1e20}[dtype]
    x = torch.full((64,), big, dtype=dtype)
    assert torch.isfinite(x).all() and not torch.isfinite(torch.linalg.vector_norm(x))
    assert all_finite([x])
    x[3] = float("nan")
    assert not all_finite([x])


def test_all_finite_reads_a_gradient_that_carries_a_graph_without_warning():
    # pytest turns warnings into errors: a scalar of a tensor that requires grad would warn.
    w = torch.randn(5, requires_grad=True)
    (g,) = torch.autograd.grad((w**3).sum(), w, create_graph=True)
    assert g.requires_grad and all_finite([g])


@pytest.mark.parametrize("value", [True, torch.tensor([True, False])])
def test_a_bool_is_not_a_positive_number(value):
    # True would pass as 1.0: regressor(net, N, noise_scale=True) meant σ = 1 without a word.
    with pytest.raises(TypeError, match="noise_scale must be a positive number; got the bool"):
        check_positive("noise_scale", value)


def test_regressor_refuses_a_bool_noise_scale():
    import pyro_bdl as bdl

    net = bdl.bayesianize(torch.nn.Linear(2, 1))
    with pytest.raises(TypeError, match="noise_scale"):
        bdl.models.regressor(net, 10, noise_scale=True)


@pytest.mark.parametrize("value", [1437.0, torch.tensor(1437), True])
def test_a_count_that_is_not_an_int_names_the_conversion(value):
    # classifier(net, len(x_train) * 0.8) or a tensor's size: the message gives the fix too.
    with pytest.raises(
        TypeError, match=r"dataset_size must be an int >= 1; got .*Pass a Python int \(int\(x\)"
    ):
        check_positive_int("dataset_size", value)
