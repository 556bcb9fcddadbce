"""What a built custom module must hold to be trained, checkpointed and served, checked when the
model is built (before anything trains or is written): its state goes into a checkpoint and back
(`check_state_round_trip`), and in eval mode a row's output does not depend on the other rows of
its batch (`check_rows_independent`).

Example:
    >>> from torch import nn
    >>> check_rows_independent(nn.Linear(4, 2), "torch.nn:Linear", 4)  # each row its own output
"""
from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from typing import Any, Mapping

import torch
from torch import nn

from operators.custom_code import CustomModuleError, settings_kept, stop_named, why


def check_state_round_trip(module: nn.Module, path: str) -> None:
    """Refuse a module whose state cannot go into a checkpoint and back, as a checkpoint, `--resume`,
    `flowrec eval`, `export` and `--init-from` take it: the state the model's own `state_dict()`
    collects of it (which calls the class's `state_dict`, `get_extra_state`, and its hooks) must be
    made, be tensors only (a checkpoint copies and shards it as tensors), and load back into it
    strictly (`_load_from_state_dict`, `set_extra_state`, its hooks). Loading its own state puts the
    same values back. Said before anything trains or is written, where a checkpoint after an
    epoch's training stopped with a traceback and a run folder without a checkpoint.

    Raises:
        CustomModuleError: one line naming the class and what failed.
    """
    doing = "state_dict()"
    try:
        with (torch.no_grad(), settings_kept(), contextlib.redirect_stdout(sys.stderr),
              stop_named(path, "saving the state of")):
            state = module.state_dict()
            if not isinstance(state, Mapping):
                raise TypeError(f"it returned {type(state).__name__}, not a mapping of names to tensors")
            odd = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
            if odd is not None:  # a checkpoint copies and shards the model's state as tensors
                raise TypeError(f"{odd.removeprefix('inner.')!r} is a {type(state[odd]).__name__}, not a tensor: "
                                "a checkpoint holds tensors only (keep such state in a buffer: register_buffer)")
            doing = "load_state_dict() of its own state"
            module.load_state_dict(state)
    except (Exception, SystemExit) as exc:  # a user's state_dict may raise anything (a stop passes: BaseException)
        raise CustomModuleError(f"{path}: {doing} failed: {why(exc)}; a checkpoint, --resume, eval and export "
                                "save and load the module's state through it") from None


PROBE_COPY_BYTES = 1 << 30  # B: a module holding more is checked without a copy of it (memory)
ROW_CHECK_ROWS = 3  # rows of the eval-mode batch whose outputs are compared with each row's alone
ROW_CHECK_SEED = 20261206  # the check's input values: the same check at every build
ROW_CHECK_RTOL = 1e-4  # relative: a GEMM of one row may sum in another order than one of three
ROW_CHECK_ATOL = 1e-5  # absolute, times the largest output value (at least 1)


def check_rows_independent(inner: nn.Module, path: str, in_width: int) -> None:
    """Refuse a module whose eval-mode output for a row depends on the other rows of its batch (a
    softmax or a mean over dim 0): `flowrec eval`, `export`, `predict` and micro-batches would give
    a row a score that follows the rows it happened to be batched with. Its outputs for
    ROW_CHECK_ROWS rows of skewed random values are compared with each row's output alone, on a
    copy of the module (`probe_copy`; the module itself, in eval mode, where it is not copied),
    without gradients and off torch's generator. Training-mode batch dependence (batch norm's
    batch statistics) is allowed. Nothing is said where the check cannot run: its forward raises
    (training says so, naming it), it returns no (B, ...) tensor, or it draws random numbers in
    eval mode (two seeds give two outputs: no row has one output to compare).

    Raises:
        CustomModuleError: a row's output alone differs from its output in the batch.
    """
    copied = probe_copy(inner)
    training = inner.training
    try:
        _compare_rows(inner.eval() if copied is None else copied.eval(), path, in_width)
    finally:
        inner.train(training)


def probe_copy(inner: nn.Module) -> nn.Module | None:
    """A copy of `inner` for a check that runs it (its own state, a counter, stays as it was), or
    None where it holds more than PROBE_COPY_BYTES (a copy would double the memory of a large
    pretrained module while the model is built) or cannot be copied (it holds a lock or a file)."""
    held = sum(t.numel() * t.element_size() for t in (*inner.parameters(), *inner.buffers())
               if not nn.parameter.is_lazy(t))
    if held > PROBE_COPY_BYTES:
        return None
    try:
        return copy.deepcopy(inner)
    except Exception:  # noqa: BLE001 - whatever its __deepcopy__ or __reduce__ raises
        return None


