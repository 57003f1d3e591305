"""The likelihoods of pyro_bdl.models: recovery of known noise, Bernoulli metrics against
scikit-learn, the Bernoulli GGN, and which inference method takes which likelihood."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, log_loss
from torch import nn
from torch.overrides import TorchFunctionMode

from pyro_bdl import bayesianize, models, priors
from pyro_bdl.curvature.ggn import output_hessian_factor
from pyro_bdl.diagnostics.metrics_binary import binary_brier, binary_ece, binary_nll
from pyro_bdl.guides import AutoMeanField, AutoRadial, AutoSubnetLaplace, AutoSWAG
from pyro_bdl.infer import VOGN, TraceSuffStat_ELBO
from pyro_bdl.models.noise import check_likelihood_range
from tests.test_host_reads import _CountReads
from tests.test_models import _TokenLM, _tokens


def _train(model, guide, x, y, steps, lr):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), TraceSuffStat_ELBO())
    for _ in range(steps):
        svi.step(x, y)


# --- a learned noise σ ----------------------------------------------------------------------


def _linear_data(n, sigma):
    torch.manual_seed(1)
    x = torch.randn(n, 1)
    return x, 2.0 * x.squeeze(-1) - 0.5 + sigma * torch.randn(n)


def test_learned_sigma_recovers_the_true_noise():
    n, true = 400, 0.3
    x, y = _linear_data(n, true)
    model = models.regressor(bayesianize(nn.Linear(1, 1)), n, noise="learned")
    assert model.noise_scale is None and model.noise == "learned"
    guide = AutoMeanField(model, init_scale=0.05)
    _train(model, guide, x, y, steps=1500, lr=0.02)
    loc, scale = guide.locs_and_scales()["sigma"]  # of log σ
    # The posterior sd of log σ is about 1/sqrt(2N) = 0.035 here; the posterior mean lies within
    # 4 posterior sd of the truth (|z| < 4 has probability > 0.9999 for the data's draw) and the
    # mean-field sd of log σ, nearly independent of the weights, matches 1/sqrt(2N) within 2×.
    assert 0.5 < float(scale) * math.sqrt(2 * n) < 2.0
    assert abs(float(loc) - math.log(true)) < 4 * float(scale)


def test_point_sigma_is_the_maximum_likelihood_noise():
    n, true = 400, 0.3
    x, y = _linear_data(n, true)
    model = models.regressor(bayesianize(nn.Linear(1, 1)), n, noise="point", noise_scale=1.0)
    assert model.noise_scale == 1.0  # the initial value before training
    guide = AutoMeanField(model, init_scale=0.01)
    _train(model, guide, x, y, steps=1500, lr=0.02)
    # The ML σ has relative standard error 1/sqrt(2N) = 0.035: 4 of them around the truth.
    assert abs(model.noise_scale / true - 1) < 4 / math.sqrt(2 * n)
    assert model.noise_scale == pytest.approx(float(pyro.param(*model.param_names).detach()))


def test_learned_sigma_prior_is_the_one_given():
    prior = pyro.distributions.HalfNormal(2.0)
    model = models.regressor(bayesianize(nn.Linear(1, 1)), 10, noise="learned", noise_prior=prior)
    tr = pyro.poutine.trace(model).get_trace(torch.randn(4, 1), torch.randn(4))
    fn = tr.nodes["sigma"]["fn"]
    assert isinstance(fn, pyro.distributions.HalfNormal) and float(fn.scale) == 2.0
    default = models.regressor(bayesianize(nn.Linear(1, 1)), 10, noise="learned")
    assert isinstance(default.noise_prior, pyro.distributions.LogNormal)
    # The prior follows the network's dtype.
    net64 = bayesianize(nn.Linear(1, 1).double())
    m64 = models.regressor(net64, 10, noise="learned")
    tr = pyro.poutine.trace(m64).get_trace(torch.randn(4, 1, dtype=torch.float64))
    assert tr.nodes["sigma"]["value"].dtype == torch.float64


# --- heteroscedastic regression -------------------------------------------------------------


def test_heteroscedastic_regressor_recovers_input_dependent_noise():
    # y = 2x + ε with log Var ε = -2 + 1.5x: a linear network (mean, log-variance) can match it.
    n = 2000
    torch.manual_seed(2)
    x = torch.rand(n, 1) * 2 - 1
    log_var = -2.0 + 1.5 * x.squeeze(-1)
    y = 2.0 * x.squeeze(-1) + (0.5 * log_var).exp() * torch.randn(n)
    net = bayesianize(nn.Linear(1, 2), priors.Normal(scale=10.0))
    model = models.heteroscedastic_regressor(net, n)
    guide = AutoMeanField(model, init_scale=0.01)
    _train(model, guide, x, y, steps=1500, lr=0.03)
    w, sw = guide.locs_and_scales()["weight"]
    b, sb = guide.locs_and_scales()["bias"]
    # The log-variance coefficients' ML standard errors are sqrt(2/N) = 0.032 (intercept) and
    # sqrt(2/(N Var x)) = sqrt(6/N) = 0.055 (slope; Var x = 1/3); 5 of them, or 5 posterior sd
    # where the mean-field sd is larger, bound the error of the posterior mean.
    assert abs(float(b[1]) + 2.0) < 5 * max(float(sb[1]), math.sqrt(2 / n))
    assert abs(float(w[1, 0]) - 1.5) < 5 * max(float(sw[1, 0]), math.sqrt(6 / n))
    # The mean's slope: its SE is below σ_max / sqrt(N Var x) = 0.07.
    assert abs(float(w[0, 0]) - 2.0) < 0.2
    out = model(x[:3])
    mean, lv = models.mean_log_variance(out)
    assert mean.shape == lv.shape == (3,)


def test_heteroscedastic_split_is_the_users():
    net = bayesianize(nn.Linear(2, 4))
    split = lambda out: (out[:, 0], out[:, 1:].sum(-1))  # noqa: E731
    model = models.heteroscedastic_regressor(net, 10, split=split)
    tr = pyro.poutine.trace(model).get_trace(torch.randn(5, 2), torch.randn(5))
    out = tr.nodes["_RETURN"]["value"]
    torch.testing.assert_close(tr.nodes["y"]["fn"].scale, (0.5 * out[:, 1:].sum(-1)).exp())


# --- Bernoulli likelihoods and their metrics ------------------------------------------------


def test_binary_and_multilabel_sites():
    net = bayesianize(nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)))
    model = models.binary_classifier(net, 20)
    x = torch.randn(5, 2)
    for y in (torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0.0, 1, 1, 0, 1]), torch.rand(5) > 0.5):
        tr = pyro.poutine.trace(model).get_trace(x, y)
        fn = tr.nodes["y"]["fn"]
        assert isinstance(fn, torch.distributions.Bernoulli) and fn.batch_shape == (5,)
        assert tr.nodes["y"]["scale"] == pytest.approx(4.0)
        torch.testing.assert_close(tr.nodes["y"]["value"], y.float())
    multi = models.multilabel_classifier(bayesianize(nn.Linear(2, 3)), 20)
    tr = pyro.poutine.trace(multi).get_trace(x, torch.randint(0, 2, (5, 3)))
    assert tr.nodes["y"]["fn"].batch_shape == (5,) and tr.nodes["y"]["fn"].event_shape == (3,)
    assert tr.nodes["_RETURN"]["value"].shape == (5, 3)


@pytest.mark.parametrize("shape", [(500,), (200, 3)])
def test_binary_metrics_match_scikit_learn(shape):
    g = torch.Generator().manual_seed(3)
    p = torch.rand(shape, generator=g, dtype=torch.float64)
    y = (torch.rand(shape, generator=g, dtype=torch.float64) < p**1.5).long()
    p[0] = 1.0  # an edge value falls into the last bin, as calibration_curve puts it
    pn, yn = p.reshape(-1).numpy(), y.reshape(-1).numpy()
    assert binary_nll(p, y) == pytest.approx(log_loss(yn, pn, labels=[0, 1]), rel=1e-10)
    assert binary_brier(p, y) == pytest.approx(brier_score_loss(yn, pn), rel=1e-10)
    true, pred = calibration_curve(yn, pn, n_bins=10, strategy="uniform")
    counts = np.bincount(np.searchsorted(np.linspace(0, 1, 11)[1:-1], pn), minlength=10)
    ref = float(np.sum(counts[counts > 0] / pn.size * np.abs(true - pred)))
    assert binary_ece(p, y, num_bins=10) == pytest.approx(ref, rel=1e-10)


def test_binary_metrics_refuse_bad_inputs():
    with pytest.raises(ValueError, match=r"binary labels 0 or 1 .*; got 2 at index \(1,\)"):
        binary_nll(torch.tensor([0.2, 0.4]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="same non-empty shape"):
        binary_brier(torch.tensor([0.2, 0.4]), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="probabilities in"):
        binary_ece(torch.tensor([0.2, 1.4]), torch.tensor([0, 1]))


def test_bernoulli_ggn_factor_is_the_hessian_of_the_nll():
    # L Lᵀ must equal the Hessian of -log p(y | f) in the K logits (independent of y).
    f = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (4, 3)).double()
    factor = output_hessian_factor(f, "bernoulli")
    for n in range(4):
        nll = lambda z: -torch.distributions.Bernoulli(logits=z).log_prob(y[n]).sum()  # noqa: E731,B023
        hess = torch.autograd.functional.hessian(nll, f[n])
        torch.testing.assert_close(factor[n] @ factor[n].T, hess)


# --- which method takes which likelihood ----------------------------------------------------

N = 16
KINDS = ["categorical", "binary", "multilabel", "fixed", "learned", "point", "heteroscedastic"]


def _problem(kind):
    outputs = {"categorical": 3, "multilabel": 3, "heteroscedastic": 2}.get(kind, 1)
    net = bayesianize(nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, outputs)))
    x = torch.randn(N, 2)
    if kind == "categorical":
        return models.classifier(net, N), x, torch.randint(0, 3, (N,))
    if kind == "binary":
        return models.binary_classifier(net, N), x, torch.randint(0, 2, (N,))
    if kind == "multilabel":
        return models.multilabel_classifier(net, N), x, torch.randint(0, 2, (N, 3))
    if kind == "heteroscedastic":
        return models.heteroscedastic_regressor(net, N), x, torch.randn(N)
    if kind == "fixed":
        return models.regressor(net, N, 0.5), x, torch.randn(N)
    return models.regressor(net, N, noise=kind), x, torch.randn(N)


GUIDES = {
    "meanfield": lambda m: AutoMeanField(m),
    "radial": lambda m: AutoRadial(m),
    "swag": lambda m: AutoSWAG(m),
    "laplace": lambda m: AutoSubnetLaplace(m, subnetwork="all"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", list(GUIDES))
def test_every_guide_with_every_likelihood(method, kind):
    model, x, y = _problem(kind)
    if method == "laplace" and kind == "learned":
        # Refused when the guide is built, before a MAP phase is spent on it.
        with pytest.raises(ValueError, match=r"σ is a latent site \(noise='learned'\)"):
            GUIDES[method](model)
        return
    guide = GUIDES[method](model)
    elbo = TraceSuffStat_ELBO() if method in ("meanfield", "radial") else Trace_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)
    losses = [svi.step(x, y) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    if method == "laplace":
        guide.fit((x, y))
        out = guide.predict(x)
        if kind in ("fixed", "point"):
            mean, var = out
            assert mean.shape == var.shape == (N,) and (var > model.noise_scale**2).all()
        elif kind == "heteroscedastic":
            mean, var = out
            assert mean.shape == var.shape == (N,) and (var > 0).all()
        else:
            want = {"categorical": (N, 3), "binary": (N,), "multilabel": (N, 3)}[kind]
            assert out.shape == want and ((out >= 0) & (out <= 1)).all()
        return
    if method == "swag":
        guide.collect()
        svi.step(x, y)
        guide.collect()
    pred = Predictive(model, guide=guide, num_samples=3, return_sites=["y", "_RETURN"])(x)
    assert pred["y"].shape[0] == 3 and torch.isfinite(pred["_RETURN"]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_vogn_with_every_likelihood(kind):
    model, x, y = _problem(kind)
    vogn = VOGN(model, dataset_size=N, lr=1e-3)
    if kind in ("learned", "point"):
        match = "latent site 'sigma' is not one" if kind == "learned" else r"\['model_\d+\.sigma'\]"
        with pytest.raises(ValueError, match=match):
            vogn.step(x, y)
        return
    assert all(math.isfinite(vogn.step(x, y)) for _ in range(2))


def test_multilabel_val_ll_score_is_the_log_likelihood_of_the_probit_predictive():
    # The score that val_ll tuning maximises must be the log-likelihood of the predictive that
    # predict() returns: each label's logit scaled by its own variance (summing the variances
    # over the labels scores a different predictive). Checked exactly on random inputs.
    from pyro_bdl.guides.laplace.evidence import val_ll_score
    from pyro_bdl.guides.laplace.predictive import linearized_predictive

    g = torch.Generator().manual_seed(0)
    b, c, s = 7, 3, 5
    out = torch.randn(b, c, generator=g, dtype=torch.float64)
    jac = torch.randn(b, c, s, generator=g, dtype=torch.float64)
    y = (torch.rand(b, c, generator=g) > 0.5).double()
    a = torch.randn(s, s, generator=g, dtype=torch.float64)
    evals, evecs = torch.linalg.eigh(a @ a.T)
    ratio = 0.5
    score = val_ll_score([(out, jac, y)], "bernoulli", None, evals, evecs, ratio)
    for lam in (0.1, 1.0, 10.0):
        jl = (jac @ evecs) * (evals + lam * ratio).rsqrt()  # J L with L Lᵀ = Σ_S
        p = linearized_predictive(out, jl, "bernoulli", link="probit")
        expected = torch.distributions.Bernoulli(probs=p).log_prob(y).sum()
        assert float(score(torch.tensor(lam, dtype=torch.float64))) == pytest.approx(
            float(expected), rel=1e-10
        )


@pytest.mark.parametrize("kind", KINDS)
def test_every_likelihood_under_vectorized_particles(kind):
    # K weight draws in one batched forward: the model's output checks must accept the leading
    # particle dim. The KL is exact (TraceSuffStat_ELBO), so the only random term is the
    # likelihood at the drawn weights; with posterior scale 1e-6 every draw is the location to
    # ~1e-6, so the K-particle and one-particle estimates agree to float rounding: the float32
    # losses are 350–560 (the KL of σ = 1e-6 dominates), one ulp 3e-5–6e-5, and they differ by
    # ≤ 3.4e-7 relative (≤ 5 ulps; every kind, seeds 0–2). rel 1e-5 is ~30× that; the
    # likelihood of N = 16 rows (~1 nat each) counted K = 4 times instead of averaged is ~1e-1.
    model, x, y = _problem(kind)
    guide = AutoMeanField(model, init_scale=1e-6)
    sequential = TraceSuffStat_ELBO(num_particles=1).loss(model, guide, x, y)
    vectorized = TraceSuffStat_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1)
    loss = vectorized.loss(model, guide, x, y)
    assert math.isfinite(loss)
    assert loss == pytest.approx(sequential, rel=1e-5)


# --- exact answers and cost -----------------------------------------------------------------


def _hand_log_lik(kind, out, y, sigma):
    """Σ log p(y | out) over the batch, written out from each likelihood's formula."""
    if kind == "categorical":
        return out.log_softmax(-1).gather(-1, y[:, None]).sum()
    if kind in ("binary", "multilabel"):
        y = y.to(out.dtype)
        return (y * F.logsigmoid(out) + (1 - y) * F.logsigmoid(-out)).sum()
    if kind == "heteroscedastic":  # y ~ N(mean, exp(log_var))
        mean, log_var = out[:, 0], out[:, 1]
        return (-0.5 * (math.log(2 * math.pi) + log_var + (y - mean) ** 2 / log_var.exp())).sum()
    return (-0.5 * math.log(2 * math.pi) - torch.log(sigma) - 0.5 * ((y - out) / sigma) ** 2).sum()


