"""``make gpu-check``: everything a lent GPU machine should tell us, in one command (docs/gpu.md).

Seven parts, each in its own process with its own time budget, under a global deadline of
:data:`DEADLINE` seconds (7.5 minutes); each writes ``gpu-<part>.json`` (the GPU's name, the
torch and package versions, the date, the part's status and figures) and ``gpu-summary.json``
lists how each part ended. A part that overruns is killed with its children and recorded as
``"timed out"``; the parts after it still run.

=============  =================================================================================
``tests``      the ``gpu``-marked tests (``pytest -m gpu``), per-test outcome
``steps``      every method's step vs its plain-PyTorch reference on ResNet-18 at B = 128
               (:mod:`benchmarks.resnet`, CUDA events), fp32 and under bf16 autocast, against
               the targets in :data:`TARGETS`
``profile``    where each step's time goes: host time, device (kernel) time, kernel launches and
               host reads per step of every method and reference on ResNet-18 at B = 128
               (``torch.profiler``), so a host-bound step shows as such in one run
``forms``      the per-example form the cost model picks for each ResNet-18 layer at B = 128,
               beside each form's measured time on this device
``compare``    one small ``python -m pyro_bdl compare`` run on this device
``match``      each method's result on this device against the CPU's, same seed and noise,
               float64, at the tolerance :data:`MATCH_RTOL` / :data:`MATCH_ATOL`
``arviz``      the ArviZ export and diagnostics tests (``tests/diagnostics``) under the
               installed ArviZ (1.x on Python 3.12), per-test outcome
=============  =================================================================================

``--device cpu --quick`` runs the same machinery on tiny networks in seconds (tests/
test_gpu_check.py), writing to ``results/gpu-check-cpu`` unless ``--output`` says otherwise.

Usage::

    python3 -m benchmarks.gpu_check                         # on the GPU machine (make gpu-check)
    python3 -m benchmarks.gpu_check --device cpu --quick    # a smoke run of the machinery
    python3 -m benchmarks.gpu_check --parts steps,match     # some parts only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.common import RESULTS, cpu_times, gpu_times, machine

ROOT = Path(__file__).resolve().parents[1]

#: Seconds for all parts together; the GPU machine's whole run must stay under 8 minutes.
DEADLINE = 450.0

#: Seconds each part may take at most (and never past the global deadline).
BUDGETS: dict[str, float] = {
    "tests": 60.0,
    "steps": 80.0,
    "profile": 70.0,
    "forms": 40.0,
    "compare": 80.0,
    "match": 30.0,
    "arviz": 90.0,
}

#: Target of each step-time ratio on a GPU, ResNet-18 at B = 128, fp32 and bf16 (docs/gpu.md).
TARGETS: dict[str, float] = {
    "vogn/adam": 1.5,
    "ivon/adam": 1.1,
    "meanfield/mf_plain": 1.2,
    "swag/sgd": 1.1,
    "laplace_map/sgd": 1.1,
}

#: Package versions each part's JSON records.
PACKAGES = ("pyro-ppl", "arviz", "arviz-base", "arviz-stats", "xarray", "numpy", "scipy")

# The match part's tolerance, float64 throughout. Device and host differ only in the order of
# summation: a sum of n terms in another order differs by at most 2·n·u·Σ|terms| (u = 2⁻⁵³ ≈
# 1.1e-16); the largest reduction here has n ≤ 32 examples × 8 units = 256 terms, 5.7e-14 of
# its magnitude. Five steps through some 50 dependent operations add at most 5 × 50 × 5.7e-14
# ≈ 1.4e-11; a factor 1000 for ill-conditioned steps (Adam's g/(√v + ε), the Cholesky of the
# Laplace precision) gives 1e-8 relative. A float32 path anywhere (u = 6e-8) or another noise
# draw (differences of order 1) exceeds it; atol covers entries that are zero up to rounding.
MATCH_RTOL, MATCH_ATOL = 1e-8, 1e-10


# ----------------------------------------------------------------------------- common pieces


def environment() -> dict:
    """The machine (GPU name, torch, date) and the versions of the packages the check uses."""
    info = machine()
    info["python"] = platform.python_version()
    info["cuda"] = torch.version.cuda
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    return info


def write_part(output: Path, name: str, record: dict) -> Path:
    """``gpu-<name>.json`` in ``output``: the environment, then ``record``. Written whole or not
    at all (a part killed mid-write leaves its previous record, not half a file)."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / f"gpu-{name}.json"
    body = {"machine": environment(), "part": name, **record}
    draft = output / f".gpu-{name}.json.draft"
    draft.write_text(json.dumps(body, indent=2, default=str))
    os.replace(draft, path)
    return path


