import copy
import io
import pickle

import pyro
import pytest
import torch
from pyro import poutine
from torch import nn

from pyro_bdl import bayesianize, models
from pyro_bdl.models.structured import select_output


def _classifier(n=100):
    return models.classifier(bayesianize(nn.Linear(3, 4)), dataset_size=n)


def _regressor(n=100):
    return models.regressor(bayesianize(nn.Linear(3, 1)), dataset_size=n, noise_scale=0.5)


def test_classifier_scales_likelihood_by_n_over_b():
    model = _classifier(n=100)
    x, y = torch.randn(10, 3), torch.randint(0, 4, (10,))
    tr = poutine.trace(model).get_trace(x, y)
    assert tr.nodes["y"]["scale"] == pytest.approx(10.0)
    assert tr.nodes["y"]["fn"].batch_shape == (10,)
    assert tr.nodes["_RETURN"]["value"].shape == (10, 4)


def test_regressor_accepts_column_output_and_checks_target_shape():
    model = _regressor()
    x = torch.randn(6, 3)
    tr = poutine.trace(model).get_trace(x, torch.randn(6))
    assert tr.nodes["y"]["fn"].batch_shape == (6,)
    with pytest.raises(ValueError, match=r"y must have the network output's shape \(6,\)"):
        model(x, torch.randn(6, 1))


def test_prediction_on_more_rows_than_the_dataset_is_unscaled():
    model = _classifier(n=5)
    tr = poutine.trace(model).get_trace(torch.randn(8, 3))
    assert tr.nodes["y"]["scale"] == 1.0


@pytest.mark.parametrize(
    "x, y, match",
    [
        (torch.randn(4, 3), torch.tensor([0, 1, 2]), "same number of rows"),
        (torch.randn(4, 3), torch.zeros(4, 1, dtype=torch.long), r"shape \(4,\)"),
        (torch.randn(4, 3), torch.zeros(4), "integer class labels"),
        (torch.randn(4, 3), torch.tensor([0, 1, 2, 4]), r"\[0, 4\)"),
        (torch.randn(4, 3), torch.tensor([0, -1, 2, 3]), r"\[0, 4\)"),
        (torch.tensor([[0.0, float("nan"), 1.0]]), torch.tensor([0]), r"x contains 1 .* \(0, 1\)"),
        (torch.randn(0, 3), torch.zeros(0, dtype=torch.long), "at least one row"),
    ],
)
def test_classifier_bad_inputs(x, y, match):
    with pytest.raises(ValueError, match=match):
        _classifier()(x, y)


@pytest.mark.parametrize(
    "y, match",
    [
        (torch.tensor([0, 1, 2, 3]), "floating point"),
        (torch.tensor([True, False, True, True]), "floating point"),
        (torch.tensor([0.0, float("inf"), 1.0, 2.0]), r"y contains 1 .* \(1,\)"),
    ],
)
def test_regressor_bad_targets(y, match):
    with pytest.raises(ValueError, match=match):
        _regressor()(torch.randn(4, 3), y)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_dataset_size_and_noise(bad):
    with pytest.raises(ValueError, match="dataset_size"):
        models.classifier(nn.Linear(2, 2), dataset_size=bad)
    with pytest.raises(ValueError, match="noise_scale"):
        models.regressor(nn.Linear(2, 1), dataset_size=10, noise_scale=bad)
    with pytest.raises(TypeError, match="dataset_size"):
        models.classifier(nn.Linear(2, 2), dataset_size=2.5)


def test_likelihood_is_an_ordinary_categorical():
    # The classifier's likelihood normalises with one log_softmax and scores with one gather;
    # every observable must match torch's Categorical(logits=...) to float32 round-off.
    model = _classifier()
    x, y = torch.randn(7, 3), torch.randint(0, 4, (7,))
    tr = poutine.trace(model).get_trace(x, y)
    fn, logits = tr.nodes["y"]["fn"], tr.nodes["_RETURN"]["value"]
    ref = torch.distributions.Categorical(logits=logits)
    assert isinstance(fn, torch.distributions.Categorical)
    torch.testing.assert_close(fn.logits, ref.logits)
    torch.testing.assert_close(fn.probs, ref.probs)
    torch.testing.assert_close(fn.log_prob(y), ref.log_prob(y))
    values = torch.arange(4).reshape(4, 1)  # enumerated values broadcast against the batch
    torch.testing.assert_close(fn.log_prob(values), ref.log_prob(values))
    assert fn.expand((7,)) is fn
    wide = fn.expand((2, 7))
    assert wide.batch_shape == (2, 7)
    torch.testing.assert_close(wide.log_prob(y), ref.log_prob(y).expand(2, 7))
    assert fn.sample((3,)).shape == (3, 7)


