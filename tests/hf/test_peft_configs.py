"""PEFT LoRA configurations a user fine-tunes with, each lifted by ``expose=bdl.nn.lora``: the
lifted network at its initial locations gives the PEFT model's outputs exactly, only the
adapter tensors become sites, and one mean-field step runs."""

import warnings

import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.optim import Adam

from tests.hf import tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB, ROWS = 30, 3
QV = ["query", "value"]


def _peft_bert(**options):
    torch.manual_seed(0)
    net = transformers.BertForSequenceClassification(tiny_bert_config(VOCAB)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net = peft.get_peft_model(net, peft.LoraConfig(r=2, task_type="SEQ_CLS", **options))
    for name, p in net.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            torch.nn.init.normal_(p, std=0.3)  # PEFT starts B at zero
    ids = torch.randint(1, VOCAB, (ROWS, 5))
    return net.eval(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(
    "options, sites",
    [
        (dict(target_modules="all-linear"), 14),  # q, k, v, 3 dense, the pooler; not the head
        (dict(target_modules=["query", "key", "value", "dense"]), 14),
        (dict(target_modules=QV, bias="lora_only"), 4),  # the biases stay point estimates
        (dict(target_modules=QV, bias="all"), 4),
        (dict(target_modules=QV, use_dora=True), 6),  # and the magnitude vectors
        (dict(target_modules=QV, use_rslora=True), 4),
        (dict(target_modules=QV, lora_dropout=0.1), 4),
        (dict(target_modules=["word_embeddings", "query"]), 4),
    ],
    ids=["all_linear", "qkv_dense", "bias_lora_only", "bias_all", "dora", "rslora", "dropout",
         "embedding"],
)  # fmt: skip
def test_lora_configuration_lifts_exactly_and_steps(options, sites):
    net, batch = _peft_bert(**options)
    expected = net(**batch).logits
    bdl.bayesianize(net, expose=bdl.nn.lora)
    names = list(bdl.sites(net))
    assert len(names) == sites and all(".lora_" in n for n in names), names
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    assert torch.equal(poutine.condition(net, data=data)(**batch).logits, expected)
    model = bdl.models.classifier(net, 20)
    guide = bdl.guides.AutoMeanField(model)
    loss = SVI(model, guide, Adam({"lr": 1e-2}), Trace_ELBO()).step(batch, torch.tensor([0, 1, 0]))
    assert torch.isfinite(torch.tensor(loss))


def test_vogn_refuses_dora_naming_ivon_and_changes_nothing():
    # DoRA applies its LoRA matrices to an identity matrix too, which has no per-example form.
    net, batch = _peft_bert(target_modules=QV, use_dora=True)
    model = bdl.models.classifier(bdl.bayesianize(net, expose=bdl.nn.lora), 20)
    y = torch.tensor([0, 1, 0])
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=r"identity matrix\) has no per-example form.*IVON"):
        bdl.infer.VOGN(model, dataset_size=20, lr=0.05).step(batch, y)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    ivon = bdl.infer.IVON(model, dataset_size=20, lr=0.05)
    assert torch.isfinite(torch.tensor(ivon.step(batch, y)))


def test_adalora_lifts_exactly_and_its_in_place_update_is_refused_vectorized():
    torch.manual_seed(0)
    net = transformers.BertForSequenceClassification(tiny_bert_config(VOCAB)).eval()
    config = peft.AdaLoraConfig(
        init_r=2, target_r=1, target_modules=QV, task_type="SEQ_CLS", total_step=10
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net = peft.get_peft_model(net, config).eval()
    for name, p in net.named_parameters():
        if "lora_B" in name or "lora_E" in name:
            torch.nn.init.normal_(p, std=0.3)  # AdaLoRA starts B and E at zero
    ids = torch.randint(1, VOCAB, (ROWS, 5))
    batch, y = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.tensor([0, 1, 0])
    expected = net(**batch).logits
    bdl.bayesianize(net, expose=bdl.nn.lora)
    assert len(bdl.sites(net)) == 6  # A, B and the singular values E of query and value
    data = {name: spec.init_value for name, spec in bdl.sites(net).items()}
    assert torch.equal(poutine.condition(net, data=data)(**batch).logits, expected)
    model = bdl.models.classifier(net, 20)
    guide = bdl.guides.AutoMeanField(model)
    assert torch.isfinite(torch.tensor(SVI(model, guide, Adam({}), Trace_ELBO()).step(batch, y)))
    # AdaLoRA adds its update in place (result += ...) to the base layer's shared output.
    vectorized = Trace_ELBO(num_particles=2, vectorize_particles=True)
    with pytest.raises(RuntimeError, match=r"updates in place.*vectorize_particles=False"):
        SVI(model, guide, Adam({}), vectorized).step(batch, y)