def _compare_rows(copied: nn.Module, path: str, in_width: int) -> None:
    """`check_rows_independent` on a module in eval mode."""
    gen = torch.Generator().manual_seed(ROW_CHECK_SEED)
    x = torch.randn(ROW_CHECK_ROWS, in_width, generator=gen) * torch.logspace(-1, 1, ROW_CHECK_ROWS)[:, None]

    def run(rows: torch.Tensor, seed: int = 0) -> Any:
        torch.manual_seed(seed)
        return copied(rows.clone())

    try:
        with (torch.random.fork_rng(devices=[]), torch.no_grad(), settings_kept(), warnings.catch_warnings(),
              contextlib.redirect_stdout(sys.stderr), stop_named(path, "running")):
            warnings.simplefilter("ignore")
            whole, other_seed = run(x), run(x, 1)
            if not _rows_of(whole, ROW_CHECK_ROWS) or not _rows_of(other_seed, ROW_CHECK_ROWS) \
                    or not torch.equal(whole, other_seed):
                return
            alone = [run(x[i:i + 1]) for i in range(ROW_CHECK_ROWS)]
    except (Exception, SystemExit):  # a user's forward may raise anything
        return
    scale = max(1.0, float(whole.detach().abs().max())) if whole.numel() else 1.0
    for i, out in enumerate(alone):
        if not _rows_of(out, 1) or out.shape[1:] != whole.shape[1:]:  # `.squeeze()`: one row's (1, k) became (k,)
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise CustomModuleError(
                f"{path}: its output for one row alone in eval mode is {shape}, not (1, "
                f"{', '.join(map(str, whole.shape[1:]))}) as a row of a batch of {ROW_CHECK_ROWS} gives (a squeeze() "
                "that drops the batch dimension of one row?): predict and serving score one row at a time")
        if not torch.allclose(out.float(), whole[i:i + 1].float(), rtol=ROW_CHECK_RTOL, atol=ROW_CHECK_ATOL * scale,
                              equal_nan=True):
            raise CustomModuleError(
                f"{path}: its output for a row depends on the other rows of the batch in eval mode (row {i} of "
                f"{ROW_CHECK_ROWS} alone gives other values than in the batch): eval, export and predict must score "
                "a row the same whatever rows share its batch, so compute across rows (a softmax or mean over "
                "dim 0) only in training (`if self.training:`), as batch norm does with its running statistics")


def _rows_of(out: Any, rows: int) -> bool:
    """`out` is a tensor of `rows` rows."""
    return isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == rows


def one_row_refusal(inner: nn.Module, path: str, in_width: int,
                    params: Mapping[str, Any] | None = None) -> str | None:
    """Why `inner` cannot train on a batch of one row where it trains on two (`nn.BatchNorm1d`:
    "Expected more than 1 value per channel when training"), else None. An epoch's last batch, a
    rank's share of one or a day's last batch may hold one row: the trainer skips such a batch for
    such a module (`LoweredModel.one_row_refusers`) where the run stopped there after the epoch's
    training. Tried in training mode with gradients on ROW_CHECK_SEED's skewed values, on a copy
    (`probe_copy`), off torch's generator: the module's own state (batch norm's running statistics)
    stays as it was. A module too large to copy is tried itself, its buffers put back after, or
    where its buffers too hold more than PROBE_COPY_BYTES, as the class built again from `params`
    on the meta device (shapes only: batch norm's check is one of shapes; None without `params`). A
    forward that fails on two rows too says nothing here (the step names its error as before).
    """
    module, kept = probe_copy(inner), []
    buffer_bytes = sum(t.numel() * t.element_size() for t in inner.buffers() if not nn.parameter.is_lazy(t))
    if module is None and buffer_bytes <= PROBE_COPY_BYTES:  # the module itself, its buffers put back after
        module, kept = inner, [(t, t.detach().clone()) for t in inner.buffers()]
    elif module is None:
        if params is None:
            return None
        from operators.custom_code import build_custom

        try:
            with torch.device("meta"), settings_kept(), contextlib.redirect_stdout(sys.stderr):
                module = build_custom(path, params).to("meta")
        except (Exception, SystemExit):  # built once already: a second build that fails tells nothing here
            return None
    training = inner.training
    gen = torch.Generator().manual_seed(ROW_CHECK_SEED)
    x = torch.randn(2, in_width, generator=gen) * torch.logspace(-1, 1, 2)[:, None]
    x = x.to("meta") if any(t.is_meta for t in (*module.parameters(), *module.buffers())) else x

    def run(rows: torch.Tensor) -> str | None:
        try:
            with (torch.random.fork_rng(devices=[]), torch.enable_grad(), settings_kept(), warnings.catch_warnings(),
                  contextlib.redirect_stdout(sys.stderr), stop_named(path, "running")):
                warnings.simplefilter("ignore")
                module.train(True)(rows.clone().requires_grad_(True))
        except (Exception, SystemExit) as exc:  # a user's forward may raise anything
            return why(exc)
        return None

    try:
        refused = run(x[:1])
        return refused if refused is not None and run(x) is None else None
    finally:
        inner.train(training)
        with torch.no_grad():
            for tensor, value in kept:
                tensor.copy_(value)
