"""Writes the tutorial notebooks from the cell sources below (outputs stripped).

Keeping the sources in a script keeps diffs readable; run ``python tutorials/build_notebooks.py``
after editing and commit both.
"""

from pathlib import Path

import nbformat

HERE = Path(__file__).parent

GETTING_STARTED = [
    (
        "md",
        """# Getting started with pyro_bdl

Lift a PyTorch network into a Bayesian `PyroModule`, write the model with `pyro.sample`, train a
mean-field variational posterior with SVI, and evaluate calibrated predictions on real handwritten
digits (scikit-learn's bundled `load_digits`).

When the environment variable `CI` is set (as in the test suite) the notebook trains for a few
epochs only.""",
    ),
    (
        "code",
        """import os

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO

import pyro_bdl as bdl

SMOKE = bool(os.environ.get("CI"))
EPOCHS = 2 if SMOKE else 60
pyro.set_rng_seed(0)
data = bdl.data.load_digits()
N = len(data.y_train)
print(f"{N} training digits, {len(data.y_test)} test digits")""",
    ),
    (
        "md",
        """## 1. Lift the network

`bayesianize` converts the module in place: every weight and bias becomes a `pyro.sample` site
named by its dotted parameter name, with the prior you choose. Normalisation layers would stay
deterministic.""",
    ),
    (
        "code",
        """net = torch.nn.Sequential(
    torch.nn.Flatten(), torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10)
)
bnn = bdl.bayesianize(net, prior=bdl.priors.Normal(scale=1.0))
for name, spec in bdl.sites(bnn).items():
    print(name, tuple(spec.shape))""",
    ),
    (
        "md",
        """## 2. Write the model

The data plate scales the likelihood by N/B for minibatches; the KL is counted once per step.""",
    ),
    (
        "code",
        """def model(x, y=None):
    logits = bnn(x)
    with pyro.plate("data", N, subsample_size=x.shape[0]):
        pyro.sample("y", dist.Categorical(logits=logits), obs=y)
    return logits""",
    ),
    (
        "md",
        """## 3. Mean-field variational inference

`AutoMeanField` puts a `Normal` on each weight site itself, so `TraceMeanField_ELBO` computes the
KL to the Normal prior exactly. The locations start at the network's own initial weights.""",
    ),
    (
        "code",
        """guide = bdl.guides.AutoMeanField(model, init_scale=1e-2)
svi = SVI(model, guide, pyro.optim.Adam({"lr": 3e-3}), TraceMeanField_ELBO())
g = torch.Generator().manual_seed(0)
for epoch in range(EPOCHS):
    order = torch.randperm(N, generator=g)
    loss = 0.0
    for i in range(0, N, 64):
        idx = order[i : i + 64]
        loss += svi.step(data.x_train[idx], data.y_train[idx])
    if epoch % 10 == 0 or epoch == EPOCHS - 1:
        print(f"epoch {epoch:3d}  loss per example {loss / N:.3f}")""",
    ),
    (
        "md",
        """## 4. Predict and evaluate

`Predictive` draws weights from the guide; averaging the softmax over draws gives the posterior
predictive. The metrics are plain functions of the probabilities.""",
    ),
    (
        "code",
        """predictive = Predictive(model, guide=guide, num_samples=32, return_sites=["_RETURN"])
with torch.no_grad():
    probs = predictive(data.x_test)["_RETURN"].softmax(-1).mean(0)
print("accuracy", round(bdl.diagnostics.accuracy(probs, data.y_test), 4))
print("test NLL", round(bdl.diagnostics.nll(probs, data.y_test), 4))
assert probs.shape == (len(data.y_test), 10)""",
    ),
    (
        "md",
        """## Where next

- `bdl.guides.AutoRadial` for the Radial posterior (better in large networks);
- `bdl.infer.TraceSuffStat_ELBO(num_kl_samples=1000)` for a many-sample KL at the memory of one;
- `bdl.infer.VOGN`, `bdl.guides.AutoSWAG`, `bdl.guides.AutoSubnetLaplace` for the other methods;
- `pyro-bdl compare` runs them all side by side.""",
    ),
]


SETUP = """import os

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

import pyro_bdl as bdl

SMOKE = bool(os.environ.get("CI"))
pyro.set_rng_seed(0)
data = bdl.data.load_digits()
N = len(data.y_train)
x_train, y_train, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
net = torch.nn.Sequential(
    torch.nn.Flatten(), torch.nn.Linear(64, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10)
)
bnn = bdl.bayesianize(net, prior=bdl.priors.Normal(scale=1.0))
model = bdl.models.classifier(bnn, N)  # the model of tutorial 01, with input checks


def epochs(n, batch_size=64, seed=0):
    \"\"\"Shuffled minibatches for n epochs.\"\"\"
    g = torch.Generator().manual_seed(seed)
    for epoch in range(n):
        order = torch.randperm(N, generator=g)
        yield epoch, [order[i : i + batch_size] for i in range(0, N, batch_size)]


@torch.no_grad()
def point_probs(guide, x):
    \"\"\"Softmax of the network at the guide's median (the point estimate).\"\"\"
    return pyro.poutine.condition(model, data=guide.median())(x).softmax(-1)


def report(name, probs):
    print(
        f"{name:16s} accuracy {bdl.diagnostics.accuracy(probs, y_test):.4f}"
        f"  NLL {bdl.diagnostics.nll(probs, y_test):.4f}"
        f"  ECE {bdl.diagnostics.ece(probs, y_test):.4f}"
    )"""

