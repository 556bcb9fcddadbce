"""End-to-end training benchmark: flowrec against plain PyTorch and TorchRec, in one process.

For each model (DLRM-Criteo, wide_1000) and precision (fp32; bf16 autocast of the dense part), on
the same synthetic Zipf batches (flowrec's synth) and the same initial parameters:

- flowrec: the Trainer's step (`train_step`) on staged batches (lookahead casting computed by the
  data stage), packed lookups, casted backward with the fused sparse optimizer, micro-batches
  as planned;
- plain: what simple CTR libraries do, one `nn.EmbeddingBag` per field with dense gradients and
  Adam on everything (`ReferenceModel` with `plain=True` optimizers);
- torchrec: `FusedEmbeddingBagCollection` with the spec's sparse optimizer fused (e.g.
  EXACT_ROWWISE_ADAGRAD) and the dense part a TorchRec user writes, with the spec's layer sizes
  and dense optimizer (when torchrec imports): DLRM, TorchRec's own DenseArch / InteractionArch /
  OverArch; wide_1000 (TorchRec ships no wide & deep model), `KeyedTensor.regroup` and stock
  `torch.nn` layers. The `torchrec` ratios use this figure;
- torchrec_shared_dense: the same fused embeddings with flowrec's own dense operators (isolates
  the sparse side: every flowrec dense speed-up speeds it up too).

Inputs of every system are built from the staged batches before the clock starts (flowrec's
casting, the plain model's per-field ids, TorchRec's KeyedJaggedTensor). flowrec and TorchRec
alternate step by step (so machine noise hits both alike); the plain model, whose dense
gradients and Adam state need 4x the table memory, runs after them are freed. After the timed
steps each system is scored on the same held-out synthetic rows (AUC).

The process's host allocator is glibc's own by default, as a TorchRec or plain PyTorch program runs
it. `--host-allocator flowrec` tunes it as `flowrec train` does (`flowrec.runtime.hostmem`: the main
thread's large blocks reused from the heap, not mapped and faulted in again every step), for every
system alike, since they share the process: the systems whose steps allocate blocks above 32 MiB
gain most (round 8: wide_1000's TorchRec and plain steps). The setting is recorded in the result.

`--isolate ROUNDS` runs every system in a process of its own instead, ROUNDS times with the order
rotated each round (a system's figure is the median of its processes' medians; the host's drift
between processes falls on each system alike, not step by step as in one process). With
`--host-allocator as-run` each process runs as its users run it: flowrec's tuned as `flowrec train`
tunes it, TorchRec's and the plain model's under glibc's own policy.

Usage:
    /work/trvenv/bin/python tools/bench_train.py [--quick] [--json PATH] [--models dlrm,wide1000] [--steps N]
        [--competitors N]   # N CPU-bound processes beside both systems (a shared machine)
        [--compile [--eager-twin]] [--profile-steps N] [--host-allocator flowrec|default|as-run]
        [--systems flowrec,torchrec,...] [--isolate ROUNDS]
    (any python with torch, torchrec and flowrec's dependencies: /work/shared/tools/torchrec-venv.sh DIR makes one)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.runtime.hostmem import tune_host_allocator
from flowrec.runtime.lowering import LoweredModel, lower
from flowrec.runtime.run_log import auc
from flowrec.measure.reference import ReferenceModel, bag_slots, reference_optimizers, reference_step, unpack_field
from flowrec.planner.manager import make_plan
from flowrec.runtime.step import autocast_context, make_dense_optimizer, train_step
from flowrec.spec import load_spec
from flowrec.testing.processes import run_tree

REPO = Path(__file__).resolve().parents[1]
MODELS = {"dlrm": "specs/dlrm_criteo.yaml", "wide1000": "specs/wide_1000.yaml"}
BATCH = 4096  # samples per step
QUICK_BATCH = 256
QUICK_TABLE_ROWS = 2_000  # --quick caps every table at this many rows
EVAL_ROWS = 32_768
QUICK_EVAL_ROWS = 2_048
PLAIN_MEMORY_SHARE = 0.6  # the plain model may use this share of the available memory
# weight + dense grad + Adam exp_avg + exp_avg_sq, the backward's and Adam's full-size temporaries, and
# what glibc's own policy keeps of the heap: a plain wide_1000 process with 3.1 GiB of capped tables
# reached 24 GB and was killed by the out-of-memory killer (Round 9, its own process; 4.3 before)
PLAIN_BYTES_PER_TABLE_BYTE = 8.0
EAGER_TWIN_COPIES = 8  # the eager flowrec twin runs only where this many copies of the tables fit in
# the available memory (flowrec, its twin, TorchRec twice, and their optimizer state and batches)


@dataclass
class System:
    """One trainer under test: a step over prepared inputs and a scorer."""

    name: str
    step: Callable[[Any], float]
    predict: Callable[[Any], torch.Tensor]
    prepare: Callable[[Any], Any] = lambda batch: batch
    note: str = ""
    profile: Callable[[Any], dict[str, float]] | None = None  # one step, seconds per stage
    setup_s: float = 0.0  # one-off time before the first step (compiling the dense stage)
    close: Callable[[], None] = lambda: None  # free what outlives the system (compiled code)


# ---------------------------------------------------------------- systems
def flowrec_system(plan: Any, spec: Any, precision: str, compile_dense: bool = False,
                   first: Any = None) -> System:
    model = lower(plan, spec, "cpu")
    opt = spec.dense_optimizer
    optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
    micro = int(plan.meta.micro_batches)
    note = f"micro_batches={micro}"
    setup = 0.0
    if compile_dense:
        call = model.compile_dense()
        start = time.perf_counter()
        _compile_once(model, first, precision)
        setup = time.perf_counter() - start
        note += f"; dense stage compiled ({'inductor' if call.active else 'failed: ' + str(call.failure)}, {setup:.1f} s)"

    def predict(batch: Any) -> torch.Tensor:
        with torch.no_grad(), autocast_context(model.device, precision):
            return model(batch).float()

    def profile(batch: Any) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        return stage_times(lambda: model.embed(batch),
                           lambda emb: model.loss(_logits(model, batch, emb, precision), batch.labels),
                           optimizer.step)

    def close() -> None:
        model.close()  # drops the compiled stage too
        torch._dynamo.reset()  # dynamo's caches hold the compiled graphs and, through them, the tables

    return System("flowrec", lambda b: train_step(model, optimizer, b, micro, precision), predict,
                  note=note, profile=profile if micro == 1 else None, setup_s=round(setup, 2), close=close)


def _logits(model: Any, batch: Any, emb: dict, precision: str) -> torch.Tensor:
    with autocast_context(model.device, precision):
        return model.dense_forward(batch.dense, emb, model.sequence_masks(batch))


def _compile_once(model: Any, batch: Any, precision: str) -> None:
    """Run the compiled dense stage forward and backward once on lookups that are not the
    tables' (the compile happens here, nothing is updated)."""
    emb = {g: e.detach().requires_grad_(True) for g, e in model.embed(batch).items()}
    _logits(model, batch, emb, precision).float().sum().backward()
    model.zero_grad(set_to_none=True)


