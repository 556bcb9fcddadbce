"""Analytic cost model: per-stage time, step time, host->device traffic and peak device memory.

Device profiles carry the constants, with units in their names. Sources and assumptions:

* ``cpu``: this 2-core AMD EPYC (AVX-512) build machine, measured with numpy here: fp32 GEMM
  4096x1024x1024 at ~190 GFLOP/s, a 64 MiB copy at ~13 GB/s (read + write), random gathers of
  64-byte rows at ~11 M rows/s; memory 23 GiB. The host *is* the device: no transfer stage.
* ``a100``: NVIDIA A100-SXM4-80GB datasheet: HBM2e 2039 GB/s, 19.5 TFLOP/s fp32 (non-tensor),
  312 TFLOP/s bf16 dense; PCIe 4.0 x16 at ~25 GB/s achieved of 32 GB/s theoretical.
* ``h100``: NVIDIA H100-SXM5-80GB datasheet: HBM3 3350 GB/s, 67 TFLOP/s fp32, 989 TFLOP/s bf16
  dense; PCIe 5.0 x16 at ~50 GB/s achieved of 64 GB/s theoretical.
* GPU random gathers of short rows reach ~25 % of HBM bandwidth (sector granularity and poor
  coalescing, as reported for embedding-bag kernels), expressed as rows/s of 64-byte rows; small
  recommendation GEMMs reach `GEMM_EFFICIENCY` of peak; a kernel launch costs ~5 us.
* Host-side staging (decode, encode, batch) runs ~20 M values/s per worker with 4 workers on the
  GPU hosts, 1 on the 2-core machine.
* A profile file from `flowrec calibrate` (`--target FILE`) replaces the measured constants by
  this machine's (dense layers forward and backward fitted over the spec's shapes with efficiency
  1, elementwise passes, autograd kernels, page faults of new tensors, the sparse lookup and fused
  update per optimizer, the dense optimizer step, row maps and gathers, memory bandwidth,
  host<->device; the spec's own dense ops timed as whole operators, the per-step framework cost
  and the staging rate of its batch pipeline); `DeviceProfile.source` says which it is. Compute
  is priced kernel by kernel (`flowrec.planner.op_work`), a dense op or the loss with measured
  times (`dense_ops`, by `op_work.op_signature`; a measured loss holds a retrieval head's softmax)
  by those; uncalibrated profiles derive the per-op
  constants from their datasheet rates and have no framework cost.
* Managed tables cost the trainer's process `managed_ns_per_id` per managed lookup beyond the
  step's ops (what row resets and the replay of the data stage's map steps on the model's maps, on
  the trainer's replay thread, add to its steps, measured by `flowrec calibrate` on a spec that has
  them: `managed_seconds`), priced with staging.
* A step costs `step_us` beyond its priced ops (the trainer's Python, `zero_grad`, the autograd
  engine, the loss guard), counted in the dense stage. Staging runs at `staging_values_per_s`:
  on a device with its own host (GPU) it overlaps the device's work; on the CPU the data threads
  share the trainer's cores, so the step takes the staging time on top of its compute, and a
  calibrated CPU profile measures that rate in values per CPU second of the trainer's pipeline
  (which also computes the casting index: a calibrated sparse backward leaves it out).
* Ranks of one host that is the device (`--nproc N` on the CPU) fill its cores together: a profile
  from `flowrec calibrate --nproc N` prices each rank's compute, staging and collective calls as N
  processes stepping at once measured them (`shared_cores`); a rank's step counts the runtime's
  loss agreement and an in-batch retrieval gather beside the exchange (`exchange_traffic`), and
  once per step the ranks' skew (`rank_skew_us`: the slowest rank of each step against the slowest
  rank's typical step, `rank_skew_seconds`), in the exchange, where the ranks wait for each other.
  Where the profile measured it, a collective call is priced as it costs inside the ranks' own
  steps of the world-size plan (`rank_step_call_us`, `step_call_us`) rather than as an idle call
  after a step; where it stepped two plans of the spec with different call counts, as the fit of
  the two, a fixed part per step and a part per call (`rank_step_fixed_us`,
  `rank_step_per_call_us`, `step_call_fit`), so that a plan with other calls than the calibrated
  one is priced by what the calls measured cost, not by proportion.
* A GPU's step receives every staged batch: its dense features and labels and, per group whose
  ids go to the device (`sends_ids`: device-resident groups through the transfer stage, cached
  groups as their slots through their cache module), its ids, offsets and the casting index the
  data stage computed (`casting_bytes`), each tensor copied from pageable memory
  (`DeviceRuntime.upload`), priced as `upload_us` a copy plus the bytes at `upload_gbps`
  (`upload_seconds`; `flowrec calibrate` measures both on CUDA with the stage's own copy; a
  datasheet profile uses `launch_us` and `pcie_gbps`). The rows the host-side groups move go at
  `pcie_gbps` (pinned buffers).
* An epoch's start: the trainer opens a new batch pipeline for every epoch, waits for its first
  batch and runs its first steps beside the pipeline's start (`epoch_start_us`, `epoch_single_us`:
  measured by `flowrec calibrate` on the trainer's own epoch path, one process on the CPU). It
  is in the throughput (`samples_per_s`: a run's samples over its time), spread over the epoch's
  batches where the access profile knows the dataset's rows (`epoch_start_seconds`), not in the
  step time (`step_ms_overlap`), which is the typical step: most of the cost is the wait for the
  epoch's first batch, outside any step, and the few steps it slows are not the typical one
  (what they move the typical step by is the next point).
* What those slowed steps move the typical step by: a run's typical step (the timing rule's
  median over all its steps, as `tools/bench_costmodel.py` measures a run) holds an epoch's first
  steps beside the pipeline's start in the share they have in an epoch. For epochs of 8 batches
  (1,024 of 8,192 rows) 2-3 slowed steps of 8 move that median above the mid-epoch step the other
  terms price. `epoch_lean_us` (measured on the trainer's epoch path, by an epoch's length) adds
  it to the one-process step (serial and overlapped; not to any stage) where the access profile
  knows the dataset's rows (`epoch_lean_seconds`); the throughput already holds it in the epoch's
  start.

Example:
    >>> DEVICES["h100"].hbm_gbps
    3350.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import networkx as nx

from flowrec.graph.edges import input_slots
from flowrec.graph.kinds import OP_KINDS, OPTIMIZERS, PLACEMENTS
from flowrec.graph.types import ACCESS_NONE, ACCESS_SAMPLED, DTYPE_BYTES, AccessProfile, CostPrediction, Op, OpGraph, PackedGroup
from flowrec.planner import exchange
from flowrec.planner.access import AccessModel, dataset_rows, epoch_counted, group_model
from flowrec.planner.calibration import (COLLECTIVE, LINK, MEASURABLE, SPEC_KIND, ProfileError, is_profile_path,
                                         profile_fields, read_profile)
from flowrec.planner.exchange import link_for
from flowrec.planner.fae_traffic import hot_cold_bytes
from flowrec.planner.op_work import Kernels, OpWork, op_signature, op_work, outside_kernels, retrieval_softmax
from flowrec.spec.model import ModelSpec

GiB = 2**30  # bytes
GEMM_EFFICIENCY = 0.5  # achieved fraction of peak FLOP/s on recsys-sized GEMMs
ACTIVATION_COPIES = 2  # forward activations kept for backward + their gradients
INDEX_BYTES = 8  # int64 ids and offsets
MAP_SMALL_ROWS, MAP_LARGE_ROWS = 1 << 20, 1 << 25  # the row maps `flowrec calibrate` times


Table = tuple[tuple[str, tuple[float, ...]], ...]  # per-optimizer cost vectors, sorted by optimizer


@dataclass(frozen=True)
class DeviceProfile:
    """Constants of one target device (units in the names).

    The per-op constants price the kernels of `flowrec.planner.op_work`: a dense layer (GEMM,
    bias, activation) costs `gemm_us` + FLOPs / (TFLOP/s x efficiency) + bytes / `gemm_gbps`
    forward and, with the `gemm_bwd_*` constants over the same FLOPs and bytes, backward; an
    elementwise pass `elementwise_us` +
    bytes / `elementwise_gbps`; a kernel without data (views, autograd nodes) `op_us`. The sparse
    path of a group costs, forward, `sparse_fwd_us` + ids x (`sparse_fwd_ns_per_id` + dim x
    `sparse_fwd_ns_per_elem`) and, backward (casting, gather-reduce, fused update), per sparse
    optimizer `sparse_update` = (us, ns per id, ns per id and dim element, ns per unique row, ns
    per unique row and dim element); cached placements map every id and unique row
    through a row map (`map_ns_per_id` each). `dense_update` = per dense optimizer (us per
    parameter tensor, ns per parameter element) of one step. `dense_ops` = per measured dense op
    (`op_work.op_signature`) its forward and backward us at a few batch sizes, which price that op
    instead of its kernels (`measured_op_seconds`); `step_us` = the step's fixed framework cost;
    `compute_scale` = what the dense part of the spec's own full-batch steps takes over its ops
    priced one by one (ops in a step share caches, the allocator and the autograd engine), as a
    factor on the dense forward, backward and update (1: not measured). `rank_compute_scale` and
    `rank_staging_values_per_s` and `rank_collective_us` (`flowrec calibrate --nproc N` on a host
    that is the device) are what a rank's step, its staging and a collective call take while N
    ranks step at once on this host's cores (`shared_cores`); `rank_skew_us` what their step costs
    beyond the slowest rank's typical step, once per step (`rank_skew_seconds`); `rank_step_call_us` a
    collective call inside their sharded steps (`step_call_us`); `rank_step_fixed_us` and
    `rank_step_per_call_us` the same split into a part per step and a part per call, fitted on two
    sharded plans of different call counts (`step_call_fit`). `managed_ns_per_id` = the trainer's
    own work per lookup of a managed table beyond the step's ops (`managed_seconds`).
    `epoch_start_us` and `epoch_single_us` = what an epoch as the trainer runs it (a new batch
    pipeline) takes beyond its steady steps, of several batches and of one (`epoch_start_seconds`).
    `epoch_lean_us` = for an epoch of 1 .. 8 batches, what its start's slowed steps move the
    typical step of such epochs by (`epoch_lean_seconds`). `upload_gbps` and `upload_us` = what
    the transfer stage's copies of a staged batch cost (`DeviceRuntime.upload`: each tensor copied
    from pageable memory, a fixed part per tensor and bytes at a rate, `upload_seconds`), where
    `pcie_gbps` (pinned copies) prices the rows the caches move.

    Example:
        >>> DEVICES["cpu"].pcie_gbps is None
        True
    """

    name: str
    memory_bytes: int
    reserve_bytes: int  # kept free for the allocator, framework and workspace
    hbm_gbps: float  # device memory bandwidth, GB/s
    pcie_gbps: float | None  # host<->device, GB/s; None when the host is the device
    fp32_tflops: float
    bf16_tflops: float
    gather_rows_per_s: float  # random 64-byte row gathers from device memory
    host_gather_rows_per_s: float  # random row gathers from host memory (host-placed tables)
    launch_us: float  # per kernel
    staging_values_per_s: float  # host staging throughput (all workers), ids + dense values
    upload_gbps: float = 0.0  # a staged batch's tensors sent as the transfer stage sends them (pageable copies), GB/s; 0: pcie_gbps
    upload_us: float = 0.0  # fixed cost of one such copy; 0: launch_us
    gemm_efficiency: float = GEMM_EFFICIENCY  # achieved share of the *_tflops on recsys GEMMs
    source: str = "datasheet"  # where the constants come from: datasheet, or calibrated FILE
    op_us: float = 0.0  # per kernel without data; 0: launch_us
    elementwise_us: float = 0.0  # fixed part of an elementwise pass; 0: launch_us
    elementwise_gbps: float = 0.0  # bytes read + written per second / 1e9; 0: hbm_gbps
    gemm_us: float = 0.0  # fixed part of a GEMM; 0: launch_us
    gemm_gbps: float = 0.0  # layer input, weight and output bytes per second / 1e9; 0: hbm_gbps
    gemm_bwd_us: float = 0.0  # a layer's backward: fixed part; 0: 2 x gemm_us
    gemm_bwd_tflops: float = 0.0  # its forward FLOPs per second / 1e12 (the backward does 2x); 0: the forward's / 2
    gemm_bwd_gbps: float = 0.0  # its forward bytes per second / 1e9; 0: the forward's / 2
    collective_gbps: float = 0.0  # measured collectives: bytes one rank sends per second / 1e9; 0: the target's link
    collective_us: float = 0.0  # measured collectives: fixed cost of one call
    collective_world_size: int = 0  # processes they were measured with (0: not measured)
    sparse_fwd_us: float = 0.0  # fixed part of a group's lookup; 0: launch_us
    sparse_fwd_ns_per_id: float = 0.0  # 0: one random row gather per id (gather_rows_per_s)
    sparse_fwd_ns_per_elem: float = 0.0
    map_ns_per_id: float = 0.0  # a map of MAP_LARGE_ROWS rows or more; 0: one random gather (gather_rows_per_s)
    map_small_ns_per_id: float = 0.0  # a map of MAP_SMALL_ROWS rows or fewer; 0: map_ns_per_id
    alloc_threshold_bytes: float = 0.0  # tensors from this size on are fresh memory (page faults); 0: none
    alloc_ns_per_byte: float = 0.0  # first touch of fresh memory, per byte
    dense_update: Table = ()  # () or a missing optimizer: passes over the parameters at hbm_gbps
    sparse_update: Table = ()  # () or a missing optimizer: gathers and row updates at the datasheet rates
    step_us: float = 0.0  # per step, beyond the priced ops (framework: trainer, zero_grad, autograd engine)
    dense_ops: Table = ()  # measured dense ops: (op signature, (batch, fwd us, bwd us) points by batch)
    compute_scale: float = 1.0  # a spec's real full-batch dense part / its ops priced one by one (in situ)
    rank_compute_scale: float = 1.0  # a rank's step while collective_world_size ranks step at once on this host / priced alone
    rank_staging_values_per_s: float = 0.0  # staging rate beside those ranks (their data threads share the cores); 0: staging_values_per_s
    rank_collective_us: float = 0.0  # one collective call between those ranks (each waits for its peer to run); 0: collective_us
    rank_skew_us: float = 0.0  # a step of those ranks beyond the slowest one's typical step (they meet each step); 0: none
    rank_step_call_us: float = 0.0  # one collective call inside those ranks' own sharded steps; 0: not measured (rank_collective_us)
    rank_step_fixed_us: float = 0.0  # a sharded step's fixed part beyond its calls (fit of two plans); with rank_step_per_call_us
    rank_step_per_call_us: float = 0.0  # a call's part of that fit; 0: not fitted (rank_step_call_us)
    managed_ns_per_id: float = 0.0  # what the trainer's managed-table work (row resets, map replay) adds per managed lookup; 0: none or not measured
    epoch_start_us: float = 0.0  # an epoch of several batches beyond its steady steps (the trainer's new pipeline); 0: not measured
    epoch_single_us: float = 0.0  # the same of a one-batch epoch; 0: not measured
    exchange_ns_per_slot: float = 0.0  # what a lookahead scratchpad's exchange on its worker thread adds to the step, per slot; 0: not measured
    epoch_lean_us: tuple[float, ...] = ()  # the typical step of epochs of 1 .. n batches beyond a mid-epoch one; (): not measured

    @property
    def constants(self) -> str:
        """Where the constants come from, as a plan shows it: "datasheet cpu" or "calibrated FILE
        (created T)", naming the constants the profile did not measure (datasheet or derived)."""
        return f"datasheet {self.name}" if self.source == "datasheet" else self.source

    @property
    def overlaps(self) -> bool:
        """Whether sparse and dense work can run concurrently (separate device and host)."""
        return self.pcie_gbps is not None

    def dense_update_cost(self, optimizer: str) -> tuple[float, float]:
        """(us per parameter tensor, ns per parameter element) of one dense optimizer step."""
        measured = dict(self.dense_update).get(optimizer)
        if measured is not None:
            return measured[0], measured[1]
        passes = 3 + 2 * OPTIMIZERS[optimizer].dense_state_copies  # param, grad, param out, states in + out
        return 2 * self.launch_us, passes * 4 / self.hbm_gbps

    def sparse_update_cost(self, optimizer: str) -> tuple[float, ...]:
        """(us, ns per id, ns per id elem, ns per unique row, ns per unique row elem) of a
        group's backward: casting, gather-reduce and fused update."""
        measured = dict(self.sparse_update).get(optimizer)
        if measured is not None:
            return measured
        opt = OPTIMIZERS[optimizer]
        gather_ns = 1e9 / self.gather_rows_per_s
        row_elem_ns = 2 * 4 * (1 + opt.state_per_elem) / self.hbm_gbps  # row and state read + written
        return 2 * self.launch_us, 2 * gather_ns, 0.0, gather_ns, row_elem_ns

    def kernel_us(self, kind: str) -> float:
        """Fixed microseconds of a kernel: "gemm", "elementwise", "other" or "sparse"."""
        value = {"gemm": self.gemm_us, "elementwise": self.elementwise_us, "other": self.op_us,
                 "sparse": self.sparse_fwd_us}[kind]
        return value or self.launch_us

    @property
    def per_id_ns(self) -> tuple[float, float]:
        """(lookup ns per id, lookup ns per id elem)."""
        gather_ns = 1e9 / self.gather_rows_per_s
        return (self.sparse_fwd_ns_per_id or (0.0 if self.sparse_fwd_ns_per_elem else gather_ns),
                self.sparse_fwd_ns_per_elem)

    def fresh_seconds(self, size: float) -> float:
        """Page faults of a new tensor of `size` bytes (0 below the allocator's threshold)."""
        if not self.alloc_threshold_bytes or size < self.alloc_threshold_bytes:
            return 0.0
        return size * self.alloc_ns_per_byte * 1e-9

    def map_ns(self, rows: int) -> float:
        """Nanoseconds per id of a random lookup in a row map of `rows` entries: the small and
        large maps' costs, interpolated in log2(rows) between MAP_SMALL_ROWS and MAP_LARGE_ROWS."""
        large = self.map_ns_per_id or 1e9 / self.gather_rows_per_s
        small = self.map_small_ns_per_id or large
        share = (math.log2(max(rows, 1)) - math.log2(MAP_SMALL_ROWS)) / (math.log2(MAP_LARGE_ROWS) - math.log2(MAP_SMALL_ROWS))
        share = min(1.0, max(0.0, share))
        return small + (large - small) * share

    @property
    def elementwise_rate(self) -> float:
        """Elementwise bytes per second."""
        return (self.elementwise_gbps or self.hbm_gbps) * 1e9

    def layer_constants(self, bf16: bool = False, backward: bool = False) -> tuple[float, float, float]:
        """(fixed us, TFLOP/s, GB/s) of a dense layer, forward or backward (over the forward's
        FLOPs and bytes: a backward does about twice the work)."""
        tflops = self.bf16_tflops if bf16 else self.fp32_tflops
        fixed, gbps = self.kernel_us("gemm"), self.gemm_gbps or self.hbm_gbps
        if not backward:
            return fixed, tflops, gbps
        scale = (self.gemm_bwd_tflops / self.fp32_tflops) if self.gemm_bwd_tflops else 0.5
        return (self.gemm_bwd_us or 2 * fixed, tflops * scale, self.gemm_bwd_gbps or gbps / 2)