POSTHOC = [
    (
        "md",
        """# Posteriors after training: SWAG and subnetwork Laplace

Both methods start from an ordinary training run. **SWAG** (Maddox et al. 2019) fits a Gaussian to
the SGD iterates; **subnetwork linearized Laplace** (Daxberger et al. 2021) puts a full-covariance
Gaussian on a few hundred chosen weights around the MAP. Both end in a Pyro guide, so `Predictive`
works as for every other method.""",
    ),
    ("code", SETUP),
    (
        "md",
        """## 1. SWAG

While gradients are on, `AutoSWAG` is a point estimate trained by SGD; `collect()` records the
current weights (O(D), in place). After two or more snapshots the guide samples
θ̄ + Σ_diag^{1/2} z₁/√2 + D̂ z₂/√(2(K−1)) under `torch.no_grad()`, which is how `Predictive`
runs it.""",
    ),
    (
        "code",
        """swag = bdl.guides.AutoSWAG(model, rank=10, scale=0.5)


def sgd(lr):
    # Pyro's ELBO sums the likelihood over the N examples: a per-example rate is divided by N.
    return SVI(model, swag, pyro.optim.SGD({"lr": lr / N, "momentum": 0.9}), Trace_ELBO())


EPOCHS, SWAG_START = (3, 1) if SMOKE else (60, 40)
svi = sgd(0.05)
for epoch, batches in epochs(EPOCHS):
    if epoch == SWAG_START:
        probs_sgd = point_probs(swag, x_test)  # the SGD solution, before the SWAG phase
        svi = sgd(0.1)  # a constant, higher rate explores the basin around it
    for idx in batches:
        svi.step(x_train[idx], y_train[idx])
    if epoch >= SWAG_START:
        swag.collect()  # once per epoch
print("snapshots:", swag.num_collected)
report("SGD", probs_sgd)
predictive = Predictive(model, guide=swag, num_samples=30, return_sites=["_RETURN"])
with torch.no_grad():
    probs_swag = predictive(x_test)["_RETURN"].softmax(-1).mean(0)
report("SWAG", probs_swag)""",
    ),
    (
        "md",
        """Networks with BatchNorm need their running statistics recomputed for every sampled
network: `bdl.guides.batchnorm.predict_with_bn_refresh(swag, bnn, x_test, bn_data=x_train)` does
it. `swag.marginal_variances()` gives the SWAG-diag variance per site.""",
    ),
    (
        "md",
        """## 2. Subnetwork linearized Laplace

`AutoSubnetLaplace` is a MAP point estimate while it trains. `fit` then computes the GGN Laplace
posterior over the S weights of largest marginal variance (estimated here by diagonal Laplace;
pass `variances=swag` to use SWAG-diag), directly from subnetwork Jacobians — never a
B × C × D tensor. The prior precision is tuned by the Laplace marginal likelihood.""",
    ),
    (
        "code",
        """laplace = bdl.guides.AutoSubnetLaplace(model, subnetwork="largest_variance", size=300)
svi = SVI(model, laplace, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
for epoch, batches in epochs(2 if SMOKE else 40, seed=1):
    for idx in batches:
        svi.step(x_train[idx], y_train[idx])
laplace.fit((x_train, y_train))
print("prior precision", round(laplace.tune_prior_precision(method="marglik"), 3))
probs_map = point_probs(laplace, x_test)
report("MAP", probs_map)
probs_la = laplace.predict(x_test, link="probit")
report("subnet Laplace", probs_la)
assert torch.equal(probs_la.argmax(-1), probs_map.argmax(-1))  # probit keeps the MAP's argmax""",
    ),
    (
        "md",
        """## 3. Under distribution shift

Rotate the test digits and compare the NLL of the point estimate and of the two posteriors. The
Bayesian predictives should degrade more gracefully.""",
    ),
    (
        "code",
        """import torchvision.transforms.functional as TF

images = x_test.view(-1, 1, 8, 8)
for angle in (0, 45, 90):
    x_rot = TF.rotate(images, angle).view_as(x_test)
    with torch.no_grad():
        p_swag = predictive(x_rot)["_RETURN"].softmax(-1).mean(0)
    nll = {
        "SWAG": bdl.diagnostics.nll(p_swag, y_test),
        "MAP": bdl.diagnostics.nll(point_probs(laplace, x_rot), y_test),
        "subnet Laplace": bdl.diagnostics.nll(laplace.predict(x_rot, link="probit"), y_test),
    }
    print(f"{angle:3d} deg  NLL  " + "  ".join(f"{k} {v:.3f}" for k, v in nll.items()))""",
    ),
]