def stage_times(lookup: Callable[[], Any], forward: Callable[[Any], torch.Tensor],
                dense_update: Callable[[], None]) -> dict[str, float]:
    """Seconds per stage of one step: sparse lookup, dense forward + loss, dense backward (until
    the first lookup's gradient is ready), sparse backward with the fused row update, dense
    optimizer step."""
    t0 = time.perf_counter()
    emb = lookup()
    t1 = time.perf_counter()
    loss = forward(emb)
    t2 = time.perf_counter()
    ready: list[float] = []
    outputs = list(emb.values()) if isinstance(emb, dict) else [emb]
    handles = [e.register_hook(lambda g: ready.append(time.perf_counter())) for e in outputs if e.requires_grad]
    loss.backward()
    t3 = time.perf_counter()
    for h in handles:
        h.remove()
    dense_update()
    t4 = time.perf_counter()
    mid = min(ready) if ready else t3
    return {"sparse_lookup": t1 - t0, "dense_forward_loss": t2 - t1, "dense_backward": mid - t2,
            "sparse_backward_update": t3 - mid, "dense_optimizer": t4 - t3, "step": t4 - t0}


def plain_system(plan: Any, spec: Any, precision: str, max_rows: int | None) -> System:
    model = ReferenceModel(plan, spec, max_rows=max_rows)
    optimizers = reference_optimizers(model, spec, plain=True)

    def predict(batch: Any) -> torch.Tensor:
        with torch.no_grad(), autocast_context(model.device, precision):
            return model(batch).float()

    note = "" if max_rows is None else f"tables capped at {max_rows} rows (ids modulo) to fit memory"
    return System("plain", lambda inputs: reference_step(model, optimizers, inputs[0], precision, inputs[1]),
                  lambda inputs: predict(inputs[0]), lambda b: (b, model.field_inputs(b)), note=note)