#: A part's way to leave its figures so far: the runner writes them as a ``"partial"`` record,
#: which it keeps (marked ``"timed out"``) if the part is killed before it finishes.
Progress = Callable[[dict], None]


def no_progress(record: dict) -> None:
    """The :data:`Progress` of a part called directly (tests): nothing is saved."""


def run_bounded(cmd: list[str], timeout: float, *, new_group: bool = False) -> dict:
    """Run ``cmd``; past ``timeout`` seconds kill it. ``new_group``: in a process group of its
    own, killed as a whole (a part with the compare run it started; pytest with its xdist
    workers). Returns rc (None if killed), seconds, and the last 4000 characters of its
    output."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=new_group,
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        if new_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        try:
            out, _ = proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:  # a grandchild still holds the pipe: stop reading
            out = ""
        rc = None
    return {"rc": rc, "seconds": time.monotonic() - start, "output_tail": (out or "")[-4000:]}


def junit_outcomes(path: Path) -> dict:
    """Counts of a pytest ``--junitxml`` report and, per test that did not pass, its outcome
    and the first line of its message."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    problems: dict[str, dict] = {}
    if not path.exists():
        return {"counts": counts, "not_passed": problems, "report": "missing"}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip().splitlines()
                problems[test] = {"outcome": outcome, "message": (message or [""])[0][:400]}
                break
        counts[outcome] += 1
    return {"counts": counts, "not_passed": problems}


def pytest_part(
    targets: list[str], marker: str | None, timeout: float, *, workers: int = 0
) -> dict:
    """Run pytest on ``targets`` (with ``-m marker``; in ``workers`` pytest-xdist processes
    where that plugin is installed and ``workers`` > 0) and return its outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        # pytest-benchmark (on the GPU image) warns at start-up when xdist is active, and our
        # filterwarnings=error turns that warning into an internal error of the whole run.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
        cmd += [*targets, f"--junitxml={report}", "-o", "junit_family=xunit1"]
        if marker is not None:
            cmd += ["-m", marker]
        if workers > 0 and importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", str(workers)]
        # Its own group: at the timeout the xdist workers die with it (they would hold the
        # output pipe open, and the part would overrun its budget waiting for it).
        run = run_bounded(cmd, timeout, new_group=True)
        return {"command": " ".join(cmd[1:]), **run, **junit_outcomes(report)}


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Median seconds of a callable: CUDA events on a GPU, process time on a CPU."""
    if device.startswith("cuda"):
        return lambda fn: gpu_times(fn, warmup=2, repeats=7)["median"]
    return lambda fn: cpu_times(fn, warmup=1, repeats=3)["median"]


# ----------------------------------------------------------------------------- (a) gpu tests