DEVICES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile("cpu", 23 * GiB, 4 * GiB, 13.0, None, 0.19, 0.19, 11e6, 11e6, 2.0, 20e6),
    "a100": DeviceProfile("a100", 80 * GiB, 4 * GiB, 2039.0, 25.0, 19.5, 312.0, 8e9, 20e6, 5.0, 80e6),
    "h100": DeviceProfile("h100", 80 * GiB, 4 * GiB, 3350.0, 50.0, 67.0, 989.0, 13e9, 20e6, 4.0, 80e6),
}


def device_profile(name: str) -> DeviceProfile:
    """The named datasheet profile, or a calibrated one from a profile file (`flowrec calibrate`).

    Raises:
        ValueError: an unknown name (listing the known ones), or an unusable profile file.
    """
    if name in DEVICES:
        return DEVICES[name]
    if is_profile_path(name):
        return _calibrated(name)
    if Path(name).is_file():  # `--target t2.yaml`: a file, read as a profile; said what a target is if none
        try:
            return _calibrated(name)
        except ProfileError as exc:
            raise ProfileError(f"{exc}; a target is a datasheet name ({', '.join(DEVICES)}) or a device "
                               f"profile, the JSON file `flowrec calibrate` writes") from None
    from flowrec.spec.schema_errors import did_you_mean

    raise ValueError(f"unknown target {name!r} (known: {', '.join(DEVICES)}, or a profile file "
                     f"from `flowrec calibrate`){did_you_mean(name, DEVICES)}")