def test_finite_check_fast_path_keeps_the_verdict():
    # Finite values whose sum overflows to inf must pass (the exact check decides), and a single
    # NaN among them must still be found and located.
    big = torch.full((4, 3), 3e38)
    models.check_batch(big, None, task="classification")
    big[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"x contains 1 .* \(2, 1\)"):
        models.check_batch(big, None, task="classification")
    models.check_batch(torch.randint(0, 3, (4, 3)), None, task="classification")  # integers


def test_the_model_contract_is_an_explicit_object():
    net = bayesianize(nn.Linear(3, 1))
    model = models.regressor(net, dataset_size=50, noise_scale=0.5)
    assert isinstance(model, models.NetworkModel)
    assert (model.net, model.likelihood, model.dataset_size, model.noise_scale) == (
        net,
        "gaussian",
        50,
        0.5,
    )
    clf = _classifier()
    assert clf.likelihood == "categorical" and clf.noise_scale is None
    assert "likelihood='categorical'" in repr(clf)


def test_network_model_refuses_a_bad_contract():
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        models.NetworkModel(lambda x: x, likelihood="categorical", dataset_size=3)
    with pytest.raises(ValueError, match="likelihood must be one of"):
        models.NetworkModel(nn.Linear(2, 2), likelihood="poisson", dataset_size=3)
    with pytest.raises(ValueError, match="needs noise_scale"):
        models.NetworkModel(nn.Linear(2, 1), likelihood="gaussian", dataset_size=3)


def test_every_factory_declares_its_likelihood():
    lin = lambda k: bayesianize(nn.Linear(3, k))  # noqa: E731
    binary = models.binary_classifier(lin(1), 10)
    multi = models.multilabel_classifier(lin(4), 10)
    learned = models.regressor(lin(1), 10, noise="learned")
    point = models.regressor(lin(1), 10, noise="point", noise_scale=0.3)
    het = models.heteroscedastic_regressor(lin(2), 10)
    assert (binary.likelihood, binary.multilabel, binary.noise) == ("bernoulli", False, None)
    assert (multi.likelihood, multi.multilabel) == ("bernoulli", True)
    assert (learned.likelihood, learned.noise, learned.noise_scale) == ("gaussian", "learned", None)
    assert (point.noise, point.noise_scale, point.noise_prior) == ("point", 0.3, None)
    assert (het.noise, het.noise_scale, het.split) == ("heteroscedastic", None, None)
    assert _regressor().noise == "fixed"
    assert "multilabel=True" in repr(multi) and "noise='learned'" in repr(learned)
    # A point σ reads its current estimate from the param store.
    point(torch.randn(4, 3), torch.randn(4))
    with torch.no_grad():
        pyro.param(*point.param_names).unconstrained().fill_(0.0)
    assert point.noise_scale == pytest.approx(1.0)


@pytest.mark.parametrize(
    "net, kind, width, outputs",
    [
        (nn.Linear(3, 2), "linear", 3, 2),
        (
            nn.Sequential(nn.Dropout(0.1), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1)),
            "linear",
            5,
            1,
        ),
        (nn.Sequential(nn.Sequential(nn.Linear(2, 3)), nn.Tanh(), nn.Softmax(-1)), "linear", 2, 3),
        (nn.Sequential(nn.Flatten(), nn.Linear(6, 2), nn.Dropout()), "flatten", 6, 2),
        (nn.Sequential(nn.Conv1d(3, 2, 1), nn.Flatten()), "conv", 3, None),
        (nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2)), None, None, 2),
    ],
)
def test_network_shape_reads_first_and_last_layers(net, kind, width, outputs):
    for candidate in (net, bayesianize(net)):
        shape = models.NetworkShape(candidate)
        assert (shape.kind, shape.width, shape.outputs) == (kind, width, outputs)


