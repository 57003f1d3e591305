"""Side by side with laplace-torch (skipped without it) on the same small bias-free MLP, data and
prior: Kronecker factors and eigenvalues, predictive variances of every structure, and the
marginal likelihood. Bias-free layers because laplace-torch keeps a layer's bias as a separate
Kronecker block, while pyro_bdl folds it into the input factor."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from pyro_bdl.guides import AutoSubnetLaplace
from tests.common import assert_close

laplace = pytest.importorskip("laplace")

F64 = torch.float64
SIGMA, LAM = 0.4, 0.8


def _mlp(out: int):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 6, bias=False), nn.Tanh(), nn.Linear(6, out, bias=False)
    ).double()


def _data(regression: bool):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 3, generator=g, dtype=F64)
    if regression:
        return x, torch.sin(x[:, 0]) + 0.1 * torch.randn(50, generator=g, dtype=F64)
    return x, ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def _theirs(net, x, y, likelihood, structure, subset="all"):
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # laplace-torch's own deprecation notices
        la = laplace.Laplace(
            copy.deepcopy(net),
            likelihood,
            subset_of_weights=subset,
            hessian_structure=structure,
            prior_precision=LAM,
            **({"sigma_noise": SIGMA} if likelihood == "regression" else {}),
        )
        la.fit(loader)
    return la


def _ours(net, x, y, regression, structure, subnetwork="all"):
    lifted = bdl.bayesianize(copy.deepcopy(net), bdl.priors.Normal(1.0))
    if regression:
        model = bdl.models.regressor(nn.Sequential(lifted, nn.Flatten(0)), len(y), SIGMA)
    else:
        model = bdl.models.classifier(lifted, len(y))
    guide = AutoSubnetLaplace(
        model, subnetwork=subnetwork, hessian_structure=structure, prior_precision=LAM
    )
    guide(x, y)
    # Both libraries at the same untrained weights: what is compared is the curvature and the
    # formulas built on it, which laplace-torch computes wherever it is given (it has no mode
    # check), so ours must not refuse the point as "not a MAP".
    return guide.fit((x, y), reduce_fn=None, check_mode=False)


def test_kron_factors_and_eigenvalues_match_laplace_torch():
    net, (x, y) = _mlp(3), _data(False)
    theirs = _theirs(net, x, y, "classification", "kron").H
    ours = _ours(net, x, y, False, "kron").posterior
    for (a, g), vecs, vals in zip(ours.factors(), theirs.eigenvectors, theirs.eigenvalues):
        (qg, qa), (eg, ea) = vecs, vals
        # Each library splits the data count between the factors its own way; the Kronecker
        # product (the layer's curvature) and its eigenvalues are what must agree.
        product = torch.kron((qg * eg) @ qg.T, (qa * ea) @ qa.T)
        assert_close(torch.kron(g, a), product, rtol=1e-5, atol=1e-8)
        ours_eig = torch.outer(torch.linalg.eigvalsh(g), torch.linalg.eigvalsh(a)).flatten()
        assert_close(
            ours_eig.sort().values,
            torch.outer(eg, ea).flatten().sort().values,
            rtol=1e-5,
            atol=1e-8,
        )


@pytest.mark.parametrize(
    ("structure", "subset"),
    [("kron", "all"), ("full", "all"), ("diag", "all"), ("full", "last_layer")],
)
def test_predictive_variances_and_evidence_match_laplace_torch(structure, subset):
    net, (x, y) = _mlp(1), _data(True)
    theirs = _theirs(net, x, y[:, None], "regression", structure, subset)
    ours = _ours(net, x, y, True, structure, subset)
    _, f_var = theirs._glm_predictive_distribution(x[:10])
    _, var = ours.predict(x[:10])
    assert_close(var - SIGMA**2, f_var.reshape(-1), rtol=1e-5, atol=1e-10)
    if subset == "all":
        assert_close(ours.marginal_likelihood(), float(theirs.log_marginal_likelihood()), rtol=1e-5)
