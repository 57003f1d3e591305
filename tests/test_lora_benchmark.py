"""Smoke test of benchmarks/lora.py: the quick mode (a tiny random BERT with LoRA on generated
tokens) runs every method and forms every figure; the full run skips with a message when the
data is missing; the shifted text sets are deterministic (the figures themselves are not
checked)."""

import json

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
        assert peer["last_layer_ratio"] > 0 and peer["ours_last_layer_fit_s"] > 0, peer
        for structure in ("last_layer", "kron", "diag"):
            assert peer[f"{structure}_trimmed_ratio"] > 0, peer
            assert peer[f"{structure}_regrouped_ratio"] > 0, peer
        assert peer["positions_real"] <= peer["positions_regrouped"], peer
        assert peer["positions_regrouped"] <= peer["positions_as_given"], peer
    for name, fig in methods.items():
        assert 0.0 <= fig["accuracy"] <= 1.0 and fig["nll"] > 0, name
        assert 0.0 <= fig["auroc_shift_docs"] <= 1.0, name
    for name in lora.SAMPLED:
        fig = methods[name]
        assert fig["sample_cost_rounds"] == 5, name
        assert 0 < fig["sample_cost_q1"] <= fig["sample_cost_over_forwards"], name
        assert fig["sample_cost_over_forwards"] <= fig["sample_cost_q3"], name
    assert methods["laplace_kron"]["glm_ms_per_item"] > 0
    ensemble = methods["ensemble"]
    assert ensemble["ensemble_bytes"] == ensemble["base_bytes"] + 2 * ensemble["adapter_bytes"]
    assert set(figures["step_ratios"]) == {"ivon/map_step", "meanfield/map_step"}
    assert not list(tmp_path.iterdir())


def test_the_peer_comparison_runs_under_bf16_autocast_for_both(tmp_path, monkeypatch):
    pytest.importorskip("laplace")
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    runs = {}
    for mode in ("none", "bf16"):
        figures = lora.main(
            ["--quick", "--methods", "map", "laplace_torch", "--peer-autocast", mode]
        )
        assert figures is not None and not figures["errors"], figures["errors"]
        runs[mode] = figures["methods"]["laplace_torch"]
        assert runs[mode]["autocast"] == mode
    for structure in ("last_layer", "kron", "diag"):
        for who in (f"ours_{structure}", structure):
            fp32, bf16 = runs["none"][f"{who}_test_nll"], runs["bf16"][f"{who}_test_nll"]
            # bf16 keeps 8 bits of mantissa (relative rounding 2⁻⁹ ≈ 0.2% per operation); over
            # the tiny BERT's few layers the logits move by a few percent of their size at most,
            # which moves an NLL near log 2 ≈ 0.69 by far less than 0.05.
            assert abs(fp32 - bf16) < 0.05, (who, fp32, bf16)


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


