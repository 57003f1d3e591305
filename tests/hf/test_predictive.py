"""``predictive.sample_outputs`` on a Hugging Face network: a dict batch passed as keyword
arguments and a ``ModelOutput`` reduced to its logits, through the model's own output path."""

import warnings

import pytest
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta
from torch.testing import assert_close

from tests.common import rows_per_forward
from tests.hf import tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB, CLASSES, ROWS = 50, 2, 5


def _lora_bert():
    config = tiny_bert_config(VOCAB, CLASSES)
    net = transformers.BertForSequenceClassification(config).eval()
    lora = peft.LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net = peft.get_peft_model(net, lora).eval()
    return bdl.bayesianize(net, expose=bdl.nn.lora)


@pytest.mark.parametrize("parallel", [True, False])
def test_sample_outputs_takes_a_dict_batch_and_reads_the_logits(parallel):
    torch.manual_seed(0)
    model = bdl.models.classifier(_lora_bert(), 64)
    batch = {
        "input_ids": torch.randint(1, VOCAB, (ROWS, 7)),
        "attention_mask": torch.ones(ROWS, 7, dtype=torch.long),
    }
    batch["attention_mask"][0, 5:] = 0
    guide = bdl.guides.AutoMeanField(model)
    guide(batch, torch.arange(ROWS) % CLASSES)
    out = bdl.predictive.sample_outputs(model, guide, batch, num_samples=3, parallel=parallel)
    assert out.shape == (3, ROWS, CLASSES)
    # Each draw is the network's logits at that draw's weights: replay the first one.
    torch.manual_seed(1)
    draws = bdl.predictive.sample_outputs(model, guide, batch, num_samples=1, parallel=parallel)
    torch.manual_seed(1)
    trace = poutine.trace(guide).get_trace(batch)
    expected = poutine.replay(model.net, trace=trace)(**batch).logits
    assert_close(draws[0], expected)
    # Distinct draws differ: the LoRA matrices are random (mean-field scales start > 0).
    assert not torch.allclose(out[0], out[1])


def _batch():
    batch = {
        "input_ids": torch.randint(1, VOCAB, (ROWS, 7)),
        "attention_mask": torch.ones(ROWS, 7, dtype=torch.long),
    }
    batch["attention_mask"][0, 5:] = 0
    return batch


def test_sample_outputs_checks_memory_on_one_row_of_a_dict_batch():
    torch.manual_seed(0)
    model = bdl.models.classifier(_lora_bert(), 64)
    batch = _batch()
    guide = bdl.guides.AutoMeanField(model)
    guide(batch, torch.arange(ROWS) % CLASSES)
    rows, handle = rows_per_forward(model.net)
    try:
        out = bdl.predictive.sample_outputs(model, guide, batch, num_samples=4)
        assert out.shape == (4, ROWS, CLASSES) and rows == [1, ROWS]
        rows.clear()
        bdl.predictive.sample_outputs(model, guide, batch, num_samples=1)
        assert rows == [ROWS]
        # The bound is on the whole batch's outputs: 4 · ROWS · CLASSES float32 numbers.
        with pytest.raises(ValueError, match=f"need {4 * ROWS * CLASSES * 4} bytes"):
            bdl.predictive.sample_outputs(model, guide, batch, num_samples=4, max_memory=100)
    finally:
        handle.remove()


def test_adapter_ensemble_member_outputs_are_one_pass_and_each_members_own():
    torch.manual_seed(0)
    model = bdl.models.classifier(_lora_bert(), 64)
    batch, y = _batch(), torch.arange(ROWS) % CLASSES
    delta = AutoDelta(model)
    delta(batch, y)
    base = delta.median()
    members = [{k: v + 0.3 * torch.randn_like(v) for k, v in base.items()} for _ in range(3)]
    guide = bdl.guides.AutoEnsemble(model, members)
    guide(batch, y)
    rows, handle = rows_per_forward(model.net)
    try:
        out = guide.member_outputs(model, batch)
        assert out.shape == (3, 1, ROWS, CLASSES) and rows == [1, ROWS]
        rows.clear()
        sequential = guide.member_outputs(model, batch, parallel=False)
        assert rows == [ROWS] * 3
    finally:
        handle.remove()
    assert torch.equal(out, sequential)  # member m's draw is member m's, in either pass
    for k, values in enumerate(members):
        expected = poutine.condition(model.net, data=values)(**batch).logits
        assert_close(out[k, 0], expected)
    assert not torch.allclose(out[0], out[1])