def _torchrec_sparse(plan: Any, spec: Any) -> tuple | None:
    """TorchRec's FusedEmbeddingBagCollection for the spec's tables, fed KeyedJaggedTensors."""
    try:
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    except Exception:  # torchrec missing or broken: its figures are null
        return None
    from operators.embedding import init_table_rows

    groups = LoweredModel(plan, spec, "cpu", spec.training.seed, tables=False)
    sparse = spec.sparse_optimizer
    params = dict(sparse.params)
    fused = {"rowwise_adagrad": (RowWiseAdagrad, {"lr": sparse.lr, "eps": params.get("eps", 1e-8)}),
             "adagrad": (torch.optim.Adagrad, {"lr": sparse.lr, "eps": params.get("eps", 1e-10)}),
             "sgd": (torch.optim.SGD, {"lr": sparse.lr})}[sparse.name]
    fields = [(g, f) for name in groups.group_order for g in [groups.group_map[name]] for f in g.fields]
    configs = [EmbeddingBagConfig(name=f.feature, embedding_dim=fbgemm_dim(g.dim),
                                  num_embeddings=next(t.rows for t in g.tables if t.table == f.table),
                                  feature_names=[f.feature],
                                  pooling=PoolingType.MEAN if f.pooling == "mean" else PoolingType.SUM)
               for g, f in fields]
    ebc = FusedEmbeddingBagCollection(configs, fused[0], fused[1], device=torch.device("cpu"))
    with torch.no_grad():
        for g, f in fields:
            rows = ebc.embedding_bags[f.feature].weight
            rows.zero_()
            rows[:, :g.dim] = init_table_rows(f.table, rows.shape[0], g.dim, spec.training.seed)
    widths = [(name, len(g.fields), g.dim, fbgemm_dim(g.dim))
              for name in groups.group_order for g in [groups.group_map[name]]]
    keys = [f.feature for _, f in fields]

    def prepare(batch: Any) -> Any:
        values, lengths = [], []
        slots = {g.name: bag_slots(g, batch.groups[g.name].ids, batch.groups[g.name].offsets)
                 for g in groups.groups}
        for g, f in fields:
            packed = batch.groups[g.name]
            ids, offsets = unpack_field(g, f.feature, packed.ids, packed.offsets, slots[g.name])
            values.append(ids)
            lengths.append(offsets[1:] - offsets[:-1])
        kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).int())
        return kjt, batch.dense, batch.labels

    def lookups(kjt: Any) -> dict[str, torch.Tensor]:
        flat = ebc(kjt).values()  # (B, sum of dims)
        out, start = {}, 0
        for name, count, dim, padded in widths:
            out[name] = flat[:, start:start + count * padded].view(flat.shape[0], count, padded)[..., :dim]  # (B, F, D)
            start += count * padded
        return out

    padded = sum(fbgemm_dim(g.dim) != g.dim for g, _ in fields)
    note = f"FusedEmbeddingBagCollection, fused {fused[0].__name__}"
    if padded:
        note += f"; {padded} fields padded to dim 4 (FBGEMM needs dim % 4 == 0), column 0 used"
    return prepare, lookups, note, ebc


def torchrec_system(plan: Any, spec: Any, precision: str) -> System | None:
    """TorchRec's fused embeddings with flowrec's own dense operators (the same dense code)."""
    sparse = _torchrec_sparse(plan, spec)
    if sparse is None:
        return None
    prepare, lookups, note, _ = sparse
    dense = LoweredModel(plan, spec, "cpu", spec.training.seed, tables=False)
    opt = spec.dense_optimizer
    optimizer = make_dense_optimizer(dense, opt.name, opt.lr, dict(opt.params))

    def step(inputs: Any) -> float:
        kjt, x, labels = inputs
        optimizer.zero_grad(set_to_none=True)
        emb = lookups(kjt)
        with autocast_context(dense.device, precision):
            logits = dense.dense_forward(x, emb, {})
        loss = dense.loss(logits, labels)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def predict(inputs: Any) -> torch.Tensor:
        kjt, x, _ = inputs
        with torch.no_grad(), autocast_context(dense.device, precision):
            return dense.dense_forward(x, lookups(kjt), {}).float()

    return System("torchrec_shared_dense", step, predict, prepare, note=note + "; flowrec's dense operators")


