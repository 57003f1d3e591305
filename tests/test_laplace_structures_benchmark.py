"""Smoke test of benchmarks/laplace_structures.py at tiny sizes: every part runs and forms its
figures (the figures themselves are not checked). The fit-time and marglik parts run
laplace-torch too, so they need the optional `bench` extra; the others run without it."""

import importlib.util
import inspect
import warnings

import pyro
import pytest
import torch

from benchmarks import laplace_structures


def _run(parts, **kwargs):
    torch.set_num_threads(1)
    try:
        return laplace_structures.run(smoke=True, parts=parts, **kwargs)
    finally:
        pyro.clear_param_store()


def test_smoke_run_forms_the_quality_and_resnet_figures():
    out = _run(("rotated_digits", "resnet18_kron"))
    for name, _, _ in laplace_structures.STRUCTURES:
        for rule in ("marglik", "val_ll"):
            entry = out["rotated_digits"][f"{name}/{rule}"]
            assert len(entry["nll"]) == len(laplace_structures.ANGLES)
    assert out["resnet18_kron"]["probs_finite"] and out["resnet18_kron"]["fit_s"] >= 0


def test_rotated_mnist_part_is_opt_in_and_reads_the_given_folder(tmp_path):
    default = inspect.signature(laplace_structures.run).parameters["parts"].default
    assert "rotated_mnist" not in default and "rotated_digits" in default
    with pytest.raises(FileNotFoundError):
        _run(("rotated_mnist",), data_dir=tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("laplace") is None, reason="needs laplace-torch")
def test_smoke_fit_time_and_marglik_against_laplace_torch():
    with warnings.catch_warnings():  # laplace-torch's import calls the deprecated jit.script
        warnings.simplefilter("ignore", FutureWarning)
        import laplace  # noqa: F401
    out = _run(("fit_time", "marglik"))
    for name, _, _ in laplace_structures.STRUCTURES:
        assert out["fit_time"][name]["ratio"] > 0
        assert out["marglik"][name]["ours_lambda"] > 0