def gpu_test_files() -> list[str]:
    """The test files that mark tests ``gpu`` (collecting only them keeps the part short)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text()
    )


def part_tests(device: str, quick: bool, deadline: float, progress: Progress = no_progress) -> dict:
    """The ``gpu``-marked tests; without CUDA they are all skipped."""
    files = gpu_test_files()
    # A few seconds of the budget left to read the report and write the record.
    return {"files": files, **pytest_part(files, "gpu", deadline - time.monotonic() - 3.0)}


# ----------------------------------------------------------------------------- (b) steps


def part_steps(device: str, quick: bool, deadline: float, progress: Progress = no_progress) -> dict:
    """Each method with its reference (:data:`benchmarks.resnet.REFERENCE`), fp32 and under bf16
    autocast; a pair that fails (a method that does not run under autocast) is recorded with
    its error and the others go on."""
    import pyro

    from benchmarks import resnet

    pyro.enable_validation(False)  # the benchmarks' setting: argument checks are not timed
    if quick:
        net, batch, rounds, shape = "quick_mlp", 4, 1, (3, 4, 4)
        resnet.NETS.setdefault(net, lambda s: resnet.wide_mlp(s, width=16))
    else:
        net, batch, rounds, shape = "resnet18", 128, 15, (3, 32, 32)
    config = {"net": net, "batch": batch, "rounds": rounds, "shape": shape, "N": resnet.N}
    figures: dict = {}
    longest = 0.0  # seconds of the longest pair so far: one that would overrun is not started
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        for name, ref in resnet.REFERENCE.items():
            key = f"{name}/{ref}"
            began = time.monotonic()
            if began + longest > deadline:
                figures.setdefault(precision, {})[key] = {"status": "not run: part budget"}
                continue
            try:
                r = resnet.measure(
                    net, batch, device, rounds, variants=[name, ref], shape=shape, autocast=dtype
                )
                ratio = r["ratios"][key]
                result = {
                    "status": "ok",
                    "time_ratio": ratio["time"],
                    "time_quartiles_per_round": ratio["time_quartiles_per_round"],
                    "peak_memory_ratio": ratio["peak_memory"],
                    "seconds": r["seconds"],
                    "peak_bytes": r["peak_bytes"],
                    "target": TARGETS.get(key),
                    "meets_target": (
                        None if key not in TARGETS else bool(ratio["time"] <= TARGETS[key])
                    ),
                }
            except Exception as err:  # recorded: the other pairs still run
                result = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000]}
            finally:
                pyro.clear_param_store()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            figures.setdefault(precision, {})[key] = result
            longest = max(longest, time.monotonic() - began)
            progress({"config": config, "figures": figures})
            print(f"steps {precision} {key}: {result.get('time_ratio', result['status'])}")
    return {"config": config, "figures": figures}


# ----------------------------------------------------------------------------- profile

#: Steps of each variant under the profiler (after three unprofiled ones).
PROFILED_STEPS = 5

#: Runtime calls that launch work on the device, and aten operators that read a value back to
#: the host (each a synchronisation on a GPU).
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync")
HOST_READS = ("aten::_local_scalar_dense",)


def step_profile(fn: Callable[[], object], device: str, steps: int = PROFILED_STEPS) -> dict:
    """Per step of ``fn``: wall milliseconds under the profiler (host time: on a GPU the host
    runs ahead of the device except where it reads a value back), the device's kernel
    milliseconds, the kernel launches, the host reads, and the aten operators called from
    Python (on a CPU, the proxy of launches)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    count = lambda names: sum(e.count for e in events if e.key in names)  # noqa: E731
    kernel_us = sum(
        getattr(e, "self_device_time_total", 0.0)
        for e in events
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    )
    top = [e for e in prof.events() if e.key.startswith("aten::") and e.cpu_parent is None]
    # The runtime's own calls by name, in case a CUDA version names its launches otherwise.
    runtime = sorted(((e.count, e.key) for e in events if e.key.startswith("cu")), reverse=True)
    return {
        "wall_ms": 1e3 * wall / steps,
        "device_kernel_ms": kernel_us / 1e3 / steps if cuda else None,
        "launches": count(LAUNCHES) / steps if cuda else None,
        "host_reads": count(HOST_READS) / steps,
        "top_level_aten_ops": len(top) / steps,
        "runtime_calls_per_step": {k: n / steps for n, k in runtime[:8]},
    }


def part_profile(
    device: str, quick: bool, deadline: float, progress: Progress = no_progress
) -> dict:
    """:func:`step_profile` of every method of ``steps`` and of each reference, fp32, one
    variant at a time (each on its own copy of the network, as ``steps`` builds them)."""
    import pyro

    from benchmarks import resnet

    pyro.enable_validation(False)
    if quick:
        build, batch, shape = (lambda: resnet.wide_mlp((3, 4, 4), width=16)), 4, (3, 4, 4)
    else:
        build, batch, shape = (lambda: resnet.resnet18((3, 32, 32))), 128, (3, 32, 32)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, resnet.CLASSES, (batch,), generator=g).to(device)
    # The references first: a method's figures mean little without its reference's.
    variants = [*dict.fromkeys(resnet.REFERENCE.values()), *resnet.REFERENCE]
    figures: dict = {}
    longest = 0.0
    for name in variants:
        began = time.monotonic()
        if began + longest > deadline:
            figures[name] = {"status": "not run: part budget"}
            continue
        try:
            fn = resnet.build_steps(build, x, y, device, [name])[name]
            for _ in range(3):
                fn()
            fn.activate()
            figures[name] = {"status": "ok", **step_profile(fn.step, device)}
        except Exception as err:  # recorded: the other variants still run
            figures[name] = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000]}
        finally:
            pyro.clear_param_store()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        longest = max(longest, time.monotonic() - began)
        progress({"figures": figures})
        print(f"profile {name}: {figures[name]}")
    config = {"batch": batch, "shape": shape, "steps": PROFILED_STEPS, "quick": quick}
    return {"config": config, "figures": figures}