@pytest.mark.parametrize("kind", KINDS)
def test_each_likelihood_is_its_formula_scaled_by_n_over_b_in_the_elbo(kind):
    model, x, y = _problem(kind)
    b = 4
    guide = AutoMeanField(model)
    guide(x, y)  # the set-up, which draws from the prior, before the seeded draws
    # The KL is exact, the same for every y; a known plate nesting spares the guessing run,
    # which would draw from the guide before the traced draw.
    elbo = TraceSuffStat_ELBO(kl="exact", max_plate_nesting=1)
    losses, hands = [], []
    for rows in (slice(0, b), slice(b, 2 * b)):
        # The same seed: the guide draws the same weights (and σ) for either batch.
        pyro.set_rng_seed(1)
        losses.append(elbo.loss(model, guide, x[rows], y[rows]))
        pyro.set_rng_seed(1)
        g = poutine.trace(guide).get_trace(x[rows], y[rows])
        m = poutine.trace(poutine.replay(model, trace=g)).get_trace(x[rows], y[rows])
        site = m.nodes["y"]
        sigma = {
            "fixed": torch.tensor(0.5),
            "point": pyro.param(model.param_names[0]) if kind == "point" else None,
            "learned": m.nodes["sigma"]["value"] if kind == "learned" else None,
        }.get(kind)
        hand = _hand_log_lik(kind, m.nodes["_RETURN"]["value"], y[rows], sigma).detach()
        assert site["scale"] == N / b
        # float32 round-off of a sum of b terms of order 1
        torch.testing.assert_close(site["fn"].log_prob(site["value"]).sum().detach(), hand)
        hands.append(float(hand))
    # The likelihood term is exactly N/B times the batch's sum (the KL cancels).
    assert losses[0] - losses[1] == pytest.approx(-N / b * (hands[0] - hands[1]), rel=1e-5)