def _calibrated(path: str) -> DeviceProfile:
    doc = read_profile(Path(path))
    fields = profile_fields(doc, path)
    if doc["base"] not in DEVICES:
        raise ProfileError(f"{path}: base {doc['base']!r} is not a known device (known: {', '.join(DEVICES)})")
    base = doc["base"]
    # older documents lack the newer constants; collectives (measured with --nproc only) are named
    # by the shard pass's note, which says which link it priced
    kept = sorted(set(MEASURABLE) - set(fields) - COLLECTIVE - SPEC_KIND
                  - (LINK if fields.get("pcie_gbps", DEVICES[base].pcie_gbps) is None else frozenset()))
    note = f"; datasheet or derived: {', '.join(kept)}" if kept else ""
    return replace(DEVICES[base], **fields, name=f"{base} calibrated",
                   source=f"calibrated {path} ({doc.get('created', '?')}{note})")


def device_link(device: DeviceProfile, world_size: int) -> exchange.Interconnect:
    """The interconnect of `world_size` ranks: the profile's measured collectives (`flowrec calibrate
    --nproc`) within one node, else the target's datasheet link (`exchange.link_for`)."""
    base = device.name.split()[0]
    if device.collective_gbps and world_size <= exchange.GPUS_PER_NODE:
        return exchange.Interconnect(
            f"measured collectives ({device.collective_world_size} processes)", device.collective_gbps,
            device.collective_us, device.source)
    return link_for(base, world_size)


def default_budget(device: DeviceProfile) -> int:
    """Device memory the plan may use: the device's memory minus its reserve."""
    return device.memory_bytes - device.reserve_bytes


def row_bytes(dim: int, dtype: str, optimizer: str) -> int:
    """Bytes of one embedding row with its optimizer state (as `PackedGroup.row_bytes`)."""
    opt = OPTIMIZERS[optimizer]
    return dim * DTYPE_BYTES[dtype] + dim * opt.state_per_elem * 4 + opt.state_per_row * 4


