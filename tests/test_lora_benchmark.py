"""Smoke test of benchmarks/lora.py: the quick mode (a tiny random BERT with LoRA on generated
tokens) runs every method and forms every figure; the full run skips with a message when the
data is missing; the shifted text sets are deterministic (the figures themselves are not
checked)."""

import pyro
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from benchmarks import lora


@pytest.fixture(autouse=True)
def _clean():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    pyro.clear_param_store()


def test_quick_mode_runs_every_method_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    figures = lora.main(["--quick"])
    assert figures is not None and not figures["errors"], figures["errors"]
    methods = figures["methods"]
    assert set(methods) == set(lora.METHODS) | {"multiswag"}
    peer = methods.pop("laplace_torch")  # the peer's fit times, no predictions
    if "status" not in peer:  # laplace-torch is installed
        assert peer["forward_backward_s"] > 0 and peer["ours_kron_fit_s"] > 0, peer
        assert peer["kron_ratio"] > 0 and peer["diag_ratio"] > 0, peer
    for name, fig in methods.items():
        assert 0.0 <= fig["accuracy"] <= 1.0 and fig["nll"] > 0, name
        assert 0.0 <= fig["auroc_shift_docs"] <= 1.0, name
    for name in lora.SAMPLED:
        assert methods[name]["sample_cost_over_forwards"] > 0, name
    assert methods["laplace_kron"]["glm_ms_per_item"] > 0
    ensemble = methods["ensemble"]
    assert ensemble["ensemble_bytes"] == ensemble["base_bytes"] + 2 * ensemble["adapter_bytes"]
    assert set(figures["step_ratios"]) == {"ivon/map_step", "meanfield/map_step"}
    assert not list(tmp_path.iterdir())


def test_full_run_skips_with_a_message_without_the_data(tmp_path, capsys):
    assert lora.main(["--data", str(tmp_path / "none.tsv")]) is None
    assert "skipped benchmarks.lora" in capsys.readouterr().out


def test_shifted_sets_are_deterministic():
    texts = ["a b c d", "e f g"]
    assert lora.shuffle_words(texts, 0) == lora.shuffle_words(texts, 0)
    assert sorted(lora.shuffle_words(texts, 0)[0].split()) == ["a", "b", "c", "d"]
    docs = lora.docstring_sentences(20, 0)
    assert docs == lora.docstring_sentences(20, 0) and len(set(docs)) == 20
    assert all(d == d.lower() and 4 <= len(d.split()) <= 30 for d in docs)