def torchrec_dlrm_system(plan: Any, spec: Any, precision: str) -> System | None:
    """What a TorchRec user runs for DLRM: fused embeddings + TorchRec's DenseArch, InteractionArch
    and OverArch with the spec's layer sizes, BCE loss, torch.optim dense optimizer."""
    sparse = _torchrec_sparse(plan, spec)
    if sparse is None:
        return None
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    prepare, lookups, note, _ = sparse
    modules = {m.name: m for m in spec.modules}
    bottom, top = modules["bottom"].param("layers"), modules["top"].param("layers")
    num_sparse = len(spec.sparse_features)
    torch.manual_seed(spec.training.seed)
    dense_arch = DenseArch(len(spec.dense_features), list(bottom))
    interaction = InteractionArch(num_sparse)
    over = OverArch(bottom[-1] + num_sparse * (num_sparse + 1) // 2, list(top) + [1])  # D + C(F + 1, 2)
    params = [*dense_arch.parameters(), *over.parameters()]
    opt = spec.dense_optimizer
    optimizer = torch.optim.Adam(params, lr=opt.lr) if opt.name == "adam" else torch.optim.SGD(params, lr=opt.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def forward(kjt: Any, x: torch.Tensor) -> torch.Tensor:
        (emb,) = lookups(kjt).values()  # (B, F, D): DLRM has one packed group
        with _torch_autocast(precision):
            return over(interaction(dense_arch(x), emb)).float()  # (B, 1)

    def step(inputs: Any) -> float:
        kjt, x, labels = inputs
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(forward(kjt, x), labels[:, :1])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def predict(inputs: Any) -> torch.Tensor:
        with torch.no_grad():
            return forward(inputs[0], inputs[1])

    def profile(inputs: Any) -> dict[str, float]:
        kjt, x, labels = inputs
        optimizer.zero_grad(set_to_none=True)

        def dense(emb: torch.Tensor) -> torch.Tensor:
            with _torch_autocast(precision):
                logits = over(interaction(dense_arch(x), emb)).float()
            return loss_fn(logits, labels[:, :1])

        return stage_times(lambda: next(iter(lookups(kjt).values())), dense, optimizer.step)

    return System("torchrec", step, predict, prepare,
                  note=note + "; torchrec.models.dlrm DenseArch/InteractionArch/OverArch", profile=profile)


def _torch_autocast(precision: str) -> torch.autocast:
    """torch's own CPU autocast, as a TorchRec program runs its dense part (flowrec's
    `autocast_context` would lend TorchRec's modules flowrec's bf16 products on a CPU without bf16
    kernels, `operators.lowp`)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def torchrec_wide_system(plan: Any, spec: Any, precision: str) -> System | None:
    """What a TorchRec user writes for wide_1000 (TorchRec ships no wide & deep model): fused
    embeddings, `KeyedTensor.regroup` into the wide and the deep fields, and a stock torch dense
    part with the spec's sizes: `nn.Linear` over the wide fields, `nn.Sequential` of
    `nn.Linear` + `nn.ReLU` over [dense features, deep fields], a `nn.Linear` head over
    [wide, deep]; torch's default init (seeded), BCE loss, torch.optim dense optimizer."""
    sparse = _torchrec_sparse(plan, spec)
    if sparse is None:
        return None
    from torchrec.sparse.jagged_tensor import KeyedTensor

    prepare, _, note, ebc = sparse
    layout = stock_wide_dense(spec)
    if layout is None:
        return None
    wide, deep, linear_wide, mlp, head = layout
    params = [*linear_wide.parameters(), *mlp.parameters(), *head.parameters()]
    opt = spec.dense_optimizer
    optimizer = torch.optim.Adam(params, lr=opt.lr) if opt.name == "adam" else torch.optim.SGD(params, lr=opt.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def lookup(kjt: Any) -> dict[str, torch.Tensor]:
        w, d = KeyedTensor.regroup([ebc(kjt)], [wide, deep])  # (B, 4 |wide|), (B, sum of deep dims)
        return {"wide": w, "deep": d}

    def dense(emb: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        w = emb["wide"].view(x.shape[0], len(wide), 4)[..., 0]  # (B, |wide|)
        with _torch_autocast(precision):
            out = torch.cat([linear_wide(w), mlp(torch.cat([x, emb["deep"]], 1))], 1)
            return head(out).float()  # (B, 1)

    def step(inputs: Any) -> float:
        kjt, x, labels = inputs
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(dense(lookup(kjt), x), labels[:, :1])
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def predict(inputs: Any) -> torch.Tensor:
        with torch.no_grad():
            return dense(lookup(inputs[0]), inputs[1])

    def profile(inputs: Any) -> dict[str, float]:
        kjt, x, labels = inputs
        optimizer.zero_grad(set_to_none=True)
        return stage_times(lambda: lookup(kjt), lambda emb: loss_fn(dense(emb, x), labels[:, :1]), optimizer.step)

    return System("torchrec", step, predict, prepare, profile=profile,
                  note=note + "; KeyedTensor.regroup + stock torch.nn wide & deep (nn.Linear, nn.Sequential)")


def stock_wide_dense(spec: Any) -> tuple | None:
    """The wide fields, the deep fields and the stock torch layers of a wide & deep spec (modules
    `wide`, `deep_in`, `deep`): (wide, deep, nn.Linear, nn.Sequential, nn.Linear head), seeded
    with the spec's seed; None when its layout is not the one `torchrec_wide_system` reads (dim-1
    wide fields, padded to 4 by FBGEMM with column 0 used; deep dims multiples of 4)."""
    modules = {m.name: m for m in spec.modules}
    if not {"wide", "deep_in", "deep"} <= set(modules):
        return None
    wide_tag, deep_tags = _tag(modules["wide"].inputs[0]), {_tag(i) for i in modules["deep_in"].inputs}
    wide = [f.name for f in spec.sparse_features if wide_tag in f.tags]
    deep = [f.name for f in spec.sparse_features if deep_tags & set(f.tags)]
    dims = {f.name: spec.table(f.table).dim for f in spec.sparse_features}
    if any(dims[f] != 1 for f in wide) or any(dims[f] % 4 for f in deep):
        return None
    torch.manual_seed(spec.training.seed)
    linear_wide = torch.nn.Linear(len(wide), int(modules["wide"].param("out", 1)))
    widths = [len(spec.dense_features) + sum(dims[f] for f in deep), *modules["deep"].param("layers")]
    mlp = torch.nn.Sequential(*[m for a, b in zip(widths, widths[1:])
                                for m in (torch.nn.Linear(a, b), torch.nn.ReLU())])
    head = torch.nn.Linear(linear_wide.out_features + widths[-1], 1)
    return wide, deep, linear_wide, mlp, head


def _tag(selector: str) -> str:
    """`@deep` -> `deep` (a module input selecting features by tag)."""
    return selector[1:] if selector.startswith("@") else selector


def fbgemm_dim(dim: int) -> int:
    """The smallest dim >= `dim` that FBGEMM's table-batched embedding accepts (a multiple of 4)."""
    return -(-dim // 4) * 4


# ---------------------------------------------------------------- data
def staged_batches(spec: Any, plan: Any, rows: int, seed: int, batch: int, lookahead: int) -> list:
    table = synth_table(spec, rows, SynthConfig(seed=seed))
    opts = StagingOptions(batch_size=batch, shuffle=False, lookahead=lookahead, drop_last=True)
    with iterate_batches(spec, MemorySource(split_table(table, 4)), opts, 0, 0, plan.meta.groups) as it:
        return list(it)


def capped_spec(spec: Any, max_rows: int | None, batch: int) -> Any:
    tables = spec.tables if max_rows is None else tuple(replace(t, rows=min(t.rows, max_rows)) for t in spec.tables)
    return replace(spec, tables=tables, training=replace(spec.training, batch_size=batch))


def table_bytes(spec: Any) -> int:
    """Bytes of the spec's tables (float32 rows)."""
    return sum(t.rows * t.dim * 4 for t in spec.tables)


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 16 << 30


def plain_row_cap(spec: Any) -> int | None:
    """Largest per-table row cap under which the plain model (4x the tables) fits in memory."""
    budget = available_bytes() * PLAIN_MEMORY_SHARE / PLAIN_BYTES_PER_TABLE_BYTE
    sizes = sorted((t.rows, t.dim * 4) for t in spec.tables)
    if sum(r * b for r, b in sizes) <= budget:
        return None
    lo, hi = 1, sizes[-1][0]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(r, mid) * b for r, b in sizes) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- measurement
def run_systems(systems: list[System], batches: list, eval_batches: list, warmup: int,
                profile_steps: int = 0) -> dict[str, dict]:
    """Alternate the systems step by step over the same batches; then profile the stages of
    `profile_steps` more steps (alternating too, on the first batches again); then score each."""
    inputs = {s.name: [s.prepare(b) for b in batches] for s in systems}
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    stages: dict[str, list[dict[str, float]]] = {s.name: [] for s in systems if s.profile is not None}
    losses: dict[str, float] = {}
    for i in range(len(batches)):
        for s in systems:
            start = time.perf_counter()
            losses[s.name] = s.step(inputs[s.name][i])
            if i >= warmup:
                times[s.name].append(time.perf_counter() - start)
    for i in range(profile_steps):
        for s in systems:
            if s.profile is not None:
                stages[s.name].append(s.profile(inputs[s.name][i % len(batches)]))
    del inputs
    labels = torch.cat([b.labels[:, 0] for b in eval_batches]).numpy()
    out = {}
    for s in systems:
        preds = torch.cat([torch.sigmoid(s.predict(s.prepare(b))[:, 0]) for b in eval_batches]).numpy()
        ms = statistics.median(times[s.name]) * 1e3
        size = batches[0].size
        out[s.name] = {"ms_per_step": round(ms, 2), "samples_per_s": round(size / ms * 1e3, 1),
                       "auc": round(float(auc(labels, preds)), 5), "final_loss": round(losses[s.name], 5),
                       "timed_steps": len(times[s.name]), "note": s.note}
        if s.setup_s:
            out[s.name]["setup_s"] = s.setup_s
        if stages.get(s.name):
            out[s.name]["profile_ms"] = {k: round(statistics.median(p[k] for p in stages[s.name]) * 1e3, 2)
                                         for k in stages[s.name][0]}
    return out


def bench_model(key: str, args: argparse.Namespace) -> dict:
    batch = QUICK_BATCH if args.quick else args.batch
    cap = QUICK_TABLE_ROWS if args.quick else None
    spec = capped_spec(load_spec(REPO / MODELS[key]), cap, batch)
    plan = make_plan(spec, target="cpu")
    steps = args.warmup + args.steps
    batches = staged_batches(spec, plan, batch * steps, 1, batch, lookahead=1)
    eval_rows = QUICK_EVAL_ROWS if args.quick else EVAL_ROWS
    eval_batches = staged_batches(spec, plan, eval_rows, 2, min(batch, eval_rows), lookahead=0)
    plain_cap = plain_row_cap(spec) if args.plain_rows_cap is None else (args.plain_rows_cap or None)
    result = {"spec": MODELS[key], "batch_size": batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
              "table_rows": sum(t.rows for t in spec.tables), "tables_capped_at": cap,
              "plain_tables_capped_at": plain_cap, "precisions": {}}
    chosen = set(args.systems)
    for precision in args.precisions:
        systems = []
        if "flowrec" in chosen:
            systems.append(flowrec_system(plan, spec, precision, args.compile, batches[0]))
        if ("flowrec" in chosen and args.compile and args.eager_twin
                and table_bytes(spec) * EAGER_TWIN_COPIES < available_bytes()):
            twin = flowrec_system(plan, spec, precision)
            systems.append(replace(twin, name="flowrec_eager", note=twin.note + "; dense stage eager"))
            del twin
        candidates = []
        if "torchrec_shared_dense" in chosen:
            candidates.append(torchrec_system(plan, spec, precision))
        if "torchrec" in chosen:
            stock = {"dlrm": torchrec_dlrm_system, "wide1000": torchrec_wide_system}[key]
            candidates.append(stock(plan, spec, precision))
        systems += [s for s in candidates if s is not None]
        figures = run_systems(systems, batches, eval_batches, args.warmup, args.profile_steps) if systems else {}
        for system in systems:
            system.close()
        del systems, candidates
        gc.collect()
        if not args.skip_plain and "plain" in chosen:
            plain = [plain_system(plan, spec, precision, plain_cap)]
            figures.update(run_systems(plain, batches, eval_batches, args.warmup))
            del plain
            gc.collect()
        result["precisions"][precision] = completed(figures, chosen)
    return result


def completed(figures: dict, chosen: Any) -> dict:
    """`figures` with what every result holds: `torchrec` taken from `torchrec_shared_dense` where
    the spec has no TorchRec model of its own (and torchrec was asked for), None for `torchrec` or
    `plain` not run."""
    if "torchrec" in chosen and figures.get("torchrec") is None and figures.get("torchrec_shared_dense"):
        figures["torchrec"] = figures["torchrec_shared_dense"]  # no TorchRec model for this spec
    figures.setdefault("torchrec", None)
    figures.setdefault("plain", None)
    return figures


def ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b:
        return None
    return round(b["ms_per_step"] / a["ms_per_step"], 3)


# ---------------------------------------------------------------- each system in its own process
SYSTEMS = ("flowrec", "torchrec", "torchrec_shared_dense", "plain")
CHILD_TIMEOUT_S = 3600  # one system's run (the plain wide_1000 takes about 13 s a step here)


def system_allocator(name: str, asked: str) -> str:
    """The host allocator a system's own process runs under: `as-run` is each as its users run it
    (flowrec as `flowrec train` tunes it, the others glibc's own); otherwise `asked` for all."""
    if asked == "as-run":
        return "flowrec" if name.startswith("flowrec") else "default"
    return asked


def child_command(key: str, precision: str, name: str, args: argparse.Namespace, plain_cap: int | None,
                  out: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--models", key, "--precisions", precision,
           "--systems", name, "--host-allocator", system_allocator(name, args.host_allocator),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
           "--plain-rows-cap", str(plain_cap or 0), "--json", str(out)]
    cmd += ["--quick"] if args.quick else ["--batch", str(args.batch)]
    if args.compile:
        cmd += ["--compile"] + (["--eager-twin"] if args.eager_twin else [])
    return cmd


def child_failure(cmd: list[str]) -> dict | None:
    """Run one system's process; None when it succeeded, else why not (its exit status, the tail
    of its errors): a process killed by the kernel (SIGKILL, the out-of-memory killer) or one that
    ran past CHILD_TIMEOUT_S fails its round only."""
    try:
        proc = run_tree(cmd, capture_output=True, text=True, timeout_s=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "reason": f"ran past {CHILD_TIMEOUT_S} s", "stderr_tail": ""}
    if proc.returncode == 0:
        return None
    reason = (f"killed by signal {-proc.returncode}" + (" (out of memory?)" if proc.returncode == -9 else "")
              if proc.returncode < 0 else f"exit status {proc.returncode}")
    return {"returncode": proc.returncode, "reason": reason, "stderr_tail": proc.stderr[-2000:]}


def merge_rounds(runs: list[dict | None], batch: int, allocator: str) -> dict | None:
    """One system's figures over its processes: the median of their medians (ms per step), each
    process's own median kept in `rounds_ms`."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    ms = [r["ms_per_step"] for r in runs]
    med = statistics.median(ms)
    out = {**runs[0], "ms_per_step": round(med, 2), "samples_per_s": round(batch / med * 1e3, 1),
           "auc": round(statistics.median(r["auc"] for r in runs), 5), "rounds_ms": ms,
           "rounds_auc": [r["auc"] for r in runs], "host_allocator": allocator}
    if all("profile_ms" in r for r in runs):
        out["profile_ms"] = {k: round(statistics.median(r["profile_ms"][k] for r in runs), 2)
                             for k in runs[0]["profile_ms"]}
    return out


def isolated_model(key: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Each system of one model in processes of its own, `args.isolate` rounds, the order rotated
    every round so that the host's drift falls on every system alike."""
    batch = QUICK_BATCH if args.quick else args.batch
    cap = QUICK_TABLE_ROWS if args.quick else None
    plain_cap = plain_row_cap(capped_spec(load_spec(REPO / MODELS[key]), cap, batch))  # one cap for every round
    names = [n for n in args.systems if not (n == "plain" and args.skip_plain)]
    result: dict = {"spec": MODELS[key], "precisions": {}}
    for precision in args.precisions:
        runs: dict[str, list] = {n: [] for n in names}
        failures: dict[str, list] = {}
        for r in range(args.isolate):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                out = scratch / f"{key}_{precision}_{name}_{r}.json"
                cmd = child_command(key, precision, name, args, plain_cap, out)
                start = time.perf_counter()
                failure = child_failure(cmd)
                if failure is not None:  # recorded; the other rounds and systems go on
                    failures.setdefault(name, []).append({"round": r + 1, **failure})
                    print(f"[round {r + 1}/{args.isolate}] {key} {precision} {name}: failed, "
                          f"{failure['reason']}", file=sys.stderr, flush=True)
                    continue
                doc = json.loads(out.read_text())
                model = doc["models"][key]
                result.update({k: v for k, v in model.items() if k != "precisions"})
                figs = model["precisions"][precision]
                for fig in figs.values():
                    if fig:
                        fig["host_allocator_tuned"] = doc["host_allocator"]["tuned"]
                runs[name].append(figs.get(name))
                if name.startswith("flowrec") and "flowrec_eager" in figs:
                    runs.setdefault("flowrec_eager", []).append(figs["flowrec_eager"])
                took = time.perf_counter() - start
                ms = (figs.get(name) or {}).get("ms_per_step", "n/a")
                print(f"[round {r + 1}/{args.isolate}] {key} {precision} {name}: {ms} ms/step "
                      f"({took:.0f} s, allocator {system_allocator(name, args.host_allocator)})",
                      file=sys.stderr, flush=True)
        figures = {n: merge_rounds(v, batch, system_allocator(n, args.host_allocator)) for n, v in runs.items()}
        for name, failed in failures.items():
            if figures.get(name) is not None:
                figures[name]["failed_rounds"] = failed
        if failures:
            result.setdefault("failed_rounds", {})[precision] = failures
        result["precisions"][precision] = completed(figures, names)
    return result


def report(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    np.random.seed(0)
    versions = {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__}
    try:
        import torchrec
        versions["torchrec"] = torchrec.__version__
    except Exception:
        versions["torchrec"] = None
    if args.isolate:
        with tempfile.TemporaryDirectory(prefix="bench_train_") as scratch:
            models = {key: isolated_model(key, args, Path(scratch)) for key in args.models}
    else:
        models = {key: bench_model(key, args) for key in args.models}
    ratios: dict[str, float | None] = {}
    for key in ("dlrm", "wide1000"):
        for precision in ("fp32", "bf16"):
            figs = models.get(key, {}).get("precisions", {}).get(precision, {})
            suffix = "" if precision == "fp32" else "_bf16"
            ratios[f"flowrec_vs_plain_{key}{suffix}"] = ratio(figs.get("flowrec"), figs.get("plain"))
            ratios[f"flowrec_vs_torchrec_{key}{suffix}"] = ratio(figs.get("flowrec"), figs.get("torchrec"))
            ratios[f"flowrec_vs_torchrec_shared_dense_{key}{suffix}"] = ratio(
                figs.get("flowrec"), figs.get("torchrec_shared_dense"))
            ratios[f"compiled_vs_eager_{key}{suffix}"] = ratio(figs.get("flowrec"), figs.get("flowrec_eager"))
    return {
        "benchmark": "train_step",
        "quick": args.quick,
        "profile_steps": args.profile_steps,
        "device": "cpu",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_average": list(os.getloadavg())},
        "versions": versions,
        "models": models,
        "ratios": ratios,
    }


def table(doc: dict) -> str:
    lines = [f"{'model':10} {'prec':5} {'system':21} {'ms/step':>9} {'samples/s':>11} {'AUC':>7}  note"]
    for key, model in doc["models"].items():
        for precision, figs in model["precisions"].items():
            for name in ("flowrec", "flowrec_eager", "torchrec", "torchrec_shared_dense", "plain"):
                if name == "flowrec_eager" and name not in figs:
                    continue
                f = figs.get(name)
                if f is None:
                    lines.append(f"{key:10} {precision:5} {name:21} {'n/a':>9}")
                    continue
                lines.append(f"{key:10} {precision:5} {name:21} {f['ms_per_step']:9.1f} {f['samples_per_s']:11.0f} "
                             f"{f['auc']:7.4f}  {f['note']}")
    lines += profile_table(doc)
    lines.append("ratios (speed-up of flowrec, ms/step of the other / flowrec's, one run):")
    lines += [f"  {k}: {v}" for k, v in doc["ratios"].items()]
    return "\n".join(lines)


COMPETITOR = "while True:\n    pass\n"  # one core's worth of pure CPU work, no memory traffic
COMPETITOR_STOP_S = 10.0


@contextlib.contextmanager
def competitors(count: int) -> Iterator[None]:
    """`count` CPU-bound processes running until the block ends (flowrec and TorchRec alternate
    step by step inside it, so both share the cores with them alike)."""
    procs = [subprocess.Popen([sys.executable, "-c", COMPETITOR], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(COMPETITOR_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(COMPETITOR_STOP_S)


def profile_table(doc: dict) -> list[str]:
    """Per stage, ms per step (median of the profiled steps), flowrec vs TorchRec."""
    lines = []
    for key, model in doc["models"].items():
        for precision, figs in model["precisions"].items():
            mine, theirs = (figs.get("flowrec") or {}).get("profile_ms"), (figs.get("torchrec") or {}).get("profile_ms")
            if not mine or not theirs:
                continue
            lines.append(f"profile {key} {precision} (ms per step, median of {doc['profile_steps']} steps): "
                         f"{'stage':24} {'flowrec':>9} {'torchrec':>9}")
            lines += [f"  {stage:24} {mine[stage]:9.2f} {theirs[stage]:9.2f}" for stage in mine]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small tables and batches, few steps (smoke run)")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--models", default="dlrm,wide1000", help="comma list of: " + ",".join(MODELS))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per system (default 10; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; quick 1)")
    parser.add_argument("--batch", type=int, default=BATCH, help="batch size (not with --quick)")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument("--skip-plain", action="store_true", help="leave out the plain model")
    parser.add_argument("--competitors", type=int, default=0,
                        help="CPU-bound processes (a busy loop each) running beside every system for the whole "
                             "run, as on a shared machine (default 0)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="flowrec's dense stage compiled (torch.compile, inductor; with --eager-twin the eager "
                             "one beside it as flowrec_eager). Default: eager, as `flowrec train` runs by default "
                             "(its fp32 linear layers call oneDNN, or MKL on Intel's CPUs, operators/onednn.py; compiled code calls aten's "
                             "GEMMs)")
    parser.add_argument("--eager-twin", action="store_true",
                        help="with the compiled flowrec, also run it eagerly (flowrec_eager) where 8 table copies fit "
                             "in memory (a full run with it was OOM-killed on 24 GB)")
    parser.add_argument("--host-allocator", choices=("default", "flowrec", "as-run"), default="default",
                        help="default: glibc's own, as a TorchRec or plain PyTorch program runs; flowrec: the "
                             "process's allocator tuned as `flowrec train` tunes it (large blocks reused from the "
                             "heap), for every system in the process alike; as-run (with --isolate only): each "
                             "system's process as its users run it, flowrec tuned, the others glibc's own")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma list of the systems to run (default all): " + ",".join(SYSTEMS))
    parser.add_argument("--isolate", type=int, default=0, metavar="ROUNDS",
                        help="run every system in a process of its own, ROUNDS times, the order rotated each "
                             "round; a figure is the median of its processes' medians (default 0: all systems "
                             "in this process, alternating step by step)")
    parser.add_argument("--plain-rows-cap", type=int, default=None, help=argparse.SUPPRESS)  # set by --isolate
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="steps profiled per stage after the timed ones (default 5; quick 1; 0: none)")
    args = parser.parse_args()
    if args.competitors < 0:
        parser.error("--competitors must be >= 0")
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {sorted(MODELS)}")
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.systems = [n for n in args.systems.split(",") if n]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.isolate < 0:
        parser.error("--isolate must be >= 0")
    if args.host_allocator == "as-run" and not args.isolate:
        parser.error("--host-allocator as-run needs --isolate (one process has one allocator)")
    args.steps = args.steps or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.profile_steps is None:
        args.profile_steps = 1 if args.quick else 5
    tuned = tune_host_allocator() if args.host_allocator == "flowrec" and not args.isolate else False
    with competitors(args.competitors):
        doc = report(args)
    doc["competitors"] = args.competitors
    if args.isolate:
        doc["isolate"] = {"rounds": args.isolate, "allocators": {
            n: system_allocator(n, args.host_allocator) for n in args.systems}}
        tuned = "per system (isolate.allocators)"
    doc["host_allocator"] = {"asked": args.host_allocator, "tuned": tuned}
    print(table(doc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
