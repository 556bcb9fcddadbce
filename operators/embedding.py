"""Packed embedding bag: every field of a packed group looked up in one call, casted backward.

The packed table concatenates the group's logical tables (row offsets from its layout,
`operators.packed_layout.PackedLayout`).
The forward is one `embedding_bag` over flat packed ids and bag offsets (bag = b * S + s), giving
(B, S, D); mean bags are divided by their length (sum / n, as `embedding_bag(mode="mean")`).
The backward never forms a dense gradient: the casted gather-reduce (`operators.casting`) yields
the coalesced gradient of the unique rows and the group's fused sparse optimizer
(`operators.sparse_optim`) updates those rows and their state in place. The weight and state are
buffers, not parameters: torch.optim never sees them.

Example:
    >>> from operators.packed_layout import BagField, Layout, TableRange
    >>> g = Layout("g", 4, "fp32", ("sgd", 0.1, ()), (TableRange("t", 10, 0),), (BagField("f", "t", 1, "sum"),))
    >>> emb = PackedEmbeddingBag(g, seed=0)
    >>> out = emb(torch.tensor([3, 7]), torch.tensor([0, 1, 2]))
    >>> out.shape
    torch.Size([2, 1, 4])
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.nn.functional as F

from operators.packed_layout import PackedLayout
from operators.backends import cupy_usable, fused_backward
from operators.casting import Casting, compute_casting
from operators.sparse_optim import SparseOptimizer, make_optimizer

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
}


def table_seed(seed: int, table: str) -> int:
    """Deterministic generator seed of one logical table (independent of packing)."""
    return (seed * 1_000_003 + zlib.crc32(table.encode())) % (2**63 - 1)


def init_table_rows(table: str, rows: int, dim: int, seed: int = 0,
                    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Initial rows of one logical table: uniform(-sqrt(1/rows), sqrt(1/rows)) as in DLRM, drawn
    on the host so that a table starts from the same rows on every device.

    Args:
        table: logical table name (seeds its generator, so packing does not change the rows).
        rows: rows of the table.
        dim: embedding dim.
        seed: the model seed.
        dtype: dtype of a newly allocated result.
        out: optional contiguous (rows, dim) destination (e.g. a slice of the packed table).

    Returns:
        The (rows, dim) initial rows (`out` when given).
    """
    if out is None:
        out = torch.empty(rows, dim, dtype=dtype)
    if out.device.type == "meta":  # no data to fill (a model restored by assignment, e.g. export)
        return out
    gen = torch.Generator().manual_seed(table_seed(seed, table))  # host generator: the same rows on every device
    bound = (1.0 / rows) ** 0.5
    if out.device.type == "cpu":
        return out.uniform_(-bound, bound, generator=gen)
    return out.copy_(torch.empty(rows, dim, dtype=out.dtype).uniform_(-bound, bound, generator=gen))


def init_table_chunks(table: str, rows: int, dim: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                      chunk_rows: int = 1 << 18) -> Iterator[tuple[int, torch.Tensor]]:
    """`init_table_rows` drawn `chunk_rows` rows at a time, as (first row, rows) pairs: the same
    generator, so the chunks put together are bitwise the whole table (CPU draws are serial), and
    at most one chunk is held (a rank keeping its share of a table too big for the host twice)."""
    gen = torch.Generator().manual_seed(table_seed(seed, table))
    bound = (1.0 / rows) ** 0.5
    for start in range(0, rows, max(1, chunk_rows)):
        yield start, torch.empty(min(chunk_rows, rows - start), dim, dtype=dtype).uniform_(-bound, bound, generator=gen)


PARALLEL_INIT_ROWS = 1 << 20  # packed rows from which a host table's tables are drawn on several threads

_RESTORING: ContextVar[bool] = ContextVar("flowrec_restoring_tables", default=False)


@contextmanager
def restoring_tables() -> Iterator[None]:
    """Packed tables built inside are allocated but not drawn (`init_packed_rows` leaves them as
    allocated): for a model whose every table row is restored right after, from a checkpoint
    loaded with `load_state_dict` (strict: every weight and state buffer, whole). Drawing them
    first is wasted work at the start of `flowrec eval`, `flowrec.api.load`, `--resume` and
    `--init-from` (dlrm_criteo's 33.8 M rows: about 1.2 s on two threads; a distributed rank's
    shard, `flowrec.runtime.distributed.sharded`, is left undrawn too). The caller must not use the
    model when that load fails."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def restoring() -> bool:
    """Whether tables built now are left undrawn (inside `restoring_tables`)."""
    return _RESTORING.get()


def init_packed_rows(group: PackedLayout, seed: int, weight: torch.Tensor) -> None:
    """Fill `weight` (group.rows, dim) with the initial rows of each of the group's tables
    (`init_table_rows`, each into its own slice).

    Each table draws from a generator of its own, so on the host the tables are drawn on up to
    torch's intra-op thread count of threads, largest first: the same rows, bitwise, in a fraction
    of the time (torch's seeded `uniform_` runs on one thread; dlrm_criteo's 33.8 M rows took
    2.3-2.7 s on one thread and 1.2-1.3 s on two). A device table is drawn one table at a time:
    each table is drawn on the host and copied, and drawing several at once would hold several
    host copies. Inside `restoring_tables` nothing is drawn: the rows are restored next.
    """
    if restoring():
        return
    slots = sorted(group.tables, key=lambda slot: -slot.rows)
    threads = min(len(slots), torch.get_num_threads())

    def draw(slot) -> None:
        init_table_rows(slot.table, slot.rows, group.dim, seed, out=weight[slot.row_offset:slot.row_offset + slot.rows])

    if weight.device.type != "cpu" or threads < 2 or group.rows < PARALLEL_INIT_ROWS:
        for slot in slots:
            draw(slot)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="flowrec-init") as pool:
        for done in [pool.submit(draw, slot) for slot in slots]:
            done.result()  # a table's failure is raised here


def mean_bag_flags(group: PackedLayout) -> torch.Tensor:
    """Mean-pooling flag of each bag position within a sample.  # (S,) bool"""
    flags = [f.pooling == "mean" for f in group.fields
             for _ in range(f.max_len if f.pooling == "none" else 1)]
    return torch.tensor(flags, dtype=torch.bool)


