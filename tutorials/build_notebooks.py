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