# ----------------------------------------------------------------------------- (c) forms


def _tiny_cnn() -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    )


def layer_calls(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[tuple]:
    """``(name, module, input, output gradient)`` of every ``Linear`` and convolution call of
    one backward pass of the mean cross-entropy."""
    from torch import nn

    calls: list[list] = []

    def hook(module, inputs, output):
        entry = [names[module], module, inputs[0].detach(), None]
        calls.append(entry)
        output.register_hook(lambda grad: entry.__setitem__(3, grad.detach()))

    names = {m: n for n, m in net.named_modules()}
    handles = [
        m.register_forward_hook(hook)
        for m in net.modules()
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))
    ]
    try:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    return [tuple(c) for c in calls]


def form_sums(module, form: str, a: torch.Tensor, delta: torch.Tensor):
    """Σₙ gₙ and Σₙ gₙ² of the weight by one form, as VOGN needs them."""
    from pyro_bdl.curvature.per_example_forms import pairs_squares, per_example

    if form == "pairs":
        return pairs_squares(module, a, delta)["weight"]
    g = per_example(module, form, a, delta)["weight"]
    return g.sum(0), g.square().sum(0)


#: Numbers a timed form may hold at once; beyond it the form is timed on the largest chunk of
#: the batch that fits and scaled up (the library chunks the batch the same way).
FORM_NUMBERS = 1 << 27