def test_network_shape_of_an_opaque_network_checks_dtype_only():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x)

    shape = models.NetworkShape(bayesianize(Opaque()))
    assert (shape.kind, shape.width, shape.outputs) == (None, None, None)
    shape.check_inputs(torch.randn(4, 7))  # width unknown: left to the network
    shape.check_inputs(torch.randint(0, 3, (4, 3)))  # integer inputs may be indices
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64"):
        shape.check_inputs(torch.randn(4, 3, dtype=torch.float64))


def test_check_batch_binary_and_multilabel():
    x = torch.randn(3, 2)
    models.check_batch(x, torch.tensor([0, 1, 1]), task="binary")
    models.check_batch(x, torch.tensor([[0.0, 1.0]] * 3), task="multilabel", num_classes=2)
    with pytest.raises(ValueError, match=r"3 label column\(s\) but the network has 2"):
        models.check_batch(x, torch.zeros(3, 3), task="multilabel", num_classes=2)


class _TokenClassifier(nn.Module):
    """A network taking a tokenized batch as keyword arguments and returning a dict."""

    def __init__(self, vocab=10, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, classes)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        pooled = h.sum(-2) / attention_mask.sum(-1, keepdim=True)
        return {"hidden": h, "logits": self.head(pooled)}


class _PairNet(nn.Module):
    """A network of two positional inputs returning a tuple."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, a, b):
        out = self.fc(a + b)
        return out, out.sum(-1)


class _TokenLM(nn.Module):
    def __init__(self, vocab=7):
        super().__init__()
        self.embed = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.head(self.embed(input_ids))}


def _tokens(rows=4, length=5, vocab=10):
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, 3:] = 0
    return {"input_ids": torch.randint(0, vocab, (rows, length)), "attention_mask": mask}


def test_classifier_takes_a_mapping_batch_and_reads_the_logits():
    net = bayesianize(_TokenClassifier())
    model = models.classifier(net, dataset_size=40)
    batch, y = _tokens(), torch.tensor([0, 1, 2, 0])
    tr = poutine.trace(model).get_trace(batch, y)
    assert tr.nodes["y"]["scale"] == pytest.approx(10.0)
    weights = {n: s["value"] for n, s in tr.nodes.items() if s["type"] == "sample"}
    expected = poutine.condition(net, data=weights)(**batch)
    assert torch.equal(tr.nodes["_RETURN"]["value"], expected["logits"])
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 3\)"):
        model(batch, torch.tensor([0, 1, 2, 3]))


def test_output_selector_by_index_name_and_callable():
    net = bayesianize(_PairNet())
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    first = models.classifier(net, 10)((a, b))
    assert first.shape == (5, 2)
    summed = models.regressor(net, 10, noise_scale=1.0, output=1)((a, b), torch.randn(5))
    assert summed.shape == (5,)
    picked = models.classifier(net, 10, output=lambda out: out[0] * 2)((a, b))
    assert picked.shape == (5, 2)
    with pytest.raises(TypeError, match=r"output=-3, but the network returned tuple of 2"):
        models.classifier(net, 10, output=-3)((a, b))
    hidden = models.classifier(bayesianize(_TokenClassifier()), 10, output="hidden")
    with pytest.raises(ValueError, match=r"shape \(4, C\)"):
        hidden(_tokens())


@pytest.mark.parametrize(
    "batch, output, error, match",
    [
        (
            {**_tokens(), "input_ids": torch.zeros(3, 5, dtype=torch.long)},
            None,
            ValueError,
            "same number of rows",
        ),
        (
            {**_tokens(), "labels": torch.zeros(4, dtype=torch.long)},
            None,
            ValueError,
            r"batch.pop\('labels'\)",
        ),
        ({**_tokens(), "attention_mask": None}, None, TypeError, r"x\['attention_mask'\] must be"),
        ({}, None, ValueError, "empty dict"),
        ("text", None, TypeError, "mapping of tensors"),
        (_tokens(), "pooled", TypeError, r"dict with keys \['hidden', 'logits'\]"),
        (_tokens(), 1.5, TypeError, "output must be None"),
    ],
)
def test_structured_batch_and_output_mismatches_are_refused(batch, output, error, match):
    pyro.clear_param_store()
    with pytest.raises(error, match=match):
        model = models.classifier(bayesianize(_TokenClassifier()), 10, output=output)
        model(batch, torch.tensor([0, 1, 2, 0]))
    assert not list(pyro.get_param_store().keys())


def test_non_finite_entry_of_a_structured_batch_is_refused():
    model = models.classifier(bayesianize(_PairNet()), 10)
    a = torch.randn(2, 3)
    a[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"x\[0\] contains 1 non-finite"):
        model((a, torch.randn(2, 3)))


def _token_log_prob(logits, labels, scored):
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * scored).sum(-1)


@pytest.mark.parametrize("shift", [True, False])
def test_language_model_scores_next_tokens_under_the_mask_and_ignore_index(shift):
    net = bayesianize(_TokenLM())
    model = models.language_model(net, dataset_size=8, shift=shift)
    batch = _tokens(vocab=7)
    y = batch["input_ids"].clone()
    y[1, 1] = -100
    tr = poutine.trace(model).get_trace(batch, y)
    tr.compute_log_prob()
    site = tr.nodes["y"]
    assert site["scale"] == pytest.approx(2.0)
    logits = tr.nodes["_RETURN"]["value"]
    assert logits.shape == (4, 5, 7)
    scored = (batch["attention_mask"] == 1) & (y != -100)
    if shift:
        logits, y, scored = logits[:, :-1], y[:, 1:], scored[:, 1:]
    torch.testing.assert_close(site["unscaled_log_prob"], _token_log_prob(logits, y, scored))


def test_language_model_refuses_mismatched_labels_and_runs_vectorized():
    model = models.language_model(bayesianize(_TokenLM()), dataset_size=8)
    batch = _tokens(vocab=7)
    with pytest.raises(ValueError, match=r"y has 4 positions but the network gives logits for 5"):
        model(batch, batch["input_ids"][:, :4])
    with pytest.raises(ValueError, match=r"token labels must lie in \[0, 7\) or be -100"):
        model(batch, batch["input_ids"] + 7)
    with pytest.raises(ValueError, match=r"integer token labels of shape \(B, T\)"):
        model(batch, batch["input_ids"].float())
    with pyro.plate("particles", 3, dim=-2):
        tr = poutine.trace(model).get_trace(batch, batch["input_ids"])
    tr.compute_log_prob()
    assert tr.nodes["y"]["log_prob"].shape == (3, 4)


def test_language_model_takes_a_batch_where_no_token_is_scored():
    # Every label -100, or one-token sequences under next-token prediction (a prompt of one
    # token): the likelihood is 0, not an error.
    net = bayesianize(_TokenLM())
    batch = _tokens(vocab=7)
    one = {k: v[:, :1] for k, v in batch.items()}
    for model, x, y in (
        (models.language_model(net, dataset_size=8), batch, torch.full((4, 5), -100)),
        (models.language_model(net, dataset_size=8, shift=False), batch, torch.full((4, 5), -100)),
        (models.language_model(net, dataset_size=8), one, one["input_ids"]),
    ):
        assert poutine.trace(model).get_trace(x).nodes["_RETURN"]["value"].shape[:2] == y.shape
        tr = poutine.trace(model).get_trace(x, y)
        tr.compute_log_prob()
        assert torch.equal(tr.nodes["y"]["unscaled_log_prob"], torch.zeros(4))


def test_token_ids_outside_the_first_embedding_are_refused_before_the_network_runs():
    # The embedding would raise "index out of range in self" (on a GPU, a device-side assert
    # that ends the process) after the weights were drawn.
    model = models.classifier(bayesianize(nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))), 8)
    model(torch.tensor([0, 4]), torch.tensor([1, 0]))
    state = torch.get_rng_state()
    for bad, got in ((5, r"min 4, max 5"), (-1, r"min -1, max 4")):
        with pytest.raises(ValueError, match=rf"x must hold token ids in \[0, 5\).*{got}"):
            model(torch.tensor([bad, 4]), torch.tensor([1, 0]))
    assert torch.equal(torch.get_rng_state(), state)


def _copies():
    def through_torch_save(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return {
        "copy": copy.copy,
        "deepcopy": copy.deepcopy,
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "torch.save": through_torch_save,
    }


@pytest.mark.parametrize("clone", _copies().values(), ids=_copies().keys())
def test_a_copy_of_a_live_model_has_its_own_name_and_point_sigma(clone):
    model = models.regressor(bayesianize(nn.Linear(3, 1)), dataset_size=10, noise="point")
    x, y = torch.randn(10, 3), torch.randn(10)
    model(x, y)
    store = pyro.get_param_store()
    store[model.param_names[0]] = torch.tensor(0.7)
    twin = clone(model)
    # The copy shared the name, so its σ was the original's param in the param store.
    assert twin.name != model.name and twin.param_names != model.param_names
    assert twin.noise_scale == pytest.approx(0.7)
    pyro.set_rng_seed(1)
    expected = model(x, y)
    pyro.set_rng_seed(1)
    assert torch.equal(twin(x, y), expected)
    store[twin.param_names[0]] = torch.tensor(2.0)  # training the copy changes its σ alone
    assert model.noise_scale == pytest.approx(0.7) and twin.noise_scale == pytest.approx(2.0)
    with pytest.raises(ValueError, match="is taken by another live model"):
        models.regressor(bayesianize(nn.Linear(3, 1)), 10, noise="point", name=twin.name)


def test_a_model_unpickled_where_its_name_is_free_keeps_it():
    # As in a run resumed in another program: a checkpoint's params match by this name.
    model = models.regressor(bayesianize(nn.Linear(3, 1)), dataset_size=10, noise="point")
    name, blob = model.name, pickle.dumps(model)
    del model
    loaded = pickle.loads(blob)
    assert loaded.name == name
    # ... and holds it: a model built later cannot share its point σ.
    with pytest.raises(ValueError, match="is taken by another live model"):
        models.regressor(bayesianize(nn.Linear(3, 1)), 10, noise="point", name=name)


def test_integer_inputs_are_refused_without_suggesting_an_integer_network():
    # The message suggested net.to(torch.int64), which nn.Module.to refuses.
    model, y = _classifier(), torch.randint(0, 4, (6,))
    with pytest.raises(TypeError, match=r"Use x\.to\(torch\.float32\)\.$"):
        model(torch.randint(0, 5, (6, 3)), y)
    with pytest.raises(TypeError, match=r"net\.to\(torch\.float64\) before creating the model"):
        model(torch.randn(6, 3, dtype=torch.float64), y)


def test_a_model_on_the_meta_device_is_refused_with_the_fix():
    # Its batch checks read values a meta tensor has not: torch's "Cannot copy out of meta
    # tensor; no data!", and the device error proposed y.to('meta').
    net = bayesianize(nn.Linear(3, 4)).to("meta")
    model = models.classifier(net, dataset_size=10)
    x, y = torch.randn(4, 3, device="meta"), torch.randint(0, 4, (4,))
    with pytest.raises(ValueError, match=r"x is on the meta device.*real device"):
        model(x)
    with pytest.raises(
        ValueError, match=r"y is on device cpu but the network is on meta.*to_empty"
    ):
        model(x, y)


def test_a_fixed_noise_scale_tensor_that_requires_grad_or_holds_several_is_refused():
    # float() cut a σ that requires grad from its graph (it stayed fixed, with only torch's
    # one-time warning), and several σ met float()'s "only one element tensors can be
    # converted to Python scalars".
    net = bayesianize(nn.Linear(3, 1))
    learnable = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(TypeError, match=r"noise_scale must be a fixed number.*noise='point'"):
        models.regressor(net, 10, noise_scale=learnable)
    with pytest.raises(ValueError, match=r"noise_scale must be one number σ.*\(2,\).*heterosced"):
        models.regressor(net, 10, noise_scale=torch.tensor([0.5, 0.6]))
    # A point σ's start is only a value: any one-number tensor will do.
    assert models.regressor(net, 10, learnable, noise="point").noise_scale == 0.5


class _OpaqueClassifier(nn.Module):
    """A network whose last layer the model cannot see (not an ``nn.Sequential``): the output
    width, and so the label range, is known only after its first forward pass."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x)


