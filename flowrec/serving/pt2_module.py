"""The callable module of a checked `torch.export` program, without torch's generated guards where
flowrec's own check proves them.

``ExportedProgram.module()`` (torch 2.13) writes its guards as Python code by one pass over the
program's placeholders per guard: a 1,000-field package (1,000 guards, 2,001 inputs) spent 17.8 s
there before its first score, and 1.2 s with ``module(check_guards=False)``. The guards of a program
`flowrec export` writes only say that every input holds one batch of rows (the dense rows, and one
more offset than rows per sparse feature), which flowrec's own inputs always do
(`flowrec.serving.package.encoded_inputs`). `program_module` checks from the program's signature
that it takes what flowrec passes (dense (B, n) float32; per sparse feature int64 ids (nnz,) and
offsets (B + 1,); any number of rows up to `BATCH_ROWS`, any number of ids), refuses in one line a
program that does not (a fixed batch: torch's AssertionError at the first call before), and
takes the fast path when every guard is such a batch equality; else torch's guarded module.

Example:
    >>> module = program_module(torch.export.load(path), path, BATCH_ROWS)  # doctest: +SKIP
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from flowrec.serving.lookups import bad_dense, bad_sparse

MAX_IDS = 1 << 34  # ids per feature in one call that `flowrec export` declares (Dim nnz_i max)
_BATCH_TERM = r"(?:L\['dense'\]\.size\(\)\[0\]|\(\(-1\) \+ L\['sparse'\]\['[^'\\]*'\]\[1\]\.size\(\)\[0\]\))"
_OFFSETS_TERM = r"L\['sparse'\]\['[^'\\]*'\]\[1\]\.size\(\)\[0\]"
BATCH_GUARD = re.compile(rf"{_BATCH_TERM} == {_BATCH_TERM}"  # two inputs' rows are equal: nothing more
                         rf"|{_OFFSETS_TERM} == {_OFFSETS_TERM}")  # (two features' offsets: rows + 1 each)


def program_module(program: torch.export.ExportedProgram, path: Path, rows: int) -> torch.nn.Module:
    """The module of `program` (read from `path`) for calls of 1 to `rows` rows.

    Raises:
        ValueError: (one line) the program does not take every batch flowrec passes, or torch
            cannot make its module.
    """
    problem = input_problem(program, rows)
    if problem:
        raise ValueError(f"{path} does not fit the package's spec.json: {problem} (a model.pt2 of another "
                         "export?); export the run again")
    guards = getattr(program, "_guards_code", None)  # (private: another torch keeps its guards)
    fast = isinstance(guards, list) and all(isinstance(g, str) and BATCH_GUARD.fullmatch(g) for g in guards)
    try:
        # (no keyword where the guards stay: a torch without `check_guards` still loads)
        module = program.module(check_guards=False) if fast else program.module()
    except Exception as exc:
        raise ValueError(f"{path} is not a usable exported program ({type(exc).__name__})") from None
    if fast:  # every input constraint is proven above: the per-call check (2 passes over the inputs) too
        module.validate_inputs = False
    module.register_forward_pre_hook(InputShapes(_size(_user_inputs(program)[0], 1)), with_kwargs=True)
    return module


class InputShapes:
    """A forward pre-hook of a program's module that refuses, in one line naming the input and its
    shape (RuntimeError: `bad_dense`, `bad_sparse`), a dense input that is not 2-d, a sparse
    feature that is not (ids, offsets) of 1-d tensors, and offsets that are not one more than the
    dense input's rows. Without it an input of another number of dimensions met torch's guard code
    (`IndexError: tuple index out of range`) or a shape error deep in the program, and rows that
    disagree (the module without guards) a shape error. Shapes only, read in Python: no graph
    node, no value read (a few microseconds per feature and call).

    Args:
        width: the dense input's columns (the program's), or None where it has none fixed.
    """

    def __init__(self, width: object) -> None:
        self.width = width if isinstance(width, int) else None

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        dense = args[0] if args else kwargs.get("dense")
        sparse = args[1] if len(args) > 1 else kwargs.get("sparse")
        if not isinstance(dense, torch.Tensor) or dense.dim() != 2:
            raise RuntimeError(bad_dense("n" if self.width is None else self.width))
        if not isinstance(sparse, dict):
            return  # (torch's own error: the inputs' tree does not match)
        rows = dense.shape[0]
        for name, pair in sparse.items():
            ids, offsets = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
            if not (isinstance(ids, torch.Tensor) and isinstance(offsets, torch.Tensor)
                    and ids.dim() == 1 and offsets.dim() == 1):
                raise RuntimeError(bad_sparse(str(name), ids, offsets))
            if offsets.shape[0] != rows + 1:
                raise RuntimeError(bad_sparse(str(name), ids, offsets, rows))


def _user_inputs(program: torch.export.ExportedProgram) -> list:
    """The values of the program's user inputs (dense, then ids and offsets per feature)."""
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    return [values.get(name) for name in program.graph_signature.user_inputs]


def input_problem(program: torch.export.ExportedProgram, rows: int) -> str | None:
    """How the user inputs of `program` (dense, then ids and offsets per sparse feature; their tree
    is checked by `check_program`) refuse some batch of 1 to `rows` rows that flowrec passes, in
    words; None when they take every one."""
    inputs = _user_inputs(program)
    if not inputs or not all(isinstance(v, torch.Tensor) for v in inputs):
        return "its inputs are not all tensors"
    dense, ids, offsets = inputs[0], inputs[1::2], inputs[2::2]
    batch = _size(dense, 0)
    if isinstance(batch, int):
        return f"it takes batches of {batch} rows only"
    if batch is None or not batch.is_Symbol:
        return "its number of rows is not free"
    low, high = _range(program, batch)
    if low > 1 or high < rows:
        return f"it takes batches of {low} to {high} rows, not 1 to {rows}"
    if dense.dtype != torch.float32:
        return f"its dense input is {str(dense.dtype).removeprefix('torch.')}, not float32"
    seen = {batch}
    for i, (feature_ids, bounds) in enumerate(zip(ids, offsets)):
        nnz, edges = _size(feature_ids, 0), _size(bounds, 0)
        if feature_ids.dim() != 1 or bounds.dim() != 1 or feature_ids.dtype != torch.int64 or \
                bounds.dtype != torch.int64:
            return f"its sparse input {i} is not int64 ids and offsets"
        if edges is None or isinstance(edges, int) or edges - batch != 1:
            return f"its sparse input {i} does not take one offset more than rows"
        if isinstance(nnz, int) or nnz is None or not nnz.is_Symbol or nnz in seen:
            return f"its sparse input {i} does not take any number of ids"
        seen.add(nnz)
        low, high = _range(program, nnz)
        if low > 0 or high < MAX_IDS:
            return f"its sparse input {i} takes {low} to {high} ids, not 0 to {MAX_IDS}"
    return None


def _size(value: torch.Tensor, dim: int):
    """A dimension of a placeholder's value: an int, its sympy expression, or None (no such dim)."""
    if value.dim() <= dim:
        return None
    size = value.shape[dim]
    return size.node.expr if isinstance(size, torch.SymInt) else int(size)


def _range(program: torch.export.ExportedProgram, symbol) -> tuple[int | float, int | float]:
    """The range the program declares for a size symbol (unbounded when it declares none)."""
    bounds = program.range_constraints.get(symbol)
    if bounds is None:
        return 0, float("inf")
    low = int(bounds.lower) if bounds.lower.is_finite else float("-inf")
    return low, int(bounds.upper) if bounds.upper.is_finite else float("inf")
