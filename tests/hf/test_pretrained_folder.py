"""all-MiniLM-L6-v2 from a folder (``path=`` or ``$PYRO_BDL_MINILM``) and the float16 copy of
:func:`pyro_bdl.nn.pretrained.save_minilm_fp16`, on a tiny random BERT saved to a temporary
folder (the real model's files are not needed)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from pyro_bdl.nn import pretrained  # noqa: E402

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "a"]


@pytest.fixture
def tiny_folder(tmp_path):
    """A random 1-layer BERT (float32) and a word-piece tokenizer, saved as from_pretrained
    reads them."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
    )
    folder = tmp_path / "fp32"
    transformers.BertModel(config).save_pretrained(folder)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    with warnings.catch_warnings():
        # transformers 5 hands the vocabulary file to tokenizers' WordPiece, which tokenizers
        # 0.22 (what transformers 5.0 installs) deprecates; 0.23 accepts it without a warning.
        warnings.filterwarnings("ignore", "Deprecated in 0.9.0: WordPiece", DeprecationWarning)
        transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    return folder


def test_fp16_copy_loads_as_float32_with_rounded_weights(tiny_folder, tmp_path):
    dest = pretrained.save_minilm_fp16(tmp_path / "fp16", source=tiny_folder)
    assert (dest / "config.json").is_file() and (dest / "tokenizer_config.json").is_file()
    full = (tiny_folder / "model.safetensors").stat().st_size
    half = (dest / "model.safetensors").stat().st_size
    assert half < 0.6 * full, (half, full)  # half the weight bytes plus the same header
    reference, _ = pretrained.load_minilm(path=tiny_folder)
    model, tokenizer = pretrained.load_minilm(path=dest)
    ref = reference.state_dict()
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, name
            assert torch.equal(value, ref[name].half().float()), name
    assert tokenizer("good film")["input_ids"] == [2, 5, 7, 3]


def test_folder_from_the_environment_variable(tiny_folder, monkeypatch):
    monkeypatch.setenv(pretrained.ENV_VAR, str(tiny_folder))
    assert pretrained.minilm_path() == tiny_folder
    model, _ = pretrained.load_minilm(num_labels=2)
    assert model.classifier.out_features == 2 and model.dtype == torch.float32


def test_a_dtype_given_as_dtype_loads_in_it_on_every_transformers_release(tiny_folder):
    # transformers before 4.56 reads torch_dtype= only; load_minilm passes dtype= on as that.
    model, _ = pretrained.load_minilm(path=tiny_folder, dtype=torch.float64)
    assert model.dtype == torch.float64
    assert model.embeddings.word_embeddings.weight.dtype == torch.float64


def test_a_folder_without_config_and_an_export_over_its_source_are_refused(tiny_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        pretrained.minilm_path(tmp_path)
    with pytest.raises(ValueError, match="differ"):
        pretrained.save_minilm_fp16(tiny_folder, source=tiny_folder)
    # Inside the source, the copy would copy itself into itself (half/half/config.json).
    with pytest.raises(ValueError, match="outside the source"):
        pretrained.save_minilm_fp16(tiny_folder / "half", source=tiny_folder)
    assert not (tiny_folder / "half").exists()
