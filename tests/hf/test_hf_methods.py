"""The Hugging Face and PEFT methods a lifted network refuses: saving and merging adapters
trained as random sites (``save_pretrained``, ``merge_and_unload``), which after
``bdl.nn.unlift(net, values)`` save and merge exactly those values, and gradient checkpointing."""

import pickle
import warnings

import pytest
import torch
from pyro import poutine
from torch.testing import assert_close

from tests.hf import lora_bert, tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB = 30


def _lifted(expose=bdl.nn.lora_and_head):
    torch.manual_seed(0)
    return bdl.bayesianize(lora_bert(tiny_bert_config(VOCAB), rank=2), expose=expose)


def _batch():
    ids = torch.randint(1, VOCAB, (3, 5))
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("method", ["save_pretrained", "merge_and_unload", "merge_adapter"])
def test_peft_methods_that_read_the_adapters_are_refused_on_the_lifted_network(method, tmp_path):
    net = _lifted()
    batch = _batch()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    args = (tmp_path / "adapter",) if method == "save_pretrained" else ()
    with pytest.raises(RuntimeError, match=rf"{method} on a network lifted.*bdl\.nn\.unlift"):
        getattr(net, method)(*args)
    assert not (tmp_path / "adapter").exists()
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    data = {n: s.init_value for n, s in bdl.sites(net).items()}
    assert poutine.condition(net, data=data)(**batch).logits.shape == (3, 2)


def test_unlift_saves_the_posterior_mean_and_from_pretrained_loads_it(tmp_path):
    net = _lifted()
    batch = _batch()
    ivon = bdl.infer.IVON(bdl.models.classifier(net, 20), dataset_size=20, lr=0.1)
    ivon.step(batch, torch.tensor([0, 1, 1]))
    values = ivon.guide.median()  # the adapters' and head's posterior mean
    assert not any(torch.equal(values[n], s.init_value) for n, s in bdl.sites(net).items())
    expected = poutine.condition(net, data=values)(**batch).logits
    bdl.nn.unlift(net, values)
    with pytest.raises(ValueError, match="no Bayesian sites"):
        bdl.sites(net)
    assert_close(net(**batch).logits, expected)
    with warnings.catch_warnings():
        # PEFT before 0.21 looks on the Hub for the config of a model built from a config (its
        # name is "") and warns when it cannot tell; the embeddings here are not adapted.
        warnings.filterwarnings("ignore", "Could not find a config file", UserWarning)
        net.save_pretrained(tmp_path)
    torch.manual_seed(0)  # the same random base, with PEFT's fresh adapters
    base = transformers.BertForSequenceClassification(tiny_bert_config(VOCAB)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        loaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    assert_close(loaded(**batch).logits, expected)
    assert_close(net.merge_and_unload()(**batch).logits, expected)


def test_unlift_keeps_initial_locations_left_out_and_lifts_again():
    net = _lifted(bdl.nn.lora)
    batch = _batch()
    names = list(bdl.sites(net))
    keep = {n: s.init_value.clone() for n, s in bdl.sites(net).items()}
    values = {names[0]: keep[names[0]] + 1.0}
    bdl.nn.unlift(net, values)
    params = dict(net.named_parameters())
    assert torch.equal(params[names[0]], keep[names[0]] + 1.0)
    assert all(torch.equal(params[n], keep[n]) for n in names[1:])
    out = net(**batch).logits
    bdl.bayesianize(net, expose=bdl.nn.lora)
    assert list(bdl.sites(net)) == names
    data = {n: s.init_value for n, s in bdl.sites(net).items()}
    assert_close(poutine.condition(net, data=data)(**batch).logits, out)
    with pytest.raises(RuntimeError, match=r"bdl\.nn\.unlift"):
        net.merge_and_unload()


def test_unlift_refuses_wrong_values_before_anything_changes():
    net = _lifted(bdl.nn.lora)
    name = next(iter(bdl.sites(net)))
    shape = tuple(bdl.sites(net)[name].shape)
    with pytest.raises(ValueError, match=r"values names \['sigma'\].*Drop them"):
        bdl.nn.unlift(net, {"sigma": torch.ones(())})
    with pytest.raises(ValueError, match=rf"values\['{name}'\] must be a tensor .*{shape}"):
        bdl.nn.unlift(net, {name: torch.zeros(1)})
    with pytest.raises(TypeError, match="values must map site names"):
        bdl.nn.unlift(net, [torch.zeros(shape)])
    assert len(bdl.sites(net)) == 4
    with pytest.raises(ValueError, match="unlift expects a network lifted by bayesianize"):
        bdl.nn.unlift(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"got NetworkModel\. .* model\.net"):
        bdl.nn.unlift(bdl.models.classifier(net, 20))


def test_gradient_checkpointing_turned_on_after_lifting_is_refused():
    net = _lifted()
    net.train()
    bert = net.base_model.model
    enable = getattr(type(bert), "activation_checkpointing_enable", None)  # transformers >= 5
    name = "activation_checkpointing_enable" if enable else "gradient_checkpointing_enable"
    with pytest.raises(RuntimeError, match=rf"{name} on a network lifted.*freshly drawn"):
        getattr(net, name)()  # PEFT forwards it to the transformers model
    assert not _checkpointing(net)
    bdl.nn.unlift(net)
    getattr(net, name)()
    assert _checkpointing(net)


def _checkpointing(net):
    return any(m.__dict__.get("gradient_checkpointing") is True for m in net.modules())


def test_a_pickled_lifted_network_keeps_its_refusals_and_unlifts():
    net = _lifted(bdl.nn.lora)
    batch = _batch()
    data = {n: s.init_value for n, s in bdl.sites(net).items()}
    expected = poutine.condition(net, data=data)(**batch).logits
    twin = pickle.loads(pickle.dumps(net))
    with pytest.raises(RuntimeError, match="merge_and_unload on a network lifted"):
        twin.merge_and_unload()
    bdl.nn.unlift(twin)
    assert_close(twin.merge_and_unload()(**batch).logits, expected)
    with pytest.raises(RuntimeError, match="merge_and_unload on a network lifted"):
        net.merge_and_unload()  # the original is still lifted


def test_unlift_keeps_a_tied_language_model_head_tied():
    torch.manual_seed(0)
    net = bdl.bayesianize(transformers.BertForMaskedLM(tiny_bert_config(VOCAB)).eval())
    batch = _batch()
    values = {n: s.init_value + 0.01 * torch.randn(s.shape) for n, s in bdl.sites(net).items()}
    expected = poutine.condition(net, data=values)(**batch).logits
    bdl.nn.unlift(net, values)
    assert net.cls.predictions.decoder.weight is net.bert.embeddings.word_embeddings.weight
    plain = transformers.BertForMaskedLM(tiny_bert_config(VOCAB)).eval()
    plain.load_state_dict(net.state_dict())
    assert_close(plain(**batch).logits, expected)
