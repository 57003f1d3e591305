"""Smoke test of benchmarks/laplace_structures.py at tiny sizes: every part runs and forms its
figures (the figures themselves are not checked)."""

import pyro
import pytest
import torch

from benchmarks import laplace_structures

pytest.importorskip("laplace")


def test_smoke_run_forms_every_figure():
    torch.set_num_threads(1)
    try:
        out = laplace_structures.run(smoke=True)
    finally:
        pyro.clear_param_store()
    for name, _, _ in laplace_structures.STRUCTURES:
        assert out["fit_time"][name]["ratio"] > 0
        for rule in ("marglik", "val_ll"):
            entry = out["rotated_digits"][f"{name}/{rule}"]
            assert len(entry["nll"]) == len(laplace_structures.ANGLES)
    assert out["resnet18_kron"]["probs_finite"] and out["resnet18_kron"]["fit_s"] >= 0
