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