@pytest.mark.parametrize("kind", ["fixed", "point", "learned", "heteroscedastic"])
def test_a_gaussian_likelihood_reads_back_its_two_checks_only(kind):
    # With validation on, Normal's own checks (loc real, scale positive, y real) would each read
    # a verdict back from the device; the batch check (y finite) and the range check (mean
    # finite, σ finite and positive) already hold them.
    model, x, y = _problem(kind)
    guide = AutoSWAG(model, rank=2)
    guide(x, y)
    model(x, y)  # past the first call
    g = poutine.trace(guide).get_trace(x, y)
    with _CountReads() as counted:
        m = poutine.trace(poutine.replay(model, trace=g)).get_trace(x, y)
        m.nodes["y"]["fn"].log_prob(y)
    assert counted.reads == ["tolist", "__bool__"]


@pytest.mark.parametrize("validation", [False, True])
def test_a_language_model_step_reads_its_label_range_once(validation):
    # The scored labels' range joins the batch check's one read; with validation on, the
    # categorical checks its logits (one read) but not the labels the batch check found in range.
    pyro.enable_validation(validation)
    model = models.language_model(bayesianize(_TokenLM()), dataset_size=8)
    batch = _tokens(vocab=7)
    y = batch["input_ids"].clone()
    y[1, 1] = -100
    model(batch, y)  # past the first call
    with _CountReads() as counted:
        tr = poutine.trace(model).get_trace(batch, y)
        tr.nodes["y"]["fn"].log_prob(tr.nodes["y"]["value"])
    assert counted.reads == (["tolist", "__bool__"] if validation else ["tolist"])


