"""benchmarks/gpu_check.py on the CPU: its parts in quick mode (tiny networks), the match part's
comparison and host-noise mode CPU against CPU, and the runner's budgets and records."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from benchmarks import gpu_check, resnet

FAR = 1e9  # a deadline that never comes


@pytest.fixture
def quiet_cpu(monkeypatch):
    torch.set_num_threads(1)
    # Two of the pairs keep the test short: VOGN's per-example passes and a Pyro guide.
    monkeypatch.setattr(resnet, "REFERENCE", {"meanfield": "mf_plain", "vogn": "adam"})
    yield
    resnet.NETS.pop("quick_mlp", None)


def test_steps_part_times_every_pair_and_records_a_failure(quiet_cpu):
    out = gpu_check.part_steps("cpu", True, time.monotonic() + FAR)
    pairs = {"meanfield/mf_plain", "vogn/adam"}
    for precision in ("fp32", "bf16"):
        figures = out["figures"][precision]
        assert set(figures) == pairs
        for key, r in figures.items():
            if r["status"] == "error":  # recorded, not raised: the other pairs went on
                assert r["error"], key
                continue
            assert r["status"] == "ok" and r["time_ratio"] > 0, key
            assert r["target"] == gpu_check.TARGETS.get(key)
            assert (r["meets_target"] is None) == (key not in gpu_check.TARGETS)
    assert all(r["status"] == "ok" for r in out["figures"]["fp32"].values())


def test_steps_part_stops_at_its_budget(quiet_cpu):
    out = gpu_check.part_steps("cpu", True, time.monotonic() - 1)
    statuses = {r["status"] for p in out["figures"].values() for r in p.values()}
    assert statuses == {"not run: part budget"}


def test_profile_part_profiles_every_method_and_reference(quiet_cpu):
    out = gpu_check.part_profile("cpu", True, time.monotonic() + FAR)
    assert set(out["figures"]) == {"meanfield", "mf_plain", "vogn", "adam"}
    for name, r in out["figures"].items():
        assert r["status"] == "ok", (name, r)
        assert r["wall_ms"] > 0 and r["top_level_aten_ops"] > 0
        assert r["device_kernel_ms"] is None and r["launches"] is None  # no device here
    # The mean-field model reads the batch check back once per step at least (a host read),
    # the plain step only its loss.
    assert out["figures"]["meanfield"]["host_reads"] >= 1


def test_profile_part_stops_at_its_budget(quiet_cpu):
    out = gpu_check.part_profile("cpu", True, time.monotonic() - 1)
    assert {r["status"] for r in out["figures"].values()} == {"not run: part budget"}


def test_forms_part_times_every_form_of_every_layer(quiet_cpu):
    out = gpu_check.part_forms("cpu", True, time.monotonic() + FAR)
    layers = out["figures"]["layers"]
    assert len(layers) == 3  # the tiny CNN: two convolutions and a linear layer
    for name, entry in layers.items():
        forms = set(entry["model_cost_relative"])
        assert entry["picked"] in forms and set(entry["seconds"]) == forms, name
        assert min(entry["model_cost_relative"].values()) == 1.0
        assert entry["fastest"] in forms and entry["picked_over_fastest"] >= 1.0
    summary = out["figures"]["summary"]
    assert sum(summary["picked"].values()) == 3
    assert summary["total_seconds_picked"] >= summary["total_seconds_fastest"] > 0


def test_forms_part_past_its_budget_still_records_the_picks(quiet_cpu):
    out = gpu_check.part_forms("cpu", True, time.monotonic() - 1)
    summary = out["figures"]["summary"]
    assert summary["layers"] == 3 and summary["layers_fully_timed"] == 0
    assert sum(summary["picked"].values()) == 3 and summary["total_seconds_picked"] == 0
    assert all(s is None for e in out["figures"]["layers"].values() for s in e["seconds"].values())


def test_form_sums_agree_across_forms():
    # The three forms compute the same Σg and Σg²; the timing compares like with like.
    torch.manual_seed(0)
    net = gpu_check._tiny_cnn()
    x, y = torch.randn(3, 3, 8, 8), torch.randint(0, 10, (3,))
    for _, module, a, delta in gpu_check.layer_calls(net, x, y):
        forms = ["unfold", "pairs"] + (["grouped"] if isinstance(module, torch.nn.Conv2d) else [])
        ref = gpu_check.form_sums(module, "unfold", a, delta)
        assert torch.allclose(ref[0], module.weight.grad, rtol=1e-5, atol=1e-7)
        for form in forms:
            total, squares = gpu_check.form_sums(module, form, a, delta)
            torch.testing.assert_close(total, ref[0], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(squares, ref[1], rtol=1e-5, atol=1e-7)


def test_every_method_matches_itself_on_the_cpu():
    out = gpu_check.part_match("cpu", True, time.monotonic() + FAR)
    assert set(out["figures"]) == set(gpu_check.MATCH_RUNS)
    for method, r in out["figures"].items():
        # Same device, same seed, same noise: the runs are identical, not merely close.
        assert r["ok"] and r["max_abs_diff"] == 0.0 and r["tensors"] >= 2, (method, r)


def test_the_match_check_sees_other_noise_and_small_changes(monkeypatch):
    # What a device with its own generator would do: the same seed, other noise. One extra draw
    # after the seeding shifts every later draw, and the comparison must fail.
    with gpu_check.HostNoise():
        same = gpu_check.MATCH_RUNS["meanfield"]("cpu")
        problem = gpu_check._problem

        def shifted(device):
            out = problem(device)
            torch.randn(1)
            return out

        monkeypatch.setattr(gpu_check, "_problem", shifted)
        other = gpu_check.MATCH_RUNS["meanfield"]("cpu")
    assert not gpu_check.compare_states(other, same)["ok"]
    monkeypatch.setattr(gpu_check, "_problem", problem)
    with gpu_check.HostNoise():
        a = gpu_check.MATCH_RUNS["vogn"]("cpu")
        b = gpu_check.MATCH_RUNS["vogn"]("cpu")
    assert gpu_check.compare_states(a, b)["ok"]
    a["mean"] = a["mean"] * (1 + 100 * gpu_check.MATCH_RTOL)
    assert not gpu_check.compare_states(a, b)["ok"]


def test_compare_states_at_the_tolerance():
    host = {"w": torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)}
    rtol, atol = gpu_check.MATCH_RTOL, gpu_check.MATCH_ATOL
    inside = {"w": host["w"] + torch.tensor([0.5 * rtol, -0.5 * 2 * rtol, 0.5 * atol])}
    outside = {"w": host["w"] + torch.tensor([0.0, 0.0, 2 * atol])}
    assert gpu_check.compare_states(inside, host)["ok"]
    r = gpu_check.compare_states(outside, host)
    assert not r["ok"] and r["max_abs_diff"] == pytest.approx(2 * atol) and r["worst"] == "w"
    assert not gpu_check.compare_states({"w": host["w"] * float("nan")}, host)["ok"]
    assert "differ" in gpu_check.compare_states({"v": host["w"]}, host)["error"]


def test_host_noise_draws_every_form_from_the_cpu_generator():
    torch.manual_seed(0)
    expected = torch.randn(10)
    torch.manual_seed(0)
    with gpu_check.HostNoise():
        # Meta tensors hold no numbers: each draw below must come from the CPU generator.
        a = torch.randn(2, device="meta")
        b = torch.randn_like(torch.empty(2, device="meta"))
        c = torch.empty(2, device="meta").normal_()
        d = torch.randn(2, out=torch.empty(2, device="meta"))
    assert {t.device.type for t in (a, b, c, d)} == {"meta"}
    # Four draws of 2 used the first 8 numbers of the CPU stream.
    assert torch.equal(torch.randn(2), expected[8:])


def test_state_tensors_flattens_nested_states():
    @dataclass
    class State:
        mean: torch.Tensor
        hidden: list
        step: int

    s = State(torch.zeros(2), [torch.ones(1), {"x": torch.ones(3)}], 4)
    out = gpu_check.state_tensors(s)
    assert set(out) == {"mean", "hidden.0", "hidden.1.x"}


def test_junit_outcomes_counts_and_keeps_messages(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="boom&#10;more">x</failure></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    out = gpu_check.junit_outcomes(report)
    assert out["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert out["not_passed"]["t::b"] == {"outcome": "failed", "message": "boom"}
    assert gpu_check.junit_outcomes(tmp_path / "none.xml")["report"] == "missing"


def test_run_bounded_kills_the_whole_group_past_its_timeout():
    start = time.monotonic()
    cmd = [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"]
    run = gpu_check.run_bounded(cmd, 1.0, new_group=True)
    assert run["rc"] is None and time.monotonic() - start < 10
    assert gpu_check.run_bounded([sys.executable, "-c", "print('hi')"], 30)["rc"] == 0


def test_the_runner_writes_each_part_and_the_summary(tmp_path):
    summary = gpu_check.run_all(["forms"], "cpu", True, tmp_path)
    assert summary["forms"]["status"] == "ok"
    assert summary["forms"]["headline"]["layers"] == 3  # the tiny CNN's three layers
    record = json.loads((tmp_path / "gpu-forms.json").read_text())
    assert {"machine", "part", "status", "config", "figures", "seconds"} <= set(record)
    assert record["machine"]["torch"] == torch.__version__ and record["machine"]["date"]
    done = json.loads((tmp_path / "gpu-summary.json").read_text())
    assert done["figures"]["forms"]["status"] == "ok"


def test_the_runner_skips_parts_past_the_global_deadline(tmp_path):
    summary = gpu_check.run_all(["tests", "steps"], "cpu", True, tmp_path, deadline=0.0)
    assert {v["status"] for v in summary.values()} == {"not run: global deadline"}
    assert not (tmp_path / "gpu-tests.json").exists()


def test_a_part_that_raises_is_recorded(tmp_path, monkeypatch):
    def broken(device, quick, deadline, progress):
        progress({"figures": {"half": 1}})
        assert json.loads((tmp_path / "gpu-match.json").read_text())["status"] == "partial"
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu_check.PARTS, "match", broken)
    record = gpu_check.run_part("match", "cpu", True, 5.0, tmp_path)
    assert record["status"] == "error" and "no such kernel" in record["error"]
    assert json.loads((tmp_path / "gpu-match.json").read_text())["status"] == "error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_main_without_cuda_and_with_an_unknown_part():
    assert gpu_check.main([]) == {}
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--parts", "steps,nope"])


def test_the_gpu_test_files_are_found():
    files = gpu_check.gpu_test_files()
    assert "tests/guides/test_swag_sampling.py" in files
    assert "tests/test_gpu_check.py" not in files  # none of its own tests is gpu-marked


def test_pytest_part_reports_every_outcome(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skip(): pass\n"
    )
    out = gpu_check.pytest_part([str(tmp_path / "test_three.py")], None, 60)
    assert out["rc"] == 1
    assert out["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    (failed,) = [v for k, v in out["not_passed"].items() if k.endswith("::test_fail")]
    assert failed["outcome"] == "failed" and "one is not two" in failed["message"]


@pytest.mark.slow
def test_the_tests_compare_and_arviz_parts_run_in_quick_mode():
    deadline = time.monotonic() + 300
    tests = gpu_check.part_tests("cpu", True, deadline)
    assert tests["counts"]["failed"] == tests["counts"]["error"] == 0
    assert sum(tests["counts"].values()) >= 4  # four gpu-marked tests today
    compare = gpu_check.part_compare("cpu", True, deadline)
    assert compare["rc"] == 0 and compare["figures"]["results"][0]["method"] == "map"
    arviz = gpu_check.part_arviz("cpu", True, deadline)
    assert arviz["figures"]["probe"]["arviz_version"]
    assert arviz["figures"]["tests"]["counts"]["failed"] == 0


def test_a_killed_part_keeps_its_partial_figures(tmp_path):
    gpu_check.write_part(tmp_path, "steps", {"status": "partial", "figures": {"fp32": {"a": 1}}})
    (tmp_path / ".gpu-steps.json.draft").write_text('{"cut')  # killed mid-write
    run = {"rc": None, "seconds": 160.0, "output_tail": "steps fp32 a: 1"}
    record = gpu_check.settle(tmp_path, "steps", run)
    assert record["status"] == "timed out" and record["figures"] == {"fp32": {"a": 1}}
    assert gpu_check.read_record(tmp_path / "gpu-steps.json")["status"] == "timed out"
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-steps.json"]
    crashed = gpu_check.settle(tmp_path, "forms", {**run, "rc": -11})
    assert crashed["status"] == "crashed (rc -11)" and "figures" not in crashed
    # A part that finished keeps its own record.
    gpu_check.write_part(tmp_path, "match", {"status": "ok", "figures": {}})
    assert gpu_check.settle(tmp_path, "match", {**run, "rc": 0})["status"] == "ok"


def test_the_runner_replaces_a_record_of_an_earlier_run(tmp_path, monkeypatch):
    # Out of budget at once: the part records nothing of its own, and an old file must not count.
    gpu_check.write_part(tmp_path, "match", {"status": "ok", "figures": {"old": True}})
    monkeypatch.setitem(gpu_check.BUDGETS, "match", 0.0)
    summary = gpu_check.run_all(["match"], "cpu", True, tmp_path)
    record = gpu_check.read_record(tmp_path / "gpu-match.json")
    assert summary["match"]["status"] == record["status"] == "ok"
    assert record["budget_seconds"] == 0.0 and "old" not in record["figures"]
