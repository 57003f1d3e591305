"""Shared helpers of the benchmarks: the machine description, timing, mean ± SE and the JSON
writer."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": date.today().isoformat(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def cpu_times(fn: Callable[[], object], *, warmup: int = 4, repeats: int = 15) -> dict:
    """Median and min process time (seconds) of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    proc, wall = [], []
    for _ in range(repeats):
        p0, w0 = time.process_time(), time.perf_counter()
        fn()
        proc.append(time.process_time() - p0)
        wall.append(time.perf_counter() - w0)
    return {
        "median": statistics.median(proc),
        "min": min(proc),
        "wall_median": statistics.median(wall),
    }


def gpu_times(fn: Callable[[], object], *, warmup: int = 4, repeats: int = 15) -> dict:
    """Median and min of CUDA-event times (seconds) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return {"median": statistics.median(times), "min": min(times), "wall_median": None}


def synchronize(device: str | torch.device) -> None:
    """Wait for a CUDA device's queued work, so that a wall-clock time covers it (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of ``values`` (SE NaN for fewer than two)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def dump_json(path: Path, doc: dict) -> Path:
    """``doc`` as JSON at ``path``, whole or not at all: written to a temporary file beside it,
    then renamed over it, so a run killed mid-write keeps the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=float))
    os.replace(tmp, path)
    return path


def write(name: str, config: dict, figures: dict, out: Path | None = None) -> Path:
    """The machine, ``config`` and ``figures`` to ``out`` (default
    ``benchmarks/results/<name>.json``), atomically (:func:`dump_json`)."""
    doc = {"machine": machine(), "config": config, "figures": figures}
    path = dump_json(Path(out) if out is not None else RESULTS / f"{name}.json", doc)
    print(f"wrote {path}", flush=True)
    return path
