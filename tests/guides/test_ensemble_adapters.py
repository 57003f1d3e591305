"""A deep ensemble of LoRA adapters over one frozen base: the guide holds M adapters and no copy
of the base, whose weights every member's forward pass shares."""

from __future__ import annotations

import pytest
import torch
from pyro.infer.autoguide import AutoDelta

import pyro_bdl as bdl
from tests.hf import lora_bert, tiny_bert_config

pytest.importorskip("transformers")
pytest.importorskip("peft")

M, ROWS, VOCAB = 3, 4, 50


def test_adapter_ensemble_holds_m_adapters_and_one_base():
    torch.manual_seed(0)
    net = bdl.bayesianize(lora_bert(tiny_bert_config(VOCAB), rank=2), expose=bdl.nn.lora)
    model = bdl.models.classifier(net, 64)
    batch = {
        "input_ids": torch.randint(1, VOCAB, (ROWS, 7)),
        "attention_mask": torch.ones(ROWS, 7, dtype=torch.long),
    }
    y = torch.arange(ROWS) % 2
    delta = AutoDelta(model)
    delta(batch, y)
    start = delta.median()
    members = [{k: v + 0.1 * torch.randn_like(v) for k, v in start.items()} for _ in range(M)]
    guide = bdl.guides.AutoEnsemble(model, members)
    guide(batch, y)
    adapter = sum(v.numel() for v in start.values())
    # The frozen base stays in the network, as parameters or as buffers bayesianize made of them.
    base = sum(t.numel() for t in [*net.parameters(), *net.buffers()] if t.is_floating_point())
    assert adapter < base / 10  # the test tells the two apart
    # Memory: M adapters in the guide, and the base once, in the network.
    assert list(guide.parameters()) == []
    assert {k: v.numel() for k, v in guide.state_dict().items()} == {"ensemble_locs": M * adapter}
    # The members share the base: their outputs differ by their adapters alone.
    out = guide.member_outputs(model, batch)
    assert out.shape[:2] == (M, 1) and not torch.allclose(out[0], out[1])