def test_labels_of_an_opaque_network_are_checked_against_the_width_of_its_output():
    model = models.classifier(bayesianize(_OpaqueClassifier()), dataset_size=100)
    assert model.shape.outputs is None
    x = torch.randn(4, 3)
    # Label 4 of 4 classes is one past the last: refused by the model, not by torch's gather.
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 4\); got min 0, max 4"):
        model(x, torch.tensor([0, 1, 2, 4]))
    model(x, torch.tensor([0, 1, 2, 3]))  # the last class itself is in range


def test_a_refused_gaussian_step_after_the_first_changes_no_random_stream_nor_running_stats():
    # The range check of a Gaussian likelihood reads the network's output, so every call that
    # scores one (not only the first) runs under rollback.
    net = bayesianize(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
    model = models.regressor(net, dataset_size=100, noise_scale=1.0)
    x = torch.randn(6, 3)
    model(x, torch.randn(6))  # the first call, whose output shape is checked
    stats = [b.clone() for b in net[1].buffers()]
    rng = torch.get_rng_state()
    # Finite targets whose square overflows float32 (3e19² = 9e38 > 3.4e38).
    with pytest.raises(ValueError, match=r"overflows torch\.float32"):
        model(x, torch.full((6,), 3e19))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, old) for b, old in zip(net[1].buffers(), stats))