@dataclass(frozen=True)
class _Unit:
    """One embedding lookup kernel's worth of work (a packed group, or one lookup before packing)."""

    group: PackedGroup | None
    rows: int
    dim: int
    elem: int
    row_bytes: int
    ids: float  # ids per sample (mean)
    bags: int  # bags per sample
    placement: str
    cache_rows: int
    hit_rate: float
    optimizer: str  # sparse optimizer name
    shards: int = 1
    step_ids: int = 0  # lookups per step beyond the samples' (a retrieval head's sampled negatives: N samples)
    mean: bool = False  # a field pools by mean (its casting carries a scale per id)

    def lookups(self, batch: float) -> float:
        """Ids looked up in a step of `batch` samples (the sampled negatives included)."""
        return batch * self.ids + self.step_ids

    @property
    def local_rows(self) -> int:
        """Rows this rank holds (the busiest rank's share of a row-wise group)."""
        return -(-self.rows // self.shards)


def _group_unit(g: PackedGroup, profile: AccessProfile | None = None, step_ids: int = 0) -> _Unit:
    return _Unit(g, g.rows, g.dim, DTYPE_BYTES[g.dtype], g.row_bytes(), ids_per_sample(g, profile),
                 g.bags_per_sample, g.placement, g.cache_rows, g.expected_hit_rate, g.optimizer[0], g.shards,
                 step_ids, any(f.pooling == "mean" for f in g.fields))


def step_lookups(graph: OpGraph) -> dict[str, int]:
    """Lookups per step a group makes beyond its samples' ids: a retrieval head's sampled
    negatives, `num` per step (on every rank) in its item's group, as N extra one-id samples."""
    meta = graph.graph.get("plan")
    out: dict[str, int] = {}
    for node in graph:
        op = graph.nodes[node]["op"]
        if meta is None or op.kind != "head" or op.attr("negatives") != "sampled":
            continue
        group = next((g for g in meta.groups if any(f.feature == op.attr("item_feature") for f in g.fields)), None)
        if group is not None:
            out[group.name] = out.get(group.name, 0) + int(op.attr("num_negatives"))
    return out


def epoch_batches(profile: AccessProfile | None, batch: int) -> float | None:
    """Batches per epoch of the profiled dataset (its rows: `access.dataset_rows`), or None."""
    rows = dataset_rows(profile)
    return None if rows is None else rows / max(batch, 1)


def ids_per_sample(group: PackedGroup, profile: AccessProfile | None) -> float:
    """Ids a sample looks up in a group: the profile's mean when it counts every member table
    (sequences and multi-hot fields are mostly shorter than their max_len), else the max_len sum."""
    tables = (profile or {}).get("tables", {})
    samples = (profile or {}).get("samples", 0)
    names = {t.table for t in group.tables}
    if samples and names <= set(tables):
        return sum(float(tables[name].get("accesses", 0)) for name in names) / samples
    return float(sum(f.max_len for f in group.fields))


def group_step_seconds(group: PackedGroup, device: DeviceProfile, batch: int, window: int,
                       profile: AccessProfile | None, step_ids: int = 0, epochs: float = 1.0) -> float:
    """Time per step a group's placement costs beyond device-resident: row traffic, host gathers
    and a lookahead scratchpad's exchange (`step_ids`: its lookups per step beyond the samples',
    `step_lookups`; `epochs`: the run's, over which the traffic is averaged)."""
    u = _group_unit(group, profile, step_ids)
    if PLACEMENTS[u.placement].traffic == "window":  # the rows fetched, each written back once evicted
        fetched, written = lookahead_rows_per_batch(group, batch, window, profile, step_ids, epochs)
        moved, host_rows = u.row_bytes * (fetched + written), fetched
    else:
        moved = _unit_bytes(u, batch, window, profile, epochs) - _index_bytes(u, batch)
        host_rows = (1.0 - u.hit_rate) * u.lookups(batch)
    link = device.pcie_gbps or device.hbm_gbps
    return (moved / (link * 1e9) + host_rows / device.host_gather_rows_per_s
            + exchange_seconds(u, device))


def exchange_seconds(u: _Unit, device: DeviceProfile) -> float:
    """Seconds a lookahead unit's scratchpad exchange adds to a step: `exchange_ns_per_slot` per
    slot, measured by `flowrec calibrate` as what exchanges on a worker thread add to compute on
    the run's threads beside them (0 on a datasheet target). Its host work (the window's row-map
    lookups, ranking the resident rows the window does not pin, fetches, write-backs) takes the
    step's cores where no core is free for it, as the data stage does, so it is priced with
    staging. With two compute threads on two cores wide_deep's lookahead dim-1 group (149,630
    slots, 33-45 ms an exchange alone) measured 66 ms a step more than static_hot, both priced
    alike before; with one, an exchange adds about nothing (two_task: lookahead 100.8 ms a step,
    static_hot 100.0 ms)."""
    if PLACEMENTS[u.placement].traffic != "window" or u.group is None or not device.exchange_ns_per_slot:
        return 0.0
    return u.cache_rows * device.exchange_ns_per_slot * 1e-9


def _units(graph: OpGraph, profile: AccessProfile | None = None) -> list[_Unit]:
    groups = {g.name: g for g in graph.graph["plan"].groups} if "plan" in graph.graph else {}
    units = []
    extra = step_lookups(graph)
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind == "packed_embedding":
            units.append(_group_unit(groups[op.attr("group")], profile, extra.get(op.attr("group"), 0)))
        elif op.kind == "embedding_lookup":
            rows = op.attr("rows") if op.attr("owns_table") else 0
            units.append(_Unit(None, rows, op.attr("dim"), DTYPE_BYTES[op.dtype],
                               row_bytes(op.attr("dim"), op.dtype, op.attr("optimizer")),
                               op.attr("max_len"), 1 if op.attr("pooling") != "none" else op.attr("max_len"),
                               "device", 0, 1.0, op.attr("optimizer"), mean=op.attr("pooling") == "mean"))
    return units


SPARSE_KINDS = frozenset(k for k, info in OP_KINDS.items() if info.cost == "sparse")
INPUT_KINDS = frozenset(k for k, info in OP_KINDS.items() if info.cost == "input")


def dense_memory_bytes(graph: OpGraph, spec: ModelSpec) -> int:
    """Dense parameters, their gradients and the dense optimizer's state, and what dense modules
    hold once (a custom module's buffers and frozen parameters, `buffer_bytes`)."""
    dense = [graph.nodes[n]["op"] for n in graph if graph.nodes[n]["op"].kind not in SPARSE_KINDS]
    params = sum(op.param_bytes for op in dense)
    held = sum(int(op.attr("buffer_bytes", 0)) for op in dense)
    return params * (2 + OPTIMIZERS[spec.dense_optimizer.name].dense_state_copies) + held


def activation_bytes(graph: OpGraph, batch: int, precision: str = "fp32") -> int:
    """Activations of one (micro-)batch kept for backward, with their gradients, and the
    attention masks of its `self_attention` layers (`attention_mask_bytes`)."""
    per_sample = sum(graph.nodes[n]["op"].out_bytes for n in graph)
    tower, drawn = sampled_item_tower(graph)
    per_drawn = sum(graph.nodes[n]["op"].out_bytes for n in tower)  # the drawn items' tower activations
    return (per_sample * batch * ACTIVATION_COPIES + per_drawn * drawn * ACTIVATION_COPIES
            + attention_mask_bytes(graph, batch, precision) + retrieval_logit_bytes(graph, batch))


FREE_ROW_BYTES = 8  # B: one entry of a managed map's sorted free rows (int64, `ManagedMap.free`)
ID_BYTES = 32  # B: one id of a managed map's entries (keys, row, last int64, count float64: `Entries`)
MAP_COPIES = 2  # a managed table's maps in a training process: the model's and the data stage's copy


def managed_map_bytes(spec: ModelSpec, world: int = 1) -> int:
    """Host bytes of the managed tables' maps, priced from each table's capacity: the sorted free
    rows, 8 bytes per row (every row is free when training starts: `ManagedMap.free`), and the ids'
    entries, 32 bytes per id (raw id, row, count, last step: `Entries`) for as many ids as the
    table holds rows (a full table), in the model's maps and in the data stage's copy of them
    (`ManagedState.remapper`). Under owner ranks (several ranks, every managed table in virtual
    shards) a rank holds the shards it owns; otherwise every rank holds all of it.

    Example:
        >>> from flowrec.spec import load_spec
        >>> managed_map_bytes(load_spec("specs/managed_movielens.yaml"))  # (472 + 841) rows x (8 + 32) B x 2
        105040
    """
    managed = [t.managed for t in spec.tables if t.managed is not None]
    owners = world > 1 and bool(managed) and all(m.shards > 1 for m in managed)
    rows = sum(-(-m.shards // world) * -(-m.rows // m.shards) if owners else m.rows for m in managed)
    return rows * (FREE_ROW_BYTES + ID_BYTES) * MAP_COPIES


RETRIEVAL_LOGIT_COPIES = 3  # (B, C) tensors a retrieval softmax holds at its peak (3.3-3.4 measured)


def retrieval_logit_bytes(graph: OpGraph, batch: int) -> int:
    """What a retrieval head's softmax holds: its (B, C) logits against C candidates (in-batch:
    every rank's rows of the batch; sampled: 1 + N), masked, scaled, logQ-corrected and their
    log-softmax kept for backward. Measured on the CPU (`operators.retrieval.retrieval_loss`
    forward and backward, dot and cosine, with and without logQ; B 256 with N 200,000, B 4,096
    in-batch): 3.3-3.4 (B, C) fp32 tensors at the peak; `RETRIEVAL_LOGIT_COPIES` fp32 tensors
    is the estimate, below every measured peak. Without it 1,000,000 sampled negatives at
    batch 1,024 planned at 2 MiB of memory where the step needs over 12 GB. fp32 under
    `precision: bf16` too: the head's outputs are widened to fp32 and the loss runs outside
    autocast (counted at bf16's 2 bytes, such a plan was estimated at half its logits).

    Example:
        >>> from flowrec.graph.build import build_graph
        >>> from flowrec.spec import load_spec
        >>> retrieval_logit_bytes(build_graph(load_spec("specs/two_tower_movielens.yaml")), 1024)  # in-batch
        12582912
    """
    return sum(size for size, _ in _retrieval_logits(graph, batch))


def attention_mask_bytes(graph: OpGraph, batch: int, precision: str = "fp32") -> int:
    """What a batch's `self_attention` layers hold that grows with the square of the sequence:
    torch's `scaled_dot_product_attention` turns the broadcast (B, 1, L, L) boolean mask of
    `operators.attention` into a mask of the compute dtype (4 bytes in fp32, 2 in bf16) and keeps
    it for backward, one per layer. Measured on the CPU (`fused` kernel, any number of heads):
    1.35-1.6 such masks at the peak of a one-layer forward and backward, 2.6-3.1 for two layers
    (B 16-32, L 700-1,000); one mask a layer is the estimate, below every measured peak as
    `flowrec.planner.fit` needs. Without it a sequence of 20,000 at batch 512 planned at 1.3 GiB
    and failed allocating 819 GB.

    Example:
        >>> from flowrec.graph.build import build_graph
        >>> from flowrec.spec import load_spec
        >>> attention_mask_bytes(build_graph(load_spec("specs/bst_taobao.yaml")), 1024)  # 2 layers, 51 x 51 a sample
        21307392
    """
    return sum(size for size, _ in _attention_masks(graph, batch, precision))


def growing_activations(graph: OpGraph, batch: int, precision: str = "fp32") -> list[tuple[int, str]]:
    """(bytes, what) of each activation term that grows faster than the batch's rows: every
    `self_attention`'s masks (`attention_mask_bytes`) and a retrieval head's logits
    (`retrieval_logit_bytes`), for naming the largest in a memory line (`flowrec.planner.fit`)."""
    return [*_attention_masks(graph, batch, precision), *_retrieval_logits(graph, batch)]


def _attention_masks(graph: OpGraph, batch: int, precision: str) -> Iterator[tuple[int, str]]:
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind == "self_attention":
            length = op.attr("in_features") // op.out_shape[-1]  # the target (output: target) included
            yield (op.attr("num_layers") * batch * length * length * DTYPE_BYTES[precision],
                   f"{node}'s {length:,} x {length:,} attention mask a sample and layer")


def _retrieval_logits(graph: OpGraph, batch: int) -> Iterator[tuple[int, str]]:
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind == "loss" and op.attr("retrieval"):
            head = op.attr("heads")[op.attr("retrieval")[0]]
            candidates = retrieval_work(graph, op, batch).forward.gemms[0][2]  # the (B x D) @ (D x C) logits
            yield (RETRIEVAL_LOGIT_COPIES * batch * candidates * DTYPE_BYTES["fp32"],
                   f"retrieval head {head}'s logits against {candidates:,} candidates a sample")


def new_rows_per_batch(unit_group: PackedGroup, batch: int, window: int, profile: AccessProfile | None,
                       step_ids: int = 0, epochs: float = 1.0) -> float:
    """Rows a lookahead scratchpad fetches per batch: a row whose next read is more than W batches
    away leaves the window, and its slots' spare rows (the plan's `cache_rows` beyond the window's)
    keep it over the shorter of such gaps (`AccessModel.window_fetches`). Before Round 23 the
    window alone (distinct rows of W+1 batches minus W's): two_task's scratchpad fetched 7,254 rows
    a batch over a synthetic epoch where that priced 10,556 (now 7,815). Averaged over the run's
    `epochs` (the spec's `training.epochs`): the scratchpad keeps its rows from one epoch to the
    next, so a small dataset's later epochs fetch fewer (`EpochCounts.fetches`)."""
    return lookahead_rows_per_batch(unit_group, batch, window, profile, step_ids, epochs)[0]


def lookahead_rows_per_batch(unit_group: PackedGroup, batch: int, window: int, profile: AccessProfile | None,
                             step_ids: int = 0, epochs: float = 1.0) -> tuple[float, float]:
    """(rows fetched, rows written back) per batch in the run's steps by a lookahead scratchpad
    (`new_rows_per_batch`; the write-backs less the rows still resident as the run ends where the
    epoch's reads are counted: `AccessModel.window_traffic`)."""
    model = group_access(unit_group, profile)
    draws = batch * ids_per_sample(unit_group, profile) + step_ids
    fetched, written = model.window_traffic(draws, window, float(unit_group.cache_rows or 0), epochs)
    return max(0.0, fetched), max(0.0, written)


def group_access(group: PackedGroup, profile: AccessProfile | None) -> AccessModel:
    """Access distribution of a group's packed rows (profile or Zipf), members weighted."""
    lookups = {t.table: 0 for t in group.tables}
    for f in group.fields:
        lookups[f.table] += f.max_len
    return group_model(((t.table, t.rows, lookups[t.table]) for t in group.tables), profile)[0]


def access_source(group: PackedGroup, profile: AccessProfile | None) -> str:
    """Where a group's access model comes from: "profile", "mixed" or "zipf"."""
    return group_model(((t.table, t.rows, 1.0) for t in group.tables), profile)[1]


def access_description(profile: AccessProfile | None, path: str | Path | None = None) -> str:
    """What a prediction's cache traffic comes from (`CostPrediction.access_profile`).

    Args:
        profile: the access profile document, or None (the Zipf model of each table).
        path: the file it was given as (`--profile`); None for one sampled by the caller.

    Example:
        >>> access_description({"samples": 2000, "sample_rate": 0.1})
        'sampled: 2,000 rows of the training data (sample rate 0.1)'
    """
    if profile is None:
        return ACCESS_NONE
    rows = int(profile.get("samples", 0))
    if path is not None:  # the file's digest, so that training with the plan knows it again
        digest = profile.get("given_sha256")
        return f"given {path} ({rows:,} sampled rows)" + (f" sha256 {digest[:16]}" if isinstance(digest, str) else "")
    return f"{ACCESS_SAMPLED}{rows:,} rows of the training data (sample rate {float(profile.get('sample_rate', 1.0)):g})"


def _unit_bytes(u: _Unit, batch: int, window: int, profile: AccessProfile | None, epochs: float = 1.0) -> float:
    """Host -> device bytes of one unit per step: ids, offsets and the rows it must move (a
    lookahead group's averaged over the run's `epochs`)."""
    index = _index_bytes(u, batch)
    pooled = 2 * (batch + u.step_ids) * u.bags * u.dim * u.elem  # rows out and gradients back
    rule = PLACEMENTS[u.placement].traffic
    if rule == "window" and u.group is not None:
        return index + u.row_bytes * sum(lookahead_rows_per_batch(u.group, batch, window, profile, u.step_ids, epochs))
    if rule == "hot_cold" and u.group is not None:
        return index + hot_cold_bytes(group_access(u.group, profile), u.cache_rows, u.lookups(batch), u.ids,
                                      u.dim * u.elem, u.row_bytes, epoch_batches(profile, batch))
    return index + (1.0 - u.hit_rate) * pooled


def _index_bytes(u: _Unit, batch: int) -> float:
    """Ids and offsets of one unit per step (a sampled negative is one more sample of S bags)."""
    return (u.lookups(batch) + (batch + u.step_ids) * u.bags + 1) * INDEX_BYTES


def casting_bytes(ids: float, distinct: float, mean: bool) -> float:
    """Bytes of the casting index of `ids` lookups over `distinct` rows, which the data stage
    computes for a group's step and the transfer stage sends with its ids
    (`operators.casting.Casting`: the unique ids, their counts and offsets and the sorted bags,
    int64, and with `mean` pooling a float64 scale per id, `operators.casting.bag_scale`).

    Example:
        >>> casting_bytes(10, 4, False), casting_bytes(10, 4, True)
        (184, 264)
    """
    return (ids + 3 * distinct + 1 + (ids if mean else 0)) * INDEX_BYTES


def _unit_casting_bytes(u: _Unit, batch: int, profile: AccessProfile | None) -> float:
    """`casting_bytes` of a unit's step (its distinct rows expected by its access model)."""
    ids = u.lookups(batch)
    return casting_bytes(ids, _distinct_rows(u, ids, profile), u.mean)


def sends_ids(u: _Unit) -> bool:
    """Whether a unit's ids and casting go to the device each step: a device-resident group's
    with the batch (the transfer stage), a cached group's as its slots (its cache module); an
    uncached host group is looked up on the host and only its rows travel."""
    info = PLACEMENTS[u.placement]
    return info.rows_on == "device" or info.cached


def upload_tensors(units: list[_Unit]) -> int:
    """Tensors copied to the device a step from pageable memory: dense features, labels, and per
    unit whose ids go there (`sends_ids`) its ids, offsets and casting (4 tensors, 5 with a
    pooling scale)."""
    return 2 + sum(6 + u.mean for u in units if sends_ids(u))


def upload_seconds(device: DeviceProfile, nbytes: float, tensors: int) -> float:
    """Seconds the transfer stage's copies of a staged batch take: `tensors` copies of `nbytes`
    together at the profile's upload rate (a calibrated profile's pageable copies; else the
    datasheet link), 0 where the host is the device."""
    if not device.pcie_gbps:
        return 0.0
    rate = device.upload_gbps or device.pcie_gbps
    return tensors * (device.upload_us or device.launch_us) * 1e-6 + nbytes / (rate * 1e9)


def predict(graph: OpGraph, spec: ModelSpec, device: DeviceProfile, *, micro_batches: int = 1,
            profile: AccessProfile | None = None, access: str | None = None) -> CostPrediction:
    """Predict one training step of `graph` on `device` (see the module docstring); with a world
    size above 1 (the `shard` pass's), times, bytes and memory are one rank's, on its B / W samples.
    The prediction says where its constants come from and, as `access` (default:
    `access_description(profile)`), what its cache traffic comes from."""
    meta = graph.graph.get("plan")
    world = meta.world_size if meta is not None else 1
    batch = -(-spec.training.batch_size // world)  # samples per rank
    window = spec.plan.window
    units = _units(graph, profile)
    n_dense = len(spec.dense_features)

    rank_scale, staging_rate, call_us = shared_cores(device, world)  # ranks sharing this host's cores
    call_us = step_call_us(device, world, call_us)
    fit = step_call_fit(device, world)  # (fixed seconds a step, us per call) fitted on two plans
    if fit is not None:
        call_us = fit[1]
    ids = sum(u.ids for u in units)
    staging = (batch * (ids + n_dense) + sum(u.step_ids for u in units)) / staging_rate
    staging += managed_seconds(graph, spec, device, batch, profile)
    staging += sum(exchange_seconds(u, device) for u in units)
    h2d = sum(_unit_bytes(u, batch, window, profile, spec.training.epochs) for u in units)
    batch_bytes = batch * (n_dense + len(spec.heads)) * 4
    h2d += batch_bytes
    transfer = 0.0
    if device.pcie_gbps:  # a batch's tensors are copied from pageable memory, the rows the caches move pinned
        sending = [u for u in units if sends_ids(u)]
        index = sum(_index_bytes(u, batch) for u in sending)
        castings = sum(_unit_casting_bytes(u, batch, profile) for u in sending)
        rows = h2d - batch_bytes - index  # the rows host-side groups move (and uncached host groups' ids)
        h2d += castings
        transfer = (upload_seconds(device, batch_bytes + index + castings, upload_tensors(units))
                    + rows / (device.pcie_gbps * 1e9))

    mb = max(1, micro_batches)
    scale = device.compute_scale  # the dense side's in-situ factor
    sparse = backward_sparse = 0.0
    for u in units:
        forward_s, backward_s = sparse_seconds(u, device, batch, profile)
        sparse += forward_s * rank_scale
        backward_sparse += backward_s * rank_scale

    bf16 = spec.training.precision == "bf16"
    dense, dense_backward = dense_seconds(graph, device, -(-batch // mb), bf16, spec.training.precision)
    dense = (dense * mb * scale + device.step_us * 1e-6) * rank_scale
    dense_backward = dense_backward * mb * scale * rank_scale
    update = dense_update_seconds(graph, spec, device) * scale * rank_scale
    backward = dense_backward + backward_sparse + update

    stages = (("staging", staging), ("transfer", transfer), ("sparse", sparse),
              ("dense", dense), ("backward", backward))
    serial = sum(t for _, t in stages)
    sparse_side, dense_side = transfer + sparse + backward_sparse, dense + backward - backward_sparse
    if device.overlaps and mb > 1:
        extra = (mb - 1) * 3 * len(units) * device.launch_us * 1e-6
        device_time = max(sparse_side, dense_side) + min(sparse_side, dense_side) / mb + extra
    else:
        device_time = sparse_side + dense_side
    overlap = max(staging, device_time) if device.overlaps else staging + device_time
    traffic = exchange_traffic(graph, spec, units, batch, world, profile)
    exchange_s = 0.0
    if world > 1:
        link = device_link(device, world)
        if call_us is not None:
            link = replace(link, latency_us=call_us)
        calls = sum(exchange.collectives(u.group) for u in units if u.group is not None) + traffic.dense_calls
        exchange_s = exchange.seconds(traffic.total, calls, link) + rank_skew_seconds(device, world)
        exchange_s += fit[0] if fit is not None else 0.0
        serial += exchange_s
        if call_us is not None:  # the collectives' threads find no free core: nothing overlaps them
            overlap += exchange_s
        else:
            overlap = max(overlap, exchange_s) + min(overlap, exchange_s) / (len(units) + 1)

    maps = managed_map_bytes(spec, world) if not device.overlaps else 0  # host memory: the device where nothing overlaps
    memory = _memory(graph, spec, units, -(-batch // mb), traffic.buffers if world > 1 else None, maps)  # the largest
    epoch_s = epoch_start_seconds(device, epoch_batches(profile, spec.training.batch_size)) if world == 1 else 0.0
    lean_s = epoch_lean_seconds(device, epoch_batches(profile, spec.training.batch_size)) if world == 1 else 0.0
    return CostPrediction(
        target=device.name,
        batch_size=spec.training.batch_size,
        micro_batches=mb,
        stage_ms=tuple((name, round(t * 1e3, 6)) for name, t in stages),
        step_ms_serial=round((serial + lean_s) * 1e3, 6),
        step_ms_overlap=round((overlap + lean_s) * 1e3, 6),
        samples_per_s=round(spec.training.batch_size / (overlap + epoch_s), 3) if overlap > 0 else 0.0,
        h2d_bytes_per_step=int(h2d) if device.pcie_gbps or any(PLACEMENTS[u.placement].host_side for u in units) else 0,
        memory=memory,
        peak_memory_bytes=sum(b for _, b in memory),
        world_size=world,
        exchange_bytes_per_step=int(traffic.total),
        exchange_ms=round(exchange_s * 1e3, 6),
        group_exchange_bytes=tuple((name, int(b)) for name, b in traffic.by_group),
        constants=device.constants,
        access_profile=_with_epochs(access if access is not None else access_description(profile), spec, units,
                                    profile),
    )


def _with_epochs(access: str, spec: ModelSpec, units: list[_Unit], profile: AccessProfile | None) -> str:
    """`access` noting the run's epochs where a lookahead group's traffic is priced over more
    than one (the profile counts an epoch's reads: `EpochCounts`)."""
    epochs = spec.training.epochs
    if epochs <= 1 or profile is None:
        return access
    if not any(PLACEMENTS[u.placement].traffic == "window" and u.group is not None
               and epoch_counted((t.table for t in u.group.tables), profile) for u in units):
        return access
    return f"{access}; lookahead traffic over {epochs} epochs"


def managed_lookups(graph: OpGraph, spec: ModelSpec, batch: int, profile: AccessProfile | None = None) -> float:
    """Lookups of managed tables in a step of `batch` samples: per managed table its fields'
    max_len sum per sample, or the access profile's mean accesses per sample where it counts the
    table (as `ids_per_sample`).

    Example:
        >>> managed_lookups(make_plan(load_spec("specs/managed_movielens.yaml")).graph,
        ...                 load_spec("specs/managed_movielens.yaml"), 1024)  # doctest: +SKIP
        2048.0
    """
    meta = graph.graph.get("plan")
    managed = {t.name for t in spec.tables if t.managed is not None}
    if meta is None or not managed:
        return 0.0
    tables, samples = (profile or {}).get("tables", {}), (profile or {}).get("samples", 0)
    per_sample: dict[str, float] = {}
    for group in meta.groups:
        for f in group.fields:
            if f.table in managed:
                per_sample[f.table] = per_sample.get(f.table, 0.0) + f.max_len
    for name in per_sample:
        if samples and name in tables:
            per_sample[name] = float(tables[name].get("accesses", 0)) / samples
    return batch * sum(per_sample.values())


def managed_seconds(graph: OpGraph, spec: ModelSpec, device: DeviceProfile, batch: int,
                    profile: AccessProfile | None = None) -> float:
    """Seconds a step's managed tables cost the trainer beyond the step's ops: the reset of the
    rows an eviction pass freed and the replay of the data stage's map steps on the model's maps
    (`ManagedState.before_step` / `after_step`), `managed_ns_per_id` per managed lookup (measured
    by `flowrec calibrate` on a spec with managed tables as what they add to steps run as the
    trainer runs them, the replay on its own thread beside the next steps; 0 otherwise). Host work of the trainer's
    process, priced with staging: on the CPU the replay thread shares the trainer's cores and
    interpreter lock (the step takes it on top of its compute), on a device with its own host it
    overlaps the device's work."""
    if not device.managed_ns_per_id:
        return 0.0
    return managed_lookups(graph, spec, batch, profile) * device.managed_ns_per_id * 1e-9


def shared_cores(device: DeviceProfile, world: int) -> tuple[float, float, float | None]:
    """(compute factor, staging values per second, us per collective call or None) of one of
    `world` ranks on `device`.

    Where the host is the device (no link: the CPU) the ranks of a `--nproc` run are processes of
    one machine, each with compute threads sized to its share of the cores (`thread_budget`), so
    together they fill the cores: each rank's compute shares memory bandwidth and caches with the
    others', and its data threads find no free core (one process with one compute thread on two
    cores leaves them one), a collective waits until the scheduler runs the peer's side of it, and
    its communication thread finds no free core to overlap the step's compute. `flowrec calibrate
    --nproc N` measures these on the spec's own steps, N processes stepping at once and meeting
    in a collective after each (`rank_compute_scale`, `rank_staging_values_per_s`,
    `rank_collective_us`: a call's cost; None where not measured, then the link's own and the
    exchange overlapping compute as on separate cores); without that measurement (or for one
    rank, or a device with its own host) one process's hold: (1.0, `staging_values_per_s`, None).

    Example:
        >>> shared_cores(DEVICES["cpu"], 2)
        (1.0, 20000000.0, None)
    """
    if world <= 1 or device.overlaps:
        return 1.0, device.staging_values_per_s, None
    return (device.rank_compute_scale, device.rank_staging_values_per_s or device.staging_values_per_s,
            device.rank_collective_us or None)


def step_call_us(device: DeviceProfile, world: int, otherwise: float | None) -> float | None:
    """Microseconds one collective call of `world` ranks on `device` costs inside their own steps:
    `rank_step_call_us`, measured by `flowrec calibrate --nproc N` on the world-size plan's real
    sharded step (its exchange, the dense gradients' all-reduce, the loss agreement) run by N
    processes at once, what that step takes beyond the same ranks' one-process step per call
    (`flowrec.measure.concurrent.step_call_us`). A call there costs what the scheduler gives the
    peer's communication thread while both ranks' compute and data threads are busy, which an
    idle call after a step (`rank_collective_us`) does not show. `otherwise` (`shared_cores`'s
    call) where not measured, for one rank, or on a device with its own host.

    Example:
        >>> step_call_us(replace(DEVICES["cpu"], rank_step_call_us=1500.0), 2, 450.0), step_call_us(DEVICES["cpu"], 2, 450.0)
        (1500.0, 450.0)
    """
    if world <= 1 or device.overlaps or not device.rank_step_call_us:
        return otherwise
    return device.rank_step_call_us


def step_call_fit(device: DeviceProfile, world: int) -> tuple[float, float] | None:
    """(seconds a step, us per collective call) that `world` ranks' sharded steps on `device` take
    beyond their one-process step and their exchange's bytes: `rank_step_fixed_us` and
    `rank_step_per_call_us`, fitted by `flowrec calibrate --nproc N` on two sharded plans of the
    spec with different call counts (`flowrec.measure.concurrent.call_fit`: two measurements, two
    unknowns). One lumped price per call (`rank_step_call_us`) is right only at the call count it
    was measured at; the fit prices a plan with other calls (another budget's shardings) by what
    the calls measured cost. None where not fitted (a spec whose budgets all shard alike), for one
    rank, or on a device with its own host: then `step_call_us` prices each call.

    Example:
        >>> cpu = replace(DEVICES["cpu"], rank_step_fixed_us=3000.0, rank_step_per_call_us=400.0)
        >>> step_call_fit(cpu, 2), step_call_fit(cpu, 1), step_call_fit(DEVICES["cpu"], 2)
        ((0.003, 400.0), None, None)
    """
    if world <= 1 or device.overlaps or not device.rank_step_per_call_us:
        return None
    return device.rank_step_fixed_us * 1e-6, device.rank_step_per_call_us


def step_collectives(graph: OpGraph, spec: ModelSpec, profile: AccessProfile | None = None) -> tuple[int, float]:
    """(collective calls, bytes one rank sends) of a step of `graph`'s plan over its world size,
    as `predict` prices its exchange: per group its sharding's calls, then the dense collectives
    (the gradients' buckets, the loss agreement, an in-batch gather); (0, 0.0) for one rank.

    Example:
        >>> step_collectives(make_plan(load_spec("specs/movielens.yaml"), world_size=2).graph,
        ...                  load_spec("specs/movielens.yaml"))  # doctest: +SKIP
        (6, 81920.0)
    """
    meta = graph.graph.get("plan")
    world = meta.world_size if meta is not None else 1
    if world <= 1:
        return 0, 0.0
    batch = -(-spec.training.batch_size // world)
    units = _units(graph, profile)
    traffic = exchange_traffic(graph, spec, units, batch, world, profile)
    calls = sum(exchange.collectives(u.group) for u in units if u.group is not None) + traffic.dense_calls
    return calls, traffic.total


def rank_skew_seconds(device: DeviceProfile, world: int) -> float:
    """Seconds a step of `world` ranks on `device` costs beyond its slowest rank's typical step,
    once per step: the ranks meet in every step's collectives, so a step lasts as long as the
    slowest rank of that step, not of a typical one (`rank_skew_us`, measured by `flowrec
    calibrate --nproc N` with N processes stepping at once, `flowrec.measure.concurrent`). Where
    `shared_cores` holds (one rank, or a device with its own host), or not measured: 0.

    Example:
        >>> rank_skew_seconds(replace(DEVICES["cpu"], rank_skew_us=250.0), 2), rank_skew_seconds(DEVICES["cpu"], 2)
        (0.00025, 0.0)
    """
    if world <= 1 or device.overlaps:
        return 0.0
    return device.rank_skew_us * 1e-6


def epoch_start_seconds(device: DeviceProfile, batches: float | None) -> float:
    """Seconds a step of one process pays, on average, for its epoch's start: the trainer opens a
    new batch pipeline for every epoch (`flowrec.measure.step.epoch_seconds`), so an epoch of
    several batches costs `epoch_start_us` beyond its steady steps (the wait for its first batch,
    its first steps beside the pipeline's start, the close) and one of a single batch
    `epoch_single_us` (its batch staged while the step waits, nothing staged beside it: measured
    apart, never a share of a longer epoch's start), spread over the epoch's `batches` (rounded
    up: the trainer keeps an epoch's last, shorter batch; `epoch_batches`). 0 where the epoch's
    length is unknown (no access profile of the data) or the profile did not measure it. An epoch
    of 2-7 batches is priced at the measured 8-batch epoch's cost, which also holds the slowdown
    of steps it does not have (the third: 0.2 of 2.4 ms measured on movielens).

    Example:
        >>> cpu = replace(DEVICES["cpu"], epoch_start_us=2400.0, epoch_single_us=900.0)
        >>> epoch_start_seconds(cpu, 8.0), epoch_start_seconds(cpu, 1.0), epoch_start_seconds(cpu, None)
        (0.0003, 0.0009, 0.0)
    """
    if not batches or batches <= 0:
        return 0.0
    count = math.ceil(batches - 1e-9)
    return (device.epoch_single_us if count == 1 else device.epoch_start_us / count) * 1e-6


def epoch_lean_seconds(device: DeviceProfile, batches: float | None) -> float:
    """Seconds an epoch's start moves the typical step of one process by, for epochs of `batches`
    batches (rounded up, as `epoch_start_seconds`): the n-th of `epoch_lean_us` for an epoch of
    n <= its length batches (measured: the timing rule over the steps at positions 0 .. n-1 of
    the trainer's epochs, less that over their second half's, `flowrec.measure.spec`), and for a
    longer epoch the last one scaled by its share of the epoch (length / batches: the same few
    slowed steps among more mid-epoch ones move the median proportionally less). 0 where the
    epoch's length is unknown (no access profile of the data) or the profile did not measure it.
    The typical step is what a run's step is measured by (`tools/bench_costmodel.py`: the timing
    rule over every step of a run); the throughput holds the whole start (`epoch_start_seconds`).

    Example:
        >>> cpu = replace(DEVICES["cpu"], epoch_lean_us=(400.0, 300.0, 200.0, 120.0, 100.0, 90.0, 80.0, 60.0))
        >>> [round(epoch_lean_seconds(cpu, b) * 1e6, 3) for b in (1.0, 2.5, 8.0, 16.0, 24.0)], epoch_lean_seconds(cpu, None)
        ([400.0, 200.0, 60.0, 30.0, 20.0], 0.0)
    """
    lean = device.epoch_lean_us
    if not batches or batches <= 0 or not lean:
        return 0.0
    count = math.ceil(batches - 1e-9)
    if count <= len(lean):
        return lean[count - 1] * 1e-6
    return lean[-1] * len(lean) / count * 1e-6


def sparse_seconds(u: _Unit, device: DeviceProfile, batch: int, profile: AccessProfile | None
                   ) -> tuple[float, float]:
    """(forward, backward) seconds of one lookup unit on `batch` samples: the pooled lookup; the
    casting, gather-reduce and fused update of its distinct rows; for cached placements the row
    map of every id and unique row (ids to slots) and the gathers of the rows they miss; for a
    `host` table on a device with its own host, the host's gathers of its rows.

    A `host` table has no row map (`HostEmbedding` looks its ids up in the packed table as a
    device-resident one does), and where the host is the device (the CPU: no link) its lookup is
    the host gather already: pricing a map and a second gather there put 191 ms on wide_1000's
    1.6 s step (a 64 MiB budget makes its six groups host tables), whose lookups measured the same
    host-placed or resident (99-120 against 100-107 ms a batch of 8,192 on this 2-core CPU)."""
    ids = u.lookups(batch)
    distinct = _distinct_rows(u, ids, profile)
    per_id, per_elem = device.per_id_ns
    forward = device.kernel_us("sparse") * 1e-6 + ids * (per_id + u.dim * per_elem) * 1e-9
    fixed_us, id_ns, id_elem_ns, row_ns, row_elem_ns = device.sparse_update_cost(u.optimizer)
    backward = (fixed_us * 1e-6 + ids * (id_ns + u.dim * id_elem_ns) * 1e-9
                + distinct * (row_ns + u.dim * row_elem_ns) * 1e-9)
    info = PLACEMENTS[u.placement]
    if info.cached:
        forward += (ids + distinct) * device.map_ns(u.local_rows) * 1e-9
    if info.cached or (info.rows_on == "host" and device.pcie_gbps is not None):
        forward += (1.0 - u.hit_rate) * distinct / device.host_gather_rows_per_s
    return forward, backward


def _distinct_rows(u: _Unit, ids: float, profile: AccessProfile | None) -> float:
    """Expected distinct rows of `ids` lookups of a unit (its access model; at most its rows)."""
    if u.group is None:
        return min(ids, float(u.rows)) if u.rows else ids
    return min(group_access(u.group, profile).distinct(ids), float(u.local_rows))


def _dense_ops(graph: OpGraph) -> Iterator[tuple[Op, int]]:
    """(op, input edges) of every dense op of `graph` (neither sparse nor input)."""
    skip = SPARSE_KINDS | INPUT_KINDS
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind not in skip:
            yield op, graph.in_degree(node)


def dense_seconds(graph: OpGraph, device: DeviceProfile, batch: int, bf16: bool = False,
                  precision: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the dense ops and the loss on a (micro-)batch of `batch`
    samples: an op the profile measured (`dense_ops`, for the run's `precision`) by its measured
    times plus the kernels the runtime runs around its module, any other kernel by kernel
    (`flowrec.planner.op_work`; an unmeasured retrieval loss adds its softmax's kernels)."""
    measured = dict(device.dense_ops)
    precision = precision or ("bf16" if bf16 else "fp32")
    forward = backward = 0.0
    tower, drawn = sampled_item_tower(graph)
    for op, inputs in _dense_ops(graph):
        times = measured.get(op_signature(op, inputs, precision)) if measured else None
        for rows in (batch, drawn) if op.name in tower else (batch,):  # the drawn items through their tower
            if times is None:
                work = op_work(op, rows, inputs)
            else:
                work = outside_kernels(op, rows, inputs)
                op_forward, op_backward = measured_op_seconds(times, rows)
                forward, backward = forward + op_forward, backward + op_backward
            forward += kernel_seconds(work.forward, device, bf16)
            backward += kernel_seconds(work.backward, device, bf16, backward=True)
        if times is None and op.kind == "loss" and op.attr("retrieval"):  # measured: the loss holds it
            softmax = retrieval_work(graph, op, batch)
            forward += kernel_seconds(softmax.forward, device, bf16)
            backward += kernel_seconds(softmax.backward, device, bf16, backward=True)
    return forward, backward


def sampled_item_tower(graph: OpGraph) -> tuple[frozenset[str], int]:
    """(the dense nodes of a retrieval head's item tower, N) for a head with N sampled negatives:
    a step runs that tower on the N drawn items besides the batch's rows
    (`flowrec.runtime.retrieval.item_vectors`); (empty, 0) otherwise, and for an item tower that is
    the item id's embedding alone."""
    skip = SPARSE_KINDS | INPUT_KINDS
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind == "head" and op.attr("task") == "retrieval" and op.attr("negatives") == "sampled":
            source = input_slots(graph, node)[1].source
            nodes = nx.ancestors(graph, source) | {source}
            tower = frozenset(n for n in nodes if graph.nodes[n]["op"].kind not in skip)
            return tower, int(op.attr("num_negatives") or 0)
    return frozenset(), 0


def retrieval_work(graph: OpGraph, loss: Op, batch: int) -> OpWork:
    """The kernels of the loss's retrieval softmax (`op_work.retrieval_softmax`) on `batch`
    samples: its head's tower width, metric and candidates (in-batch: every rank's rows of the
    batch; sampled: 1 + N)."""
    index, metric = loss.attr("retrieval")[:2]
    head = graph.nodes[f"head_{loss.attr('heads')[index]}"]["op"]
    meta = graph.graph.get("plan")
    world = meta.world_size if meta is not None else 1
    sampled = head.attr("negatives") != "in_batch"
    candidates = 1 + int(head.attr("num_negatives") or 0) if sampled else batch * world
    return retrieval_softmax(batch, head.attr("in_features") // 2, candidates,
                             bool(head.attr("logq_correction")), metric == "cosine")


def measured_op_seconds(points: tuple[float, ...], batch: int) -> tuple[float, float]:
    """(forward, backward) seconds of a measured op on `batch` samples: linear in the batch between
    the two measured batch sizes nearest to it (beyond the measured ones, through the two at that
    end), at least 0.

    Example:
        >>> measured_op_seconds((16, 10.0, 20.0, 1024, 1000.0, 2000.0), 520)
        (0.000505, 0.00101)
    """
    rows = sorted(zip(points[0::3], points[1::3], points[2::3]))
    if len(rows) == 1:
        b, fwd, bwd = rows[0]
        return fwd * batch / b * 1e-6, bwd * batch / b * 1e-6
    i = 1
    while i < len(rows) - 1 and rows[i][0] < batch:
        i += 1
    (b0, f0, g0), (b1, f1, g1) = rows[i - 1], rows[i]
    share = (batch - b0) / (b1 - b0)
    return max(0.0, f0 + (f1 - f0) * share) * 1e-6, max(0.0, g0 + (g1 - g0) * share) * 1e-6


def kernel_seconds(kernels: Kernels, device: DeviceProfile, bf16: bool = False, backward: bool = False) -> float:
    """Seconds of a kernel list on `device` (see `DeviceProfile`); `backward`: its layers are
    backward passes."""
    fixed_us, tflops, gbps = device.layer_constants(bf16, backward)
    peak = tflops * 1e12 * device.gemm_efficiency
    elem = 2 if bf16 else 4
    seconds = kernels.other * device.kernel_us("other") * 1e-6
    for m, k, n, count in kernels.gemms:
        seconds += fixed_us * 1e-6 + count * 2.0 * m * k * n / peak + count * elem * (m * k + k * n + m * n) / (gbps * 1e9)
    elementwise_s, elementwise_rate = device.kernel_us("elementwise") * 1e-6, device.elementwise_rate
    for moved in kernels.elementwise:
        seconds += elementwise_s + moved / elementwise_rate
    return seconds + sum(device.fresh_seconds(b) for b in kernels.fresh)


def dense_update_seconds(graph: OpGraph, spec: ModelSpec, device: DeviceProfile) -> float:
    """Seconds of one dense optimizer step over the dense parameters (per tensor + per element)."""
    tensors = elements = 0
    for op, inputs in _dense_ops(graph):
        tensors += op_work(op, 1, inputs).param_tensors
        elements += op.param_bytes // 4
    per_tensor_us, per_elem_ns = device.dense_update_cost(spec.dense_optimizer.name)
    return tensors * per_tensor_us * 1e-6 + elements * per_elem_ns * 1e-9


@dataclass(frozen=True)
class Traffic:
    """What one rank sends per step: per group, the dense collectives (the gradients' all-reduce,
    the loss agreement, an in-batch retrieval head's gather) and their calls, and exchange buffer
    bytes."""

    by_group: tuple[tuple[str, float], ...] = ()
    dense: float = 0.0
    dense_calls: int = 0
    buffers: int = 0

    @property
    def total(self) -> float:
        return sum(b for _, b in self.by_group) + self.dense


def exchange_traffic(graph: OpGraph, spec: ModelSpec, units: list[_Unit], batch: int, world: int,
                     profile: AccessProfile | None) -> Traffic:
    """Per-rank communication of a step with `batch` samples per rank (`flowrec.planner.exchange`)."""
    if world <= 1:
        return Traffic()
    by_group, buffers = [], 0
    for u in units:
        if u.group is None:
            continue
        if u.group.sharding == "row_wise":
            distinct = group_access(u.group, profile).distinct(u.lookups(batch))
            sent = exchange.row_wise_bytes(u.group, distinct, world)
            buffers += int(2 * sent)  # send + receive
        else:
            sent = exchange.replicated_bytes(u.group, world)
            buffers += u.rows * u.dim * exchange.GRAD_BYTES
        by_group.append((u.group.name, sent))
    params = sum(graph.nodes[n]["op"].param_bytes for n in graph if graph.nodes[n]["op"].kind not in SPARSE_KINDS)
    calls = 1 + params // exchange.DDP_BUCKET_BYTES + exchange.AGREEMENT_CALLS
    dense = exchange.dense_bytes(params, world)
    gathered = in_batch_gather(graph)
    if gathered:  # every rank's item vectors are the in-batch candidates
        calls += exchange.GATHER_CALLS
        dense += exchange.gather_bytes(batch, gathered, world)
    return Traffic(tuple(by_group), dense, calls, buffers)


def in_batch_gather(graph: OpGraph) -> int:
    """The tower width whose vectors an in-batch retrieval head gathers from every rank in a
    step (`gather_over_ranks`), or 0 (no such head)."""
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind == "loss" and op.attr("retrieval"):
            head = graph.nodes[f"head_{op.attr('heads')[op.attr('retrieval')[0]]}"]["op"]
            if head.attr("negatives") == "in_batch":
                return head.attr("in_features") // 2
    return 0


def _memory(graph: OpGraph, spec: ModelSpec, units: list[_Unit], micro_batch: int,
            exchange_buffers: int | None = None, maps: int = 0) -> tuple[tuple[str, int], ...]:
    tables = sum(u.local_rows * u.row_bytes for u in units if PLACEMENTS[u.placement].rows_on == "device")
    caches = sum(u.cache_rows * u.row_bytes for u in units if PLACEMENTS[u.placement].cached)
    parts = (
        ("tables", int(tables)),
        ("caches", int(caches)),
        ("activations", int(activation_bytes(graph, micro_batch, spec.training.precision))),
        ("dense", int(dense_memory_bytes(graph, spec))),
    )
    parts += (("exchange", int(exchange_buffers)),) if exchange_buffers is not None else ()
    return parts + ((("maps", int(maps)),) if maps else ())