def test_laplace_prior_is_the_evidence_multiple_with_the_best_validation_nll():
    """The refined λ is the candidate multiple of the evidence's λ whose GLM predictive has the
    lowest NLL on the validation batches given (checked against each candidate's own
    predictive); the guide is left at that λ."""
    import pyro_bdl as bdl
    from pyro_bdl.diagnostics.metrics import nll

    torch.manual_seed(0)
    x = torch.randn(80, 3)
    y = (x[:, 0] + 0.5 * torch.randn(80) > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = bdl.models.classifier(bdl.bayesianize(net), 60)
    guide = bdl.guides.AutoSubnetLaplace(model, subnetwork="all", hessian_structure="diag")
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    for _ in range(100):
        svi.step(x[:60], y[:60])
    guide.fit((x[:60], y[:60]))
    validation = [(x[60:70], y[60:70]), (x[70:], y[70:])]
    multiples = [1.0, 10.0, 100.0, 1000.0]
    prior = lora.refine_prior_precision(guide, validation, multiples)
    lam = prior["prior_precision_evidence"]
    assert prior["prior_precision"] == pytest.approx(lam * prior["prior_multiple"])
    assert float(guide.prior_precision) == pytest.approx(prior["prior_precision"])
    scores = []
    for m in multiples:
        one = torch.tensor([lam * m], dtype=torch.float64)
        guide.tune_prior_precision(validation, method="val_ll", grid=one, refine=False)
        scores.append(nll(guide.predict(x[60:]), y[60:]))
    best = multiples[min(range(len(multiples)), key=scores.__getitem__)]
    assert prior["prior_multiple"] == pytest.approx(best), (scores, prior)


def test_results_are_written_after_each_method(tmp_path, monkeypatch):
    """A run stopped after some methods (here interrupted in the fourth) leaves a complete JSON
    of those finished, with their derived figures, marked partial, and no temporary file."""
    out = tmp_path / "lora.json"

    def stopped(b):
        raise KeyboardInterrupt  # what a timeout's signal would do mid-method

    monkeypatch.setitem(lora.METHODS, "meanfield", stopped)
    methods = ["map", "map_temperature", "ivon", "meanfield"]
    with pytest.raises(KeyboardInterrupt):
        lora.main(["--quick", "--device", "cpu", "--methods", *methods, "--out", str(tmp_path)])
    doc = json.loads(out.read_text())
    assert set(doc["figures"]["methods"]) == {"map", "map_temperature", "ivon"}
    assert doc["figures"]["methods"]["ivon"]["sample_cost_over_forwards"] > 0
    assert doc["figures"]["methods"]["map"]["forward_s"] > 0
    assert "ivon/map_step" in doc["figures"]["step_ratios"]
    assert doc["figures"]["partial"] and doc["config"]["device"] == "cpu"
    assert [p.name for p in tmp_path.iterdir()] == ["lora.json"]


class _Clock:
    """A clock that a point forward advances by one unit: the cost counts forward calls."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, x):
        self.now += 1.0
        return x


@pytest.mark.parametrize("samples,forwards", [(1, 2), (2, 2), (4, 3)])
def test_interleaved_cost_is_forward_calls_over_samples(samples, forwards):
    """A prediction that makes ``forwards`` point forwards per batch costs forwards / S of S
    point forwards, in every round (the clock counts calls, so the ratio is exact); the warm-up
    round runs but is not counted."""
    clock = _Clock()
    calls = []

    def sampled(x):
        calls.append(x)
        for _ in range(forwards):
            clock.forward(x)

    batches = [torch.zeros(2, 3), torch.ones(1, 3)]
    cost = lora.interleaved_cost(
        sampled, clock.forward, batches, samples, 3, torch.device("cpu"), clock=clock
    )
    expected = forwards / samples
    assert cost["sample_cost_over_forwards"] == pytest.approx(expected)
    assert cost["sample_cost_q1"] == pytest.approx(expected)
    assert cost["sample_cost_q3"] == pytest.approx(expected)
    assert cost["sample_cost_rounds"] == 3
    assert len(calls) == (3 + 1) * len(batches)  # the warm-up round ran too
    assert clock.now == (3 + 1) * len(batches) * (forwards + 1)


def test_interleaved_cost_reports_the_median_and_quartiles_of_the_rounds():
    """Rounds whose sampled passes take 1, 2, … 5 forwards' time: median 3, quartiles 2 and 4
    (linear interpolation over the five rounds), the warm-up round's 100 left out."""
    clock = _Clock()
    per_round = iter([100, 1, 2, 3, 4, 5])

    def sampled(x):
        clock.now += next(per_round)

    cost = lora.interleaved_cost(
        sampled, clock.forward, [torch.zeros(1)], 1, 5, torch.device("cpu"), clock=clock
    )
    assert cost["sample_cost_over_forwards"] == pytest.approx(3.0)
    assert (cost["sample_cost_q1"], cost["sample_cost_q3"]) == pytest.approx((2.0, 4.0))


def test_cost_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        lora.parse(["--quick", "--cost-rounds", "0"])
    assert "--cost-rounds must be at least 1" in capsys.readouterr().err


def test_ivon_candidates_zip_the_four_lists():
    args = lora.parse(
        ["--ivon-lrs", "0.1", "0.3", "--ivon-ess", "1e6", "--ivon-h0", "0.1", "1",
         "--ivon-beta2", "0.999", "--ivon-clip", "1e-3", "--ivon-decay", "linear"]
    )  # fmt: skip
    assert lora.ivon_settings(args) == [
        {"lr": 0.1, "ess": 1e6, "hess_init": 0.1, "betas": (0.9, 0.999), "clip_radius": 1e-3,
         "decay": "linear"},
        {"lr": 0.3, "ess": 1e6, "hess_init": 1.0, "betas": (0.9, 0.999), "clip_radius": 1e-3,
         "decay": "linear"},
    ]  # fmt: skip
    args = lora.parse(["--ivon-lrs", "0.1", "0.3", "--ivon-h0", "0.1", "0.2", "0.3"])
    with pytest.raises(ValueError, match="--ivon-"):
        lora.ivon_settings(args)
    # A finite clip radius is passed on to IVON; inf (no clipping) is left out.
    args = lora.parse(
        ["--ivon-lrs", "0.03", "0.1", "--ivon-ess", "1e7", "--ivon-h0", "0.1",
         "--ivon-clip", "1e-3", "inf"]
    )  # fmt: skip
    first, second = lora.ivon_settings(args)
    assert first["clip_radius"] == 1e-3 and "clip_radius" not in second
    # A linear decay is the benchmark's, kept in the candidate (the JSON says which ran) but
    # not passed to IVON; a constant rate is left out.
    args = lora.parse(
        ["--ivon-lrs", "1", "2", "--ivon-ess", "1e6", "--ivon-h0", "1e-3",
         "--ivon-decay", "linear", "constant"]
    )  # fmt: skip
    first, second = lora.ivon_settings(args)
    assert first["decay"] == "linear" and "decay" not in second
    assert lora.ivon_options(first) == {k: v for k, v in first.items() if k != "decay"}


def test_linear_decay_steps_down_to_the_last_step():
    from pyro_bdl.infer.natural_gradient.optimizer import NaturalGradientOptimizer

    class Stub:
        optimizer = NaturalGradientOptimizer(lr=2.0, betas=(0.9, 0.99))

        def step(self, x, y):
            self.optimizer.step()
            return 0.0

    stub = Stub()
    step = lora.linear_decay(stub, 4)
    seen = []
    for _ in range(4):
        step(None, None)
        seen.append(stub.optimizer.param_groups[0]["lr"])
    # The rates of steps 1 to 3 (step 0 ran at 2.0), then 0 after the last step.
    assert seen == pytest.approx([1.5, 1.0, 0.5, 0.0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_is_refused_without_a_gpu():
    with pytest.raises(ValueError, match="--device"):
        lora.resolve_device("cuda")
    assert lora.resolve_device("auto").type == "cpu"
