"""The seed summary of the LoRA benchmark: merging one seed's files, pairing with MAP, refusals."""

import math

import pytest

from benchmarks import lora_seeds


def _doc(seed, **methods):
    rows = {}
    for name, (nll, ece) in methods.items():
        rows[name] = {m: 0.5 for m in lora_seeds.METRICS} | {"nll": nll, "ece": ece}
    return {"config": {"seed": seed}, "machine": {}, "figures": {"methods": rows}}


def test_paired_differences_merge_the_files_of_a_seed():
    docs = [
        _doc(0, map=(0.33, 0.03), laplace_kron=(0.32, 0.02)),
        _doc(0, map=(0.33, 0.03), ivon=(0.31, 0.04)),  # another invocation, same MAP
        _doc(1, map=(0.35, 0.05), laplace_kron=(0.36, 0.03), ivon=(0.33, 0.02)),
    ]
    out = lora_seeds.summarise(docs)
    assert list(out) == ["map", "laplace_kron", "ivon"]
    kron = out["laplace_kron"]["nll"]
    assert kron["values"] == [0.32, 0.36]
    assert kron["minus_map"]["values"] == pytest.approx([-0.01, 0.01])
    assert kron["minus_map"]["mean"] == pytest.approx(0.0, abs=1e-12)
    # SE of (-0.01, 0.01): sd √(2·0.01²/1) = 0.01414, over √2.
    assert kron["minus_map"]["se"] == pytest.approx(0.01)
    assert out["ivon"]["ece"]["minus_map"]["values"] == pytest.approx([0.01, -0.03])
    assert "minus_map" not in out["map"]["nll"]
    assert math.isnan(lora_seeds.summarise(docs[:1])["map"]["nll"]["se"])
    assert "| laplace_kron | 2 |" in lora_seeds.table(out)


def test_files_that_disagree_on_map_or_repeat_a_method_are_refused():
    with pytest.raises(ValueError, match="disagree on MAP"):
        lora_seeds.summarise([_doc(0, map=(0.33, 0.03)), _doc(0, map=(0.34, 0.03))])
    with pytest.raises(ValueError, match="'ivon' appears in two files"):
        lora_seeds.summarise([_doc(0, ivon=(0.3, 0.0)), _doc(0, ivon=(0.3, 0.0))])