VOGN_AND_DIAGNOSTICS = [
    (
        "md",
        """# VOGN, the many-sample KL, and diagnostics

**VOGN** (Osawa et al. 2019) is natural-gradient variational inference that trains like Adam: its
second moment is the sum of *squared per-example gradients*, which makes it a posterior precision.
The **sufficient-statistic ELBO** (Nazarovs et al. 2021) estimates the KL term with 1000 Monte
Carlo samples at the memory of one. Every result ends in a Pyro guide, so the same diagnostics —
calibration, out-of-distribution detection, ArviZ, PSIS k̂ — apply to all of them.""",
    ),
    ("code", SETUP),
    (
        "md",
        """## 1. VOGN

`VOGN` is shaped like `SVI`: `step(x, y)` draws weights from N(μ, σ²), reads the per-example
negative log-likelihoods inside the data plate, and updates μ and the precision. A tempered
posterior (τ = 0.1) suits a small data set; `vogn.guide` is an ordinary Pyro guide.""",
    ),
    (
        "code",
        """vogn = bdl.infer.VOGN(
    model, dataset_size=N, lr=1e-3, betas=(0.9, 0.05), prior_precision=1.0, temperature=0.1
)
for epoch, batches in epochs(2 if SMOKE else 30):
    loss = sum(vogn.step(x_train[idx], y_train[idx]) for idx in batches)
print("last epoch: negative ELBO per example", round(loss / N, 4))
predictive = Predictive(model, guide=vogn.guide, num_samples=32, return_sites=["_RETURN"])
with torch.no_grad():
    probs_vogn = predictive(x_test)["_RETURN"].softmax(-1).mean(0)
report("VOGN", probs_vogn)""",
    ),
    (
        "md",
        """The squared per-example gradients are a public function of their own, usable with any
module: no batch × parameters tensor is ever built.""",
    ),
    (
        "code",
        """import torch.nn.functional as F

plain = torch.nn.Sequential(
    torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
)
with bdl.curvature.PerExampleGradients(plain) as tape:
    losses = F.cross_entropy(plain(x_train[:128]), y_train[:128], reduction="none")
grads, squared = tape.squared_gradients(losses)
print({name: tuple(g.shape) for name, g in squared.items()})""",
    ),
    (
        "md",
        """## 2. Mean-field VI with a 1000-sample KL

`TraceSuffStat_ELBO(num_kl_samples=1000, kl="mc")` uses the Monte Carlo KL even where a closed
form exists, with an autograd graph that does not grow with the number of samples.""",
    ),
    (
        "code",
        """guide = bdl.guides.AutoMeanField(model, init_scale=1e-2)
elbo = bdl.infer.TraceSuffStat_ELBO(num_kl_samples=1000, kl="mc")
svi = SVI(model, guide, pyro.optim.Adam({"lr": 3e-3}), elbo)
for epoch, batches in epochs(2 if SMOKE else 60, seed=2):
    for idx in batches:
        svi.step(x_train[idx], y_train[idx])
with torch.no_grad():
    probs_mf = Predictive(model, guide=guide, num_samples=32, return_sites=["_RETURN"])(x_test)[
        "_RETURN"
    ].softmax(-1).mean(0)
report("mean-field", probs_mf)""",
    ),
    (
        "md",
        """## 3. Diagnostics

Calibration (reliability diagram), out-of-distribution detection by predictive entropy (here:
uniform noise images as a crude OOD set), the ArviZ export with pointwise log-likelihoods for
PSIS-LOO, and the PSIS k̂ of the guide as an importance sampler for the posterior.""",
    ),
    (
        "code",
        """D = bdl.diagnostics
D.plot_reliability(D.reliability(probs_vogn, y_test))
noise = torch.rand((200,) + x_train.shape[1:]) * x_train.max()
with torch.no_grad():
    probs_noise = predictive(noise)["_RETURN"].softmax(-1).mean(0)
print("OOD AUROC (VOGN, noise images)", round(D.ood_auroc(probs_vogn, probs_noise), 3))

idata = D.to_inference_data(model, vogn.guide, x_test, y_test, num_samples=50)
print(idata)
print(D.loo(idata))
print(D.psis_khat(model, vogn.guide, x_train, y_train, num_samples=50 if SMOKE else 1000))""",
    ),
    (
        "md",
        """A k̂ above 0.7 says the guide is a poor importance proposal for the exact posterior — the
usual verdict for a factorised Gaussian over thousands of weights, and a reminder that good
calibration and OOD scores do not make an approximation exact.""",
    ),
]


def build(cells, path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    nbformat.write(nb, path)


if __name__ == "__main__":
    build(GETTING_STARTED, HERE / "01_getting_started.ipynb")
    build(POSTHOC, HERE / "02_swag_and_laplace.ipynb")
    build(VOGN_AND_DIAGNOSTICS, HERE / "03_vogn_and_diagnostics.ipynb")
