"""Which parameters the ``bdl.nn.lora`` / ``bdl.nn.lora_and_head`` rules make random, read name by
name: a LoRA tensor is one under a ``lora_*`` part, a head one under a ``modules_to_save`` part
(whole parts, not substrings), and an inactive adapter is left out by its whole name, not by a
prefix of it."""

import warnings

import pytest
import torch
from torch import nn

import pyro_bdl as bdl
from tests.hf import lora_bert, tiny_bert_config


class _HeadWrapper(nn.Module):
    """A task head as PEFT before 0.18 wrapped it: the copies under ``modules_to_save``, one
    ``active_adapter`` name and no ``adapter_layer_names``; the inactive copy stays fixed."""

    def __init__(self):
        super().__init__()
        self.modules_to_save = nn.ModuleDict({"head": nn.Linear(2, 2), "other": nn.Linear(2, 2)})
        self.active_adapter = "head"

    def forward(self, x):
        return self.modules_to_save["head"](x)


class _Named(nn.Module):
    """Linear layers named like PEFT's containers, and look-alikes that are not ones."""

    def __init__(self):
        super().__init__()
        self.lora_A = nn.Linear(3, 2)  # a LoRA container: random
        self.lorax = nn.Linear(2, 2)  # a "lora" prefix without the underscore: fixed
        self.old_modules_to_save = nn.Linear(2, 2)  # the word inside a part: fixed
        self.classifier = _HeadWrapper()

    def forward(self, x):
        return self.classifier(self.old_modules_to_save(self.lorax(self.lora_A(x))))


def test_lora_rules_read_whole_name_parts_not_prefixes_or_substrings():
    lora = set(bdl.sites(bdl.bayesianize(_Named(), expose=bdl.nn.lora)))
    assert lora == {"lora_A.weight", "lora_A.bias"}
    both = set(bdl.sites(bdl.bayesianize(_Named(), expose=bdl.nn.lora_and_head)))
    assert both == lora | {f"classifier.modules_to_save.head.{p}" for p in ("weight", "bias")}


def test_an_inactive_adapter_whose_name_prefixes_the_active_one_leaves_it_random():
    # The inactive "default" must not hide the active "default2" (a bare prefix test would).
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    net = lora_bert(tiny_bert_config(30), rank=2)
    config = peft.LoraConfig(r=3, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net.add_adapter("default2", config)
    net.set_adapter("default2")
    names = list(bdl.sites(bdl.bayesianize(net.eval(), expose=bdl.nn.lora)))
    assert len(names) == 4 and all(".default2." in n for n in names), names