def test_a_token_label_equal_to_the_vocabulary_size_is_refused_on_every_call():
    # V = 7: label 7 is one past the last token. The first call checks it after the forward
    # pass (the opaque network's width is unknown before), later ones before it.
    model = models.language_model(bayesianize(_TokenLM()), dataset_size=8)
    batch = _tokens(vocab=7)
    bad = batch["input_ids"].clone()
    bad[1, 2] = 7  # a scored position: row 1 is unmasked, and position 2 is past the shift
    match = r"token labels must lie in \[0, 7\) or be -100 \(skipped\); got min \d, max 7"
    with pytest.raises(ValueError, match=match):
        model(batch, bad)
    model(batch, batch["input_ids"])
    with pytest.raises(ValueError, match=match):
        model(batch, bad)


def test_a_16_bit_network_is_scored_and_returned_in_float32():
    # A sum of many log-probabilities in bfloat16 (8 bits of mantissa) would round to a
    # multiple of a power of two; the model scores and returns float32.
    net = bayesianize(nn.Linear(3, 4).to(torch.bfloat16))
    model = models.classifier(net, dataset_size=10)
    x, y = torch.randn(5, 3, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 3, 0])
    tr = poutine.trace(model).get_trace(x, y)
    out = tr.nodes["_RETURN"]["value"]
    assert out.dtype == torch.float32
    assert tr.nodes["y"]["fn"].log_prob(y).dtype == torch.float32
    assert model.prediction(x).dtype == torch.float32


