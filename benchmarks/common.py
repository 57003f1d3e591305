"""Shared helpers of the benchmarks: the machine description and the JSON writer."""

from __future__ import annotations

import json
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


def write(name: str, config: dict, figures: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(
        json.dumps(
            {"machine": machine(), "config": config, "figures": figures}, indent=2, default=float
        )
    )
    print(f"wrote {path}")
    return path