def part_forms(device: str, quick: bool, deadline: float, progress: Progress = no_progress) -> dict:
    """Per ``Linear``/convolution of ResNet-18 at B = 128 (quick: a tiny CNN): the form the
    cost model picks, the model's relative costs, and each form's measured seconds."""
    from torch import nn

    from benchmarks import resnet
    from pyro_bdl.curvature.per_example_forms import (
        FORMS,
        choose_form,
        form_costs,
        layer_shape,
        numbers_per_example,
    )

    torch.manual_seed(0)
    net, batch, shape = (
        (_tiny_cnn(), 4, (3, 8, 8)) if quick else (resnet.resnet18(), 128, (3, 32, 32))
    )
    net = net.to(device)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    median_seconds = timer(device)
    config = {"net": "tiny_cnn" if quick else "resnet18", "batch": batch, "shape": shape}
    layers: dict[str, dict] = {}
    for name, module, a, delta in layer_calls(net, x, y):
        dims = layer_shape(module, a, delta)
        conv = isinstance(module, nn.modules.conv._ConvNd)
        costs = form_costs(*dims, conv=conv)
        entry: dict = {
            "shape_BOKPg": dims,
            "picked": choose_form(module, a, delta, single=True),
            "model_cost_relative": {f: c / min(costs.values()) for f, c in costs.items()},
            "seconds": {},
        }
        for form in costs:
            if time.monotonic() > deadline:
                entry["seconds"][form] = None
                continue
            per_row = numbers_per_example(module, form, a, delta)
            chunk = max(1, min(batch, FORM_NUMBERS // max(per_row, 1)))
            call = partial(form_sums, module, form, a[:chunk], delta[:chunk])
            seconds = median_seconds(call)
            entry["seconds"][form] = seconds * batch / chunk
            if chunk < batch:
                entry.setdefault("scaled_from_chunk", {})[form] = chunk
        timed = {f: s for f, s in entry["seconds"].items() if s is not None}
        if timed:
            fastest = min(timed, key=timed.__getitem__)
            entry["fastest"] = fastest
            entry["picked_over_fastest"] = timed.get(entry["picked"], float("nan")) / timed[fastest]
        layers[name] = entry
        progress({"config": config, "figures": {"layers": layers}})
    # The totals only over layers whose every form was timed before the budget ran out.
    done = [e for e in layers.values() if None not in e["seconds"].values()]
    summary = {
        "layers": len(layers),
        "layers_fully_timed": len(done),
        "picked": {f: sum(e["picked"] == f for e in layers.values()) for f in FORMS},
        "picked_is_fastest": sum(e["picked"] == e["fastest"] for e in done),
        "total_seconds_picked": sum(e["seconds"][e["picked"]] for e in done),
        "total_seconds_fastest": sum(e["seconds"][e["fastest"]] for e in done),
    }
    return {"config": config, "figures": {"summary": summary, "layers": layers}}


# ----------------------------------------------------------------------------- (d) compare


def part_compare(
    device: str, quick: bool, deadline: float, progress: Progress = no_progress
) -> dict:
    """One small ``pyro-bdl compare`` on this device (through ``python -m pyro_bdl``); its
    results.json is read back even when the run is cut short (each method's figures are saved
    as it finishes)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["compare", "--device", device, "--output", tmp, "--no-progress"]
        if quick:
            args += ["--methods", "map", "--epochs", "1", "--num-samples", "2", "--ood", "none"]
        else:
            args += ["--epochs", "2"]
        cmd = [sys.executable, "-m", "pyro_bdl", *args]
        run = run_bounded(cmd, deadline - time.monotonic() - 2.0)
        results = Path(tmp) / "results.json"
        figures = json.loads(results.read_text()) if results.exists() else None
    shown = ["<tmp>" if a == tmp else a for a in args]
    return {
        "config": {"command": " ".join(["python -m pyro_bdl", *shown])},
        **run,
        "figures": figures,
    }


# ----------------------------------------------------------------------------- (e) match


class HostNoise(TorchFunctionMode):
    """Every standard-normal or uniform draw (``torch.randn``/``rand`` and their ``_like`` and
    ``out=`` forms, ``Tensor.normal_``/``uniform_``, ``torch.normal``) comes from the CPU
    generator and is then moved to its device: with the same seed, a run on any device sees the
    CPU's noise (the CUDA generator gives other numbers)."""

    FACTORIES: ClassVar[dict[str, Callable[..., torch.Tensor]]] = {
        "randn": torch.randn,
        "rand": torch.rand,
        "randn_like": torch.randn,
        "rand_like": torch.rand,
    }
    IN_PLACE = (torch.Tensor.normal_, torch.Tensor.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if func in self.IN_PLACE:
            target, *rest = args
            host = torch.empty(target.shape, dtype=target.dtype)
            func(host, *rest, **kwargs)
            with torch.no_grad():
                return target.copy_(host)
        if func is torch.normal and all(isinstance(a, torch.Tensor) for a in args[:2]):
            mean, std = args[:2]
            return torch.normal(mean.cpu(), std.cpu()).to(mean.device)
        if name not in self.FACTORIES or func not in (getattr(torch, name), None):
            return func(*args, **kwargs)
        kwargs.pop("generator", None)
        out = kwargs.pop("out", None)
        if name.endswith("_like"):
            like, *rest = args
            args = (like.shape, *rest)
            kwargs.setdefault("dtype", like.dtype)
            kwargs.setdefault("device", like.device)
        device = kwargs.pop("device", None) or torch.get_default_device()
        if out is not None:
            kwargs["dtype"], device = out.dtype, out.device
        host = self.FACTORIES[name](*args, **kwargs)
        if out is None:
            return host.to(device)
        with torch.no_grad():
            return out.copy_(host)


def state_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state (a tensor, a dict, a dataclass, a list or tuple), by path."""
    if isinstance(obj, torch.Tensor):
        return {prefix or "value": obj.detach()}
    if is_dataclass(obj) and not isinstance(obj, type):
        items: Iterator = ((f.name, getattr(obj, f.name)) for f in fields(obj))
    elif isinstance(obj, dict):
        items = iter(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(state_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def compare_states(
    device: dict[str, torch.Tensor],
    host: dict[str, torch.Tensor],
    rtol: float = MATCH_RTOL,
    atol: float = MATCH_ATOL,
) -> dict:
    """Whether every tensor of ``device`` equals ``host``'s within ``atol + rtol·|host|``; the
    largest absolute and relative differences and the worst tensor."""
    if set(device) != set(host):
        return {"ok": False, "error": f"tensors differ: {sorted(set(device) ^ set(host))}"}
    worst, max_abs, max_rel, ok = None, 0.0, 0.0, True
    for key, h in host.items():
        h = h.detach().cpu()
        d = device[key].detach().to("cpu", h.dtype)
        if d.shape != h.shape:
            return {"ok": False, "error": f"{key}: shape {tuple(d.shape)} vs {tuple(h.shape)}"}
        diff = (d - h).abs()
        if diff.numel() == 0:
            continue
        excess = diff - (atol + rtol * h.abs())
        if bool((excess > 0).any()) or not bool(torch.isfinite(d).all()):
            ok = False
        rel = float((diff / h.abs().clamp_min(atol)).max())
        if float(diff.max()) > max_abs or worst is None:
            worst, max_abs = key, max(max_abs, float(diff.max()))
        max_rel = max(max_rel, rel)
    return {
        "ok": ok,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst": worst,
        "tensors": len(host),
    }


STEPS = 5


def _problem(device: str):
    """A tiny float64 classifier and its data, the same on every device (seed 0)."""
    import pyro

    import pyro_bdl as bdl

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g, dtype=torch.float64).to(device)
    y = torch.randint(0, 3, (32,), generator=g).to(device)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    net = net.double().to(device)
    model = bdl.models.classifier(bdl.bayesianize(net, bdl.priors.Normal(scale=1.0)), len(x))
    return model, x, y


def _svi_run(device: str, guide_name: str) -> dict[str, torch.Tensor]:
    import pyro
    from pyro.infer import SVI, Trace_ELBO

    import pyro_bdl as bdl

    model, x, y = _problem(device)
    if guide_name == "meanfield":
        guide, elbo = (
            bdl.guides.AutoMeanField(model, init_scale=0.1),
            bdl.infer.TraceSuffStat_ELBO(),
        )
    elif guide_name == "radial":
        guide, elbo = bdl.guides.AutoRadial(model), bdl.infer.TraceSuffStat_ELBO()
    elif guide_name == "swag":
        guide, elbo = bdl.guides.AutoSWAG(model, rank=3), Trace_ELBO()
    else:
        guide = bdl.guides.AutoSubnetLaplace(model, subnetwork="last_layer")
        elbo = Trace_ELBO()
    optim = (
        pyro.optim.Adam({"lr": 1e-2})
        if guide_name in ("meanfield", "radial")
        else (pyro.optim.SGD({"lr": 1e-3, "momentum": 0.9}))
    )
    svi = SVI(model, guide, optim, elbo)
    losses = []
    for _ in range(STEPS):
        losses.append(svi.step(x, y))
        if guide_name == "swag":
            guide.collect()
    out = {f"param.{k}": v for k, v in pyro.get_param_store().items()}
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    if guide_name == "swag":
        out.update({f"buffer.{k}": v for k, v in guide.named_buffers()})
    if guide_name == "laplace":
        guide.fit((x, y))
        out["covariance"] = guide.covariance
        out["predict_probit"] = guide.predict(x, link="probit")
    return out


def _optimizer_run(device: str, method: str) -> dict[str, torch.Tensor]:
    import pyro_bdl as bdl

    model, x, y = _problem(device)
    cls = bdl.infer.VOGN if method == "vogn" else bdl.infer.IVON
    opt = cls(model, dataset_size=len(x), lr=1e-2)
    losses = [opt.step(x, y) for _ in range(STEPS)]
    return {"losses": torch.tensor(losses, dtype=torch.float64), **state_tensors(opt.state)}


#: The match part's methods: each a run on one device returning named tensors.
MATCH_RUNS: dict[str, Callable[[str], dict[str, torch.Tensor]]] = {
    "meanfield": lambda d: _svi_run(d, "meanfield"),
    "radial": lambda d: _svi_run(d, "radial"),
    "vogn": lambda d: _optimizer_run(d, "vogn"),
    "ivon": lambda d: _optimizer_run(d, "ivon"),
    "swag_collect": lambda d: _svi_run(d, "swag"),
    "laplace_fit_predict": lambda d: _svi_run(d, "laplace"),
}


def match_method(method: str, device: str) -> dict:
    """One method on the CPU and on ``device`` from the same seed, the noise drawn on the CPU
    (:class:`HostNoise`); :func:`compare_states` of the results."""
    with HostNoise():
        host = {k: v.detach().cpu().clone() for k, v in MATCH_RUNS[method]("cpu").items()}
        other = {k: v.detach().cpu() for k, v in MATCH_RUNS[method](device).items()}
    return compare_states(other, host)


def part_match(device: str, quick: bool, deadline: float, progress: Progress = no_progress) -> dict:
    """Every method of :data:`MATCH_RUNS` on this device against the CPU."""
    config = {"rtol": MATCH_RTOL, "atol": MATCH_ATOL, "steps": STEPS, "dtype": "float64"}
    figures: dict = {}
    for method in MATCH_RUNS:
        if time.monotonic() > deadline:
            figures[method] = {"ok": None, "status": "not run: part budget"}
            continue
        try:
            figures[method] = match_method(method, device)
        except Exception as err:
            figures[method] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
        progress({"config": config, "figures": figures})
        print(f"match {method}: {figures[method]}")
    return {"config": config, "figures": figures}


# ----------------------------------------------------------------------------- (f) arviz


def _attempt(probe: dict, key: str, fn: Callable[[], object]) -> None:
    """``probe[key]``: what ``fn`` returned (shortened), or its traceback's end; and the
    warnings it raised (pytest turns them into errors)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            probe[key] = str(fn())[:400]
        except Exception:
            probe[key] = "error: " + traceback.format_exc()[-2000:]
    if caught:
        probe[f"{key}_warnings"] = sorted(
            {f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught}
        )


def arviz_probe() -> dict:
    """Which ArviZ is installed, and one export, PSIS k̂ and LOO through our one ArviZ layer."""
    import arviz as az

    import pyro_bdl as bdl
    from pyro_bdl.diagnostics import psis
    from pyro_bdl.diagnostics.arviz_compat import arviz_major
    from pyro_bdl.diagnostics.export import to_inference_data

    probe: dict = {"arviz_version": az.__version__, "arviz_major": arviz_major()}
    names = ("InferenceData", "loo", "from_netcdf", "psislw")
    probe["has"] = {n: n in dir(az) for n in names}
    model, x, y = _problem("cpu")
    data: dict = {}

    def export():
        guide = bdl.guides.AutoMeanField(model)
        guide(x, y)
        data["idata"] = to_inference_data(model, guide, x, y, num_samples=100)
        return type(data["idata"]).__name__

    _attempt(probe, "export", export)
    _attempt(probe, "pareto_khat", lambda: psis.pareto_khat(torch.randn(1000)))
    if "idata" in data:
        _attempt(probe, "loo", lambda: psis.loo(data["idata"]))
    return probe


def part_arviz(device: str, quick: bool, deadline: float, progress: Progress = no_progress) -> dict:
    """tests/diagnostics under the installed ArviZ (quick: its export tests only)."""
    probe = arviz_probe()
    progress({"figures": {"probe": probe}})
    target = "tests/diagnostics/test_export.py" if quick else "tests/diagnostics"
    # Some 90 tests take about 40 s in one process; four share them on the GPU machine's cores.
    left = deadline - time.monotonic() - 3.0  # to read the report and write the record
    tests = pytest_part([target], None, left, workers=0 if quick else 4)
    return {"figures": {"probe": probe, "tests": tests}}


# ----------------------------------------------------------------------------- the runner

PARTS: dict[str, Callable[..., dict]] = {
    "tests": part_tests,
    "steps": part_steps,
    "profile": part_profile,
    "forms": part_forms,
    "compare": part_compare,
    "match": part_match,
    "arviz": part_arviz,
}


def _steps_headline(figures: dict) -> dict:
    return {
        precision: {
            k: round(r["time_ratio"], 2) if "time_ratio" in r else r["status"]
            for k, r in pairs.items()
        }
        for precision, pairs in figures.items()
    }


#: One line per part for the summary: what to look at first.
HEADLINES: dict[str, Callable[[dict], object]] = {
    "tests": lambda r: {**r["counts"], "rc": r["rc"]},  # rc None: pytest was cut off
    "steps": lambda r: _steps_headline(r["figures"]),
    "profile": lambda r: {
        k: {m: v.get(m) for m in ("wall_ms", "device_kernel_ms", "launches")}
        if v["status"] == "ok"
        else v["status"]
        for k, v in r["figures"].items()
    },
    "forms": lambda r: {
        k: r["figures"]["summary"][k] for k in ("layers", "picked", "picked_is_fastest")
    },
    "compare": lambda r: {
        "rc": r["rc"],
        "methods": {
            row["method"]: row.get("error", "ok") for row in (r["figures"] or {}).get("results", [])
        },
    },
    "match": lambda r: {m: v.get("ok") for m, v in r["figures"].items()},
    "arviz": lambda r: {
        "tests": {**r["figures"]["tests"]["counts"], "rc": r["figures"]["tests"]["rc"]},
        "probe_errors": [k for k, v in r["figures"]["probe"].items() if str(v).startswith("error")],
    },
}


def run_part(name: str, device: str, quick: bool, budget: float, output: Path) -> dict:
    """One part in this process; its record (status, seconds, figures) is written whatever
    happens."""
    start = time.monotonic()

    def progress(partial: dict) -> None:
        write_part(
            output, name, {"status": "partial", "seconds": time.monotonic() - start, **partial}
        )

    try:
        record = {"status": "ok", **PARTS[name](device, quick, start + budget, progress)}
    except Exception as err:
        record = {"status": "error", "error": traceback.format_exc()[-4000:]}
        print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr)
    record["seconds"] = time.monotonic() - start
    record["device"], record["quick"], record["budget_seconds"] = device, quick, budget
    write_part(output, name, record)
    return record


def read_record(path: Path) -> dict:
    """A part's record, or ``{}`` where it is missing or cut off mid-write (a killed part)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def settle(output: Path, name: str, run: dict) -> dict:
    """The record of part ``name`` after its process ended (``run`` from :func:`run_bounded`):
    its own, or, where it was killed or crashed, one saying so (written) that keeps the figures
    of its last ``"partial"`` record."""
    (output / f".gpu-{name}.json.draft").unlink(missing_ok=True)  # one cut off mid-write
    record = read_record(output / f"gpu-{name}.json")
    if run["rc"] is not None and record.get("status") not in (None, "partial"):
        return record
    status = "timed out" if run["rc"] is None else f"crashed (rc {run['rc']})"
    record.pop("machine", None)
    record = {**record, "status": status, **run}
    write_part(output, name, record)
    return record


def run_all(
    parts: list[str], device: str, quick: bool, output: Path, deadline: float = DEADLINE
) -> dict:
    """Each part in a child process with ``min(budget, time left)``; a part that overruns is
    killed and recorded. Writes and returns the summary."""
    start = time.monotonic()
    summary: dict = {}
    for name in parts:
        left = deadline - (time.monotonic() - start)
        if left < 5.0:
            summary[name] = {"status": "not run: global deadline"}
            continue
        budget = min(BUDGETS[name], left)
        # -u: what the part printed before it was killed still reaches its record.
        cmd = [sys.executable, "-u", "-m", "benchmarks.gpu_check", "--part", name]
        cmd += ["--device", device]
        cmd += ["--output", str(output), "--budget", f"{budget:.1f}"]
        if quick:
            cmd.append("--quick")
        # A record from an earlier run must not pass for this one.
        (output / f"gpu-{name}.json").unlink(missing_ok=True)
        # The part stops starting new work at its budget; a few seconds more to write its JSON.
        run = run_bounded(cmd, budget + 10.0, new_group=True)
        record = settle(output, name, run)
        status = record["status"]
        summary[name] = {"status": status, "seconds": run["seconds"], "budget_seconds": budget}
        if status == "ok":
            try:
                summary[name]["headline"] = HEADLINES[name](record)
            except (KeyError, TypeError, AttributeError) as err:  # a record of another shape
                summary[name]["headline"] = f"unreadable: {type(err).__name__}: {err}"
        print(f"== {name}: {status} in {run['seconds']:.0f} s", flush=True)
        if status != "ok":  # the log shows why without the JSON
            print(run["output_tail"][-1500:], flush=True)
    write_part(output, "summary", {"figures": summary, "seconds": time.monotonic() - start})
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true", help="tiny networks: seconds, not minutes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {list(PARTS)}")
    parser.add_argument("--output", default=None, help="folder for the gpu-*.json files")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: not run: no CUDA device here (use --device cpu --quick for a smoke run)")
        return {}
    default = RESULTS if args.device.startswith("cuda") else ROOT / "results" / "gpu-check-cpu"
    # Absolute: the parts run with the repository as their working directory.
    output = Path(args.output).resolve() if args.output else default
    if args.part:
        return run_part(
            args.part,
            args.device,
            args.quick,
            BUDGETS[args.part] if args.budget is None else args.budget,
            output,
        )
    summary = run_all(parts, args.device, args.quick, output)
    print(json.dumps({k: v["status"] for k, v in summary.items()}, indent=1))
    return summary


if __name__ == "__main__":
    main()
