"""Tests of the Hugging Face path; :func:`tiny_bert_config` is their one small random BERT."""

from __future__ import annotations

from typing import Any


def tiny_bert_config(vocab_size: int, num_labels: int = 2, **extra: Any) -> Any:
    """A one-layer BERT with 16 hidden units and eager attention (vectorized draws: SDPA has no
    vmap rule on the CPU); ``extra`` overrides any field."""
    import transformers

    fields = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        vocab_size=vocab_size,
        num_labels=num_labels,
        attn_implementation="eager",
    )
    return transformers.BertConfig(**{**fields, **extra})


def lora_bert(config: Any, rank: int = 8, dtype: Any = None) -> Any:
    """``BertForSequenceClassification(config)`` (in ``dtype``, default float32) with PEFT LoRA
    adapters of ``rank`` on query and value, in eval mode, every B random (PEFT starts B at
    zero, where every A has no gradient)."""
    import warnings

    import peft
    import torch
    import transformers

    net = transformers.BertForSequenceClassification(config).to(dtype or torch.float32).eval()
    lora = peft.LoraConfig(r=rank, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's, not ours
        net = peft.get_peft_model(net, lora).eval()
    for name, p in net.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    return net