def test_a_first_call_refused_after_the_forward_pass_leaves_no_param_behind():
    # The point σ's param is created before the range check refuses the targets; the refusal
    # must take it back out of the param store, as every check promises.
    pyro.clear_param_store()
    model = models.regressor(bayesianize(nn.Linear(3, 1)), 10, noise="point", noise_scale=0.5)
    with pytest.raises(ValueError, match=r"overflows torch\.float32"):
        model(torch.randn(4, 3), torch.full((4,), 3e19))
    assert model.param_names[0] not in pyro.get_param_store()
    model(torch.randn(4, 3), torch.randn(4))
    assert model.param_names[0] in pyro.get_param_store()


def test_a_negative_output_index_counts_from_the_end_as_in_python():
    a, b = torch.randn(2), torch.randn(3)
    assert select_output((a, b), -1) is b and select_output((a, b), -2) is a
    assert select_output({"logits": a, "hidden": b}, -1) is b
    with pytest.raises(TypeError, match=r"output=-3, but the network returned tuple of 2"):
        select_output((a, b), -3)


def test_a_fixed_sigma_follows_the_network_to_float64():
    net = bayesianize(nn.Linear(3, 1))
    model = models.regressor(net, dataset_size=10, noise_scale=0.1)
    model(torch.randn(4, 3), torch.randn(4))  # σ made once for float32
    net.double()
    tr = poutine.trace(model).get_trace(torch.randn(4, 3).double(), torch.randn(4).double())
    scale = tr.nodes["y"]["fn"].scale
    # 0.1 in float32 is 0.10000000149: a float64 model would score a σ that is off by 1.5e-8.
    assert scale.dtype == torch.float64 and scale.unique().tolist() == [0.1]


class _TwoCopies(nn.Module):
    """A network whose output has a leading dim of 2 that no plate made."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        out = self.fc(x)
        return torch.stack([out, out])


def test_an_output_with_a_leading_dim_outside_any_plate_is_refused():
    # Only a plate (particles, parallel draws) may add leading dims; else the likelihood would
    # broadcast (2, B) terms into the data plate and count every example twice.
    model = models.classifier(bayesianize(_TwoCopies()), dataset_size=10)
    with pytest.raises(ValueError, match=r"a classifier needs network outputs of shape \(5, C\)"):
        model(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
