"""``make gpu-quality``: the quality benchmarks at full size, side by side, on a lent GPU machine.

Three benchmarks that take hours on the 2-core development machine and minutes on a machine with
a GPU and 16 cores (docs/gpu.md), each in its own process, started together under one deadline:

===============  ================================================================================
``uci``          :mod:`benchmarks.uci` on the CPU cores (a process pool of ``--jobs`` workers):
                 every method, the four datasets, all 20 standard splits
``mnist_table``  :mod:`benchmarks.mnist_table` on the GPU: every method, 3 seeds
``lora``         :mod:`benchmarks.lora` on the GPU: MiniLM + LoRA on SST-2, every method
===============  ================================================================================

Each benchmark writes its JSON after every finished unit of work, so one killed at the deadline
keeps what it finished; ``quality-summary.json`` records how each ended (return code, seconds,
the tail of its output). The data and the model travel with the working tree (the machine has no
network): ``make gpu-payload`` here copies the data folders into ``.gpu_payload/data`` and writes
all-MiniLM-L6-v2 with float16-rounded weights to ``.gpu_payload/minilm-fp16`` (the float32
weights, 91 MB, exceed the 64 MiB that travels).

Usage (on the GPU machine, after installing the carried wheels as ``make gpu-check`` does)::

    python3 -m benchmarks.gpu_quality --output OUT --data-dir .gpu_payload/data \\
        --model-dir .gpu_payload/minilm-fp16

``--only lora --lora-methods laplace_kron ivon ensemble`` reruns some of the LoRA methods alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]

#: Seconds for the three together; the call on the GPU machine is limited to 10 minutes.
DEADLINE = 500.0


def lora_methods() -> list[str]:
    """The methods of :mod:`benchmarks.lora`, in its order (imported lazily: it is heavy)."""
    from benchmarks.lora import METHODS

    return list(METHODS)


def commands(
    output: Path,
    jobs: int,
    model_dir: str | None,
    mnist_jobs: int = 4,
    methods: list[str] | None = None,
) -> dict[str, list[str]]:
    """The command of each benchmark, writing into ``output``: ``jobs`` UCI worker processes,
    ``mnist_jobs`` for the MNIST table (each mostly host work feeding the GPU), ``methods`` of
    the LoRA benchmark (``None``: every one but the peer, laplace-torch, which is not installed
    there; its cost is a CPU figure). The LoRA benchmark runs MAP first whatever is named."""
    py = sys.executable
    if methods is None:
        methods = [m for m in lora_methods() if m != "laplace_torch"]
    lora = [py, "-m", "benchmarks.lora", "--device", "cuda", "--out", str(output / "lora.json"),
            "--methods", *methods]  # fmt: skip
    if model_dir:
        lora += ["--model-dir", model_dir]
    return {
        "uci": [py, "-m", "benchmarks.uci", "--jobs", str(jobs), "--out", str(output / "uci.json")],
        "mnist_table": [
            py, "-m", "benchmarks.mnist_table", "--device", "cuda", "--jobs", str(mnist_jobs),
            "--out", str(output / "mnist_table.json"),
        ],
        "lora": lora,
    }  # fmt: skip


def run_together(cmds: dict[str, list[str]], deadline: float, output: Path) -> dict:
    """Start every command at once, each in a process group of its own (its workers die with
    it); past ``deadline`` seconds kill what still runs. Returns each one's rc (``None`` if
    killed), seconds and output tail; the full output is in ``output/<name>.log``."""
    start = time.monotonic()
    procs = {}
    # The GPU benchmarks need a core or two for their host work; the UCI pool takes the rest.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    for name, cmd in cmds.items():
        log = open(output / f"{name}.log", "w")  # closed once the process has ended
        procs[name] = (
            subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env),
            log,
            time.monotonic(),
        )  # fmt: skip
    ended: dict[str, dict] = {}
    while len(ended) < len(procs):
        for name, (proc, log, began) in procs.items():
            if name in ended:
                continue
            rc = proc.poll()
            late = time.monotonic() - start > deadline
            if rc is None and not late:
                continue
            if rc is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            tail = (output / f"{name}.log").read_text(errors="replace")[-3000:]
            ended[name] = {"rc": rc, "seconds": time.monotonic() - began, "output_tail": tail}
            print(f"[gpu_quality] {name}: rc={rc} after {ended[name]['seconds']:.0f} s", flush=True)
        time.sleep(1.0)
    return ended


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="folder for the JSON files and logs")
    parser.add_argument("--data-dir", default=None, help="the data folder (sets PYRO_BDL_DATA)")
    parser.add_argument("--model-dir", default=None, help="all-MiniLM-L6-v2's folder for lora")
    parser.add_argument("--mnist-jobs", type=int, default=4, help="MNIST table processes")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 8) - 5),
                        help="UCI worker processes (default: the cores less the MNIST table's "
                        "and one for the LoRA benchmark)")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=DEADLINE, help="seconds in all")
    parser.add_argument("--only", default=None, help="comma-separated subset of the benchmarks")
    parser.add_argument(
        "--lora-methods", nargs="+", default=None,
        help="the LoRA benchmark's methods (default: all but laplace_torch; map always runs), "
        "e.g. laplace_kron ivon ensemble to rerun only those (ensemble includes multiswag)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    if args.data_dir:
        os.environ["PYRO_BDL_DATA"] = str(Path(args.data_dir).resolve())
    model_dir = str(Path(args.model_dir).resolve()) if args.model_dir else None
    if args.lora_methods is not None:
        unknown = set(args.lora_methods) - set(lora_methods())
        if unknown:
            parser.error(
                f"--lora-methods: unknown {sorted(unknown)}; choose from {lora_methods()}."
            )
    cmds = commands(output.resolve(), args.jobs, model_dir, args.mnist_jobs, args.lora_methods)
    if args.only:
        unknown = set(args.only.split(",")) - set(cmds)
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)}; choose from {sorted(cmds)}.")
        cmds = {k: v for k, v in cmds.items() if k in args.only.split(",")}
    ended = run_together(cmds, args.deadline, output)
    summary = {
        "machine": machine(),
        "deadline_s": args.deadline,
        "jobs": args.jobs,
        "mnist_jobs": args.mnist_jobs,
        "commands": {k: " ".join(v[1:]) for k, v in cmds.items()},
        "ended": ended,
    }
    (output / "quality-summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