class _CastedEmbeddingBag(torch.autograd.Function):
    """Forward: packed embedding bag; backward: casted gather-reduce + fused optimizer update."""

    @staticmethod
    def forward(ctx, trigger, module, ids, offsets, casting):
        ctx.module, ctx.ids, ctx.offsets, ctx.casting = module, ids, offsets, casting
        return module.lookup(ids, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        casting = ctx.casting
        if casting is None:
            casting = compute_casting(ctx.ids, ctx.offsets, module.mean_flags)
        elif casting.unique_ids.device != grad_out.device:
            casting = casting.to(grad_out.device)
        if module.weight.is_cuda and module.use_cupy is None:
            module.use_cupy = cupy_usable()
        module.last_backend = fused_backward(module.weight, module.state, module.optimizer,
                                             grad_out.reshape(casting.num_bags, -1), casting,
                                             module.use_cupy)
        return None, None, None, None, None


class PackedEmbeddingBag(torch.nn.Module):
    """All lookups of one packed group in one kernel, updated by its fused sparse optimizer.

    Args:
        group: the packed layout (tables with row offsets, fields in output order, optimizer).
        seed: model seed for the deterministic per-table init (`init_table_rows`).
        device: where the packed table lives.
        dtype: storage dtype (default: the group's dtype).

    Example:
        >>> emb = PackedEmbeddingBag(group)  # doctest: +SKIP
        >>> out = emb(batch.ids, batch.offsets, casting=precomputed)  # (B, S, D)  # doctest: +SKIP
        >>> out.sum().backward()  # rows updated in place by group.optimizer  # doctest: +SKIP
    """

    def __init__(self, group: PackedLayout, seed: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.dim = group.dim
        self.bags_per_sample = group.bags_per_sample
        self.optimizer: SparseOptimizer = make_optimizer(group.optimizer)
        self.use_cupy: bool | None = None  # decided at the first CUDA backward
        self.last_backend = ""  # "torch" or "cupy": which backward ran last
        dtype = dtype or TORCH_DTYPES[group.dtype]
        weight = torch.empty(group.rows, group.dim, dtype=dtype, device=device)
        init_packed_rows(group, seed, weight)
        state_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.register_buffer("weight", weight)
        self.register_buffer("state", self.optimizer.initial_state(
            group.rows, group.dim, state_dtype, device))
        flags = mean_bag_flags(group)  # decided on the host: no device sync
        self.register_buffer("mean_flags", flags.to(device) if bool(flags.any()) else None, persistent=False)

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Forward values without autograd: pooled rows of every bag.  # (B, S, D)"""
        out = F.embedding_bag(ids, self.weight, offsets, mode="sum",
                              include_last_offset=True)  # (NB, D)
        if self.mean_flags is not None:
            lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(out.dtype)  # (NB,)
            flags = self.mean_flags.repeat(out.shape[0] // self.bags_per_sample)
            out = out.div_(torch.where(flags, lengths, torch.ones_like(lengths)).unsqueeze(1))
        return out.view(-1, self.bags_per_sample, self.dim)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                casting: Casting | None = None) -> torch.Tensor:
        """Look up every bag; the backward updates the touched rows.

        Args:
            ids: packed row ids.  # (nnz,) int64
            offsets: bag boundaries, bag = b * S + s.  # (B * S + 1,) int64
            casting: precomputed `compute_casting(ids, offsets, mean_flags)` (else computed in
                the backward).

        Returns:
            Pooled embeddings.  # (B, S, D)
        """
        if not torch.is_grad_enabled():
            return self.lookup(ids, offsets)
        trigger = torch.empty(0, device=self.weight.device, requires_grad=True)
        return _CastedEmbeddingBag.apply(trigger, self, ids, offsets, casting)

    def read_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the weight and optimizer state of `rows`.  # (n, D), (n, k)"""
        return self.weight.index_select(0, rows), self.state.index_select(0, rows)

    def write_rows(self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Overwrite the weight and optimizer state of `rows` (unique)."""
        self.weight.index_copy_(0, rows, weights.to(self.weight.dtype))
        if self.state.shape[1]:
            self.state.index_copy_(0, rows, state.to(self.state.dtype))

    def table_rows(self, table: str) -> torch.Tensor:
        """A view of one logical table's rows inside the packed table.  # (rows, D)"""
        slot = next(t for t in self.group.tables if t.table == table)
        return self.weight[slot.row_offset:slot.row_offset + slot.rows]

    @classmethod
    def from_config(cls, config: dict, input_shapes: list) -> "PackedEmbeddingBag":
        """Registry hook: config {"group": PackedLayout, "seed": int, "device": str, "dtype": torch.dtype}."""
        return cls(config["group"], config.get("seed", 0), config.get("device"), config.get("dtype"))
