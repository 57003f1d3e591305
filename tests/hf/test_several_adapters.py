"""A PEFT model holding several adapters: ``bdl.nn.lora`` makes only the active adapter random
(the others are never read, and random sites there broke the vectorized passes), and switching
adapters on the lifted network is refused, with the way to lift another adapter."""

import warnings

import pytest
import torch
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoDelta

from tests.hf import lora_bert, tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import pyro_bdl as bdl  # noqa: E402

VOCAB, ROWS = 30, 3


def _two_adapters():
    torch.manual_seed(0)
    net = lora_bert(tiny_bert_config(VOCAB), rank=2)
    config = peft.LoraConfig(r=3, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net.add_adapter("other", config)
    return net.eval()


def _batch():
    ids = torch.randint(1, VOCAB, (ROWS, 5))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("expose", [bdl.nn.lora, bdl.nn.lora_and_head])
def test_only_the_active_adapter_becomes_random(expose):
    net = bdl.bayesianize(_two_adapters(), expose=expose)
    names = list(bdl.sites(net))
    assert len(names) == (4 if expose is bdl.nn.lora else 6)
    assert all(".default." in n for n in names), names
    assert any(".other." in n for n, _ in net.named_buffers())  # frozen, as PEFT left it


def test_parallel_prediction_over_the_active_adapter():
    model = bdl.models.classifier(bdl.bayesianize(_two_adapters(), expose=bdl.nn.lora), 20)
    batch = _batch()
    guide = AutoDelta(model, init_loc_fn=bdl.nn.init_to_network)
    guide(batch, torch.arange(ROWS) % 2)
    draws = Predictive(model, guide=guide, num_samples=3, parallel=True)(batch)
    assert draws["y"].shape == (3, ROWS)


def test_set_adapter_is_refused_and_unlift_lets_another_adapter_be_lifted():
    net = bdl.bayesianize(_two_adapters(), expose=bdl.nn.lora)
    with pytest.raises(RuntimeError, match=r"set_adapter on a network lifted.*bdl\.nn\.unlift"):
        net.set_adapter("other")
    assert net.active_adapters == ["default"]
    bdl.nn.unlift(net)
    net.set_adapter("other")
    names = list(bdl.sites(bdl.bayesianize(net, expose=bdl.nn.lora)))
    assert len(names) == 4 and all(".other." in n for n in names), names