class _CountNumberTensors(TorchFunctionMode):
    """Counts tensors made from Python numbers: on a GPU each is a copy from the host that
    waits for the queued kernels, as a read does."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor", "scalar_tensor") and isinstance(args[0], float):
            self.made.append((name, args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["fixed", "point"])
def test_a_known_sigma_is_not_copied_from_the_host_on_every_step(kind):
    model, x, y = _problem(kind)
    guide = AutoSWAG(model, rank=2)
    guide(x, y)
    model(x, y)  # past the first call, which makes the point σ's param
    g = poutine.trace(guide).get_trace(x, y)
    with _CountNumberTensors() as counted:
        m = poutine.trace(poutine.replay(model, trace=g)).get_trace(x, y)
        m.nodes["y"]["fn"].log_prob(y)
    assert counted.made == []


def test_the_range_check_scales_the_squared_residuals_by_n_over_b():
    # The loss holds N/B · Σ r²/2σ²: 2 rows with r = 3e18 give Σ r²/σ² = 1.8e37 (finite in
    # float32, max 3.4e38); times N/B = 500 it is 9e39, which overflows. The same batch with
    # N = B (factor 1) is scored.
    net = bayesianize(nn.Linear(1, 1))
    x, y = torch.zeros(2, 1), torch.full((2,), 3e18)
    fixed = {"weight": torch.zeros(1, 1), "bias": torch.zeros(1)}  # mean 0
    small = models.regressor(net, dataset_size=2, noise_scale=1.0)
    poutine.condition(small, data=fixed)(x, y)
    large = models.regressor(net, dataset_size=1000, noise_scale=1.0)
    with pytest.raises(ValueError, match=r"overflows torch\.float32.*N/B = 500"):
        poutine.condition(large, data=fixed)(x, y)


def test_the_default_prior_of_a_learned_sigma_is_lognormal_0_1():
    # Documented: median 1 and 95% of the mass in [exp(-1.96), exp(1.96)] = [0.14, 7.1].
    model = models.regressor(bayesianize(nn.Linear(1, 1)), dataset_size=10, noise="learned")
    tr = poutine.trace(model).get_trace(torch.zeros(2, 1), torch.zeros(2))
    prior = tr.nodes["sigma"]["fn"]
    assert isinstance(prior, torch.distributions.LogNormal)
    assert (float(prior.loc), float(prior.scale)) == (0.0, 1.0)
    cdf = prior.cdf(torch.tensor([1.0, math.exp(-1.96), math.exp(1.96)]))
    # Φ(1.96) = 0.9750021: 2.1e-6 from 0.975 (1.96 rounds 1.959964), plus float32 round-off of
    # ≤ 1e-7; atol 1e-5 is ~5× that, while a prior scale of 1.1 instead of 1 moves Φ by 1.2e-2.
    torch.testing.assert_close(cdf, torch.tensor([0.5, 0.025, 0.975]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sigma", [0.0, -0.5])
def test_a_sigma_that_is_not_positive_is_named_as_the_cause(sigma):
    # Finite targets and mean: the refusal must blame σ, not an overflow or the network.
    y, mean = torch.tensor([1.0, 2.0]), torch.zeros(2)
    with pytest.raises(ValueError, match=rf"noise scale σ \(fixed\) is {sigma!r}; it must be"):
        check_likelihood_range(y, mean, torch.tensor(sigma), 1.0, where="fixed")


@pytest.mark.parametrize("prior", [dist.Normal(1.0, 1.0), dist.Uniform(-1.0, 1.0)])
def test_a_noise_prior_with_mass_on_negative_sigma_is_refused(prior):
    net = bayesianize(nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"noise_prior must put its mass on σ > 0"):
        models.regressor(net, dataset_size=10, noise="learned", noise_prior=prior)


def test_a_finite_loss_whose_sigma_gradient_overflows_is_refused():
    # r = 0.1, σ = 1e-18 in float32: the loss term r²/2σ² = 5e33 is finite, but its σ-gradient
    # r²/σ³ = 1e52 is not (max 3.4e38). σ = 1e-10 gives r²/σ³ = 1e28: scored.
    y, mean = torch.tensor([0.1]), torch.zeros(1)
    check_likelihood_range(y, mean, torch.tensor(1e-10), 1.0, where="fixed")
    with pytest.raises(ValueError, match=r"N/B·Σ\(y - mean\)²/σ³ is not finite"):
        check_likelihood_range(y, mean, torch.tensor(1e-18), 1.0, where="fixed")
