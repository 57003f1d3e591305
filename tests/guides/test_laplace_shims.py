"""The Laplace module paths that moved into ``pyro_bdl.guides.laplace`` still import, with a
``DeprecationWarning`` naming the new path, and give the same objects."""

from __future__ import annotations

import importlib
import sys

import pytest

from pyro_bdl.guides.laplace import evidence, posterior, predictive, subnetwork

MOVED = {
    "laplace_posterior": (posterior, "cholesky_jitter"),
    "laplace_structures": (posterior, "FullPosterior"),
    "laplace_kron": (posterior, "KronPosterior"),
    "laplace_marglik": (evidence, "evidence"),
    "subnetwork": (subnetwork, "parse_subnetwork"),
}


@pytest.mark.parametrize("old", list(MOVED))
def test_old_path_warns_and_reexports(old, monkeypatch):
    new, name = MOVED[old]
    monkeypatch.delitem(sys.modules, f"pyro_bdl.guides.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"moved to {new.__name__}"):
        module = importlib.import_module(f"pyro_bdl.guides.{old}")
    assert getattr(module, name) is getattr(new, name)
    if old == "laplace_posterior":  # its predictive half moved to a module of its own
        assert module.linearized_predictive is predictive.linearized_predictive


def test_package_keeps_the_names_of_the_old_module():
    import pyro_bdl.guides.laplace as laplace
    from pyro_bdl.guides import AutoLaplace, AutoSubnetLaplace, NotFittedError

    assert laplace.AutoLaplace is AutoLaplace and laplace.AutoSubnetLaplace is AutoSubnetLaplace
    assert laplace.NotFittedError is NotFittedError
    assert set(laplace.__all__) >= {"HESSIAN_STRUCTURES", "PRIOR_SCALINGS", "SubnetNormal"}
