"""A user's own dense module: a class path plus keyword parameters (the spec's `custom` kind).

The class is an `nn.Module` built as ``Class(**params)`` whose forward takes the module's declared
inputs flattened and concatenated, x (B, In), and returns (B, ...) (flattened to (B, out)). A class
path is ``package.module:Class`` (importable) or ``path/to/file.py:Class``. Modules with sparse
parameters (embeddings with sparse gradients) are refused: tables belong to flowrec's packed,
cached and sharded lookups.

Example:
    >>> op = CustomModule.from_config({"class": "torch.nn:Linear", "params": {"in_features": 4,
    ...                                 "out_features": 2}}, [(4,)])
    >>> op(torch.randn(3, 4)).shape
    torch.Size([3, 2])
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from math import prod
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn

from operators.custom_checks import check_rows_independent, check_state_round_trip, one_row_refusal, probe_copy
from operators.custom_code import (CustomModuleError, UserCodeRefused, build_custom, exits_refused, settings_kept,
                                   stop_named, user_failure, why)
from operators.dense import Shapes


MAX_OUT_WIDTH = 16_777_216  # values per sample a custom module may return (the spec's out_width bound)
DRY_RUN_BATCH = 2  # samples of the meta-device dry run
# the dry runs, (samples, training mode): at two sizes (a width must not follow the batch) and in eval mode
DRY_RUNS = ((DRY_RUN_BATCH, True), (DRY_RUN_BATCH + 1, True), (DRY_RUN_BATCH, False))


class NoRoomForDryRun(CustomModuleError):
    """A class too large to build on the CPU for a dry run its forward needs (`_check_cpu_room`)."""


class DryRun(NamedTuple):
    """What a dry run measured of a custom module: its output width per sample, the bytes of its
    trainable parameters (which also have gradients and optimizer state) and the bytes it holds
    once (buffers and frozen parameters)."""

    width: int
    param_bytes: int
    buffer_bytes: int


def meta_width(path: str, params: Mapping[str, Any], in_width: int) -> int:
    """Output width per sample of `Class(**params)` on (batch, in_width) inputs (`dry_run`)."""
    return dry_run(path, params, in_width).width


def dry_run(path: str, params: Mapping[str, Any], in_width: int) -> DryRun:
    """`_dry_run`, where whatever the class's own code raises is a CustomModuleError (one line).

    Raises:
        CustomModuleError: as `_dry_run`, and a class overriding nn.Module's own methods
            (`train()`, `to()`, `parameters()`) in a way that raises when flowrec calls them.
    """
    with user_failure(path, "its dry run"):
        return _dry_run(path, params, in_width)


def _dry_run(path: str, params: Mapping[str, Any], in_width: int) -> DryRun:
    """Output width per sample of `Class(**params)` on (batch, in_width) inputs of each of
    DRY_RUNS (two batch sizes in training mode, one in eval mode), by a dry run on the meta device (no memory, no compute), or on CPU zeros where
    the forward needs values (`_cpu_dry_run`), and the bytes of its parameters and buffers (after
    the forward: lazy parameters have their shapes then). Whatever the user's code prints goes to stderr,
    so that machine-readable output on stdout (`flowrec plan --json -`) stays clean.

    Raises:
        CustomModuleError: the class cannot be imported or built, its forward fails, or it does not
            return one (B, ...) tensor of 1 .. MAX_OUT_WIDTH values per sample, the same number of
            values per sample at every batch size, in training and in evaluation.
    """
    with contextlib.redirect_stdout(sys.stderr), stop_named(path, "running"):
        with torch.device("meta"):
            # tensors the constructor makes outside torch's factories (torch.from_numpy, torch.load,
            # device="cpu") are on the CPU: move them too, or the forward mixes devices
            inner = build_custom(path, params).to("meta")
        names = _state_names(inner)
        try:
            outputs = [_meta_forward(inner, batch, in_width, training) for batch, training in DRY_RUNS]
            graded = True
        except (Exception, SystemExit) as exc:  # a user's forward may raise anything; meta tensors hold no values
            _check_cpu_room(path, inner, exc)
            inner, names, outputs = _cpu_dry_run(path, params, in_width)  # (`x.sum() > 0`, `.item()`): real zeros
            graded = False  # that run is without gradients
    _check_no_new_state(path, inner, names)
    if graded:
        _check_gradient(path, inner, outputs)
    return DryRun(_checked_width(path, outputs), *state_bytes(inner))


def measured_memory(path: str, params: Mapping[str, Any]) -> tuple[int, int]:
    """`state_bytes` of `Class(**params)` built on the meta device (no memory; no forward): the
    memory of a module whose spec gives its `out_width`, so that no dry run measures it.

    Raises:
        CustomModuleError: the class cannot be imported or built.
    """
    with user_failure(path, "counting its parameters"), contextlib.redirect_stdout(sys.stderr), \
            stop_named(path, "constructing"):
        with torch.device("meta"):
            inner = build_custom(path, params).to("meta")  # CPU tensors made outside torch's factories too
        return state_bytes(inner)


def built_width(inner: nn.Module, path: str, params: Mapping[str, Any], in_width: int) -> int:
    """`dry_run`'s width and checks of a module already built (`inner`), on a copy of it (its own
    state stays as it was) and CPU zeros, off torch's generator: a slow constructor runs once where
    a meta dry run would build the class again. A module that is not copied (`probe_copy`: large,
    or it cannot be), or whose forward fails on zeros (a Cholesky of a zero matrix), gets the meta
    dry run instead.

    Raises:
        CustomModuleError: as `dry_run`.
    """
    copied = probe_copy(inner)
    if copied is None:  # large, or not to be copied
        return meta_width(path, params, in_width)
    names = _state_names(copied)
    try:
        with contextlib.redirect_stdout(sys.stderr), torch.random.fork_rng(devices=[]):
            outputs = [_forward_zeros(copied.train(training), path, in_width, batch=batch, grad=training)
                       for batch, training in DRY_RUNS]
    except CustomModuleError:
        return meta_width(path, params, in_width)
    _check_no_new_state(path, copied, names)
    _check_gradient(path, copied, outputs)
    return _checked_width(path, outputs)


def _checked_width(path: str, outputs: list[tuple[Any, torch.Tensor]]) -> int:
    """The values per sample of the outputs of DRY_RUNS, the same at each.

    Raises:
        CustomModuleError: an output is no (B, ...) tensor of its input's dtype, or its values per
            sample follow the batch size or the mode.
    """
    (first, x), (second, y), (evaluated, z) = outputs
    width, other = _width(path, first, x), _width(path, second, y)
    if other != width:  # (B, B * k): the next layer's weights are made for one batch size
        raise CustomModuleError(f"{path} returns {width:,} values per sample for {len(x)} samples but {other:,} "
                                f"for {len(y)}: its values per sample must not depend on the batch size")
    if (in_eval := _width(path, evaluated, z)) != width:  # evaluation, export and predict run it in eval mode
        raise CustomModuleError(f"{path} returns {width:,} values per sample in training but {in_eval:,} in eval "
                                "mode (evaluation, export, predict): its values per sample must not depend on "
                                "self.training")
    return width


def state_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of `module`'s trainable parameters, bytes of its buffers and frozen parameters), each
    tensor counted once however many submodules share it (meta tensors count as their CPU copies)."""
    trainable = held = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if nn.parameter.is_lazy(tensor):
            continue  # no shape yet
        size = tensor.numel() * tensor.element_size()
        if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
            trainable += size
        else:
            held += size
    return trainable, held


def _state_names(module: nn.Module) -> set[str]:
    """The names of `module`'s parameters and buffers."""
    return {name for name, _ in (*module.named_parameters(), *module.named_buffers())}


def _check_no_new_state(path: str, inner: nn.Module, before: set[str]) -> None:
    """Refuse a module whose forward registered parameters or buffers (`self.w = nn.Parameter(...)`
    at its first call): the dense optimizer, made before the first step, never trains them, and the
    checkpoint of a run holds state that the model a resume builds lacks."""
    made = sorted(_state_names(inner) - before)
    if made:
        raise CustomModuleError(f"{path} creates {', '.join(made[:3])}{' ...' if len(made) > 3 else ''} in its forward: "
                                "create parameters and buffers in __init__ (the optimizer is made before the first "
                                "step, and would never train them), or use nn.LazyLinear-style lazy modules")


def _check_gradient(path: str, inner: nn.Module, outputs: list[tuple[Any, torch.Tensor]]) -> None:
    """Refuse a module with trainable parameters whose training-mode output carries no gradient
    (computed under torch.no_grad(), `.detach()`ed, wrapped in a new nn.Parameter or made anew):
    its parameters would never train, nor the modules before it through it, without a word."""
    trainable = [name for name, t in inner.named_parameters() if t.requires_grad]
    if not trainable:
        return  # a fixed module (no parameters, or frozen ones) may stop gradients on purpose
    for (out, _), (_, training) in zip(outputs, DRY_RUNS):
        if training and isinstance(out, torch.Tensor) and out.grad_fn is None:
            raise CustomModuleError(
                f"{path} returns a tensor without a gradient in training mode (computed under torch.no_grad(), "
                f"detached, or made anew) although it has trainable parameters ({', '.join(trainable[:3])}"
                f"{', ...' if len(trainable) > 3 else ''}): they would never train, nor the modules before it through "
                "it; return a tensor computed from its input and parameters (set requires_grad=False on parameters "
                "meant to stay fixed)")


def _meta_forward(inner: nn.Module, batch: int, in_width: int, training: bool) -> tuple[Any, torch.Tensor]:
    """`inner`'s output on a (batch, in_width) meta input in training or eval mode, and that input
    (in training a copy of a tensor requiring a gradient, as training gives it: `CustomModule.forward`'s
    copy of another module's output, which a forward may change in place)."""
    inner.train(training)
    x = torch.empty(batch, in_width, device="meta", requires_grad=training)
    with warnings.catch_warnings(), settings_kept():  # float() of a meta tensor warns, then fails
        warnings.simplefilter("ignore")
        return inner(x.clone() if training else x), x


def _width(path: str, out: Any, x: torch.Tensor) -> int:
    """Values per sample of a dry run's output `out` for the input `x`.

    Raises:
        CustomModuleError: `out` is not one (B, ...) tensor of x's dtype with 1 .. MAX_OUT_WIDTH values per sample.
    """
    batch = len(x)
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != batch:  # (B,): one value each
        raise CustomModuleError(f"{path} must return one (B, ...) tensor, got "
                                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                                f"{f' for {batch} samples' if isinstance(out, torch.Tensor) and out.dim() else ''}")
    if out.dtype != x.dtype:  # the next module's weights are of the input's dtype; an integer output has no gradient
        raise CustomModuleError(f"{path} returns {str(out.dtype).removeprefix('torch.')} values for a "
                                f"{str(x.dtype).removeprefix('torch.')} input: return the input's dtype "
                                f"(e.g. out.to(x.dtype))")
    width = int(prod(out.shape[1:]))
    if not 1 <= width <= MAX_OUT_WIDTH:
        raise CustomModuleError(f"{path} returns {width:,} values per sample ({tuple(out.shape)} for "
                                f"{batch} samples); a custom module returns 1 .. {MAX_OUT_WIDTH:,}")
    return width


def _check_cpu_room(path: str, inner: nn.Module, failure: BaseException) -> None:
    """Refuse to build `inner`'s class on the CPU for the dry run where it holds more than half the
    memory the machine has free (its meta build's `state_bytes`): a forward that needs values and
    a large buffer had the dry run of `flowrec plan` allocate it all, and the kernel kill flowrec
    without a word.

    Raises:
        CustomModuleError: naming the class, what it holds and the meta forward's failure.
    """
    held, room = sum(state_bytes(inner)), cpu_dry_run_room()
    if room is not None and held > room:
        raise NoRoomForDryRun(f"{path} holds {_size(held)} and its forward fails on the meta device "
                                f"({why(failure)}), so its dry run would build it on the CPU, with "
                                f"{_size(room)} to spare: give its out_width in the spec (and param_bytes, "
                                "buffer_bytes), which skips the dry run")


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def cpu_dry_run_room() -> int | None:
    """Bytes a CPU dry run may build: half the memory the machine has available (Linux's
    MemAvailable, else its free pages; None: unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            kib = next(int(line.split()[1]) for line in info if line.startswith("MemAvailable:"))
        return kib * 1024 // 2
    except (OSError, ValueError, StopIteration, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_dry_run(path: str, params: Mapping[str, Any],
                 in_width: int) -> tuple[nn.Module, set[str], list[tuple[Any, torch.Tensor]]]:
    """The module, the names of its state as built, and its forward on (batch, in_width) zeros on
    the CPU for each of DRY_RUNS, for a module
    whose forward needs values (data-dependent control flow), without gradients and without
    touching torch's generator.

    Raises:
        CustomModuleError: it fails there too (the error is the user's, not the meta device's).
    """
    with torch.random.fork_rng(devices=[]):
        inner = build_custom(path, params)
        names = _state_names(inner)
        return inner, names, [_forward_zeros(inner.train(training), path, in_width, batch=batch)
                              for batch, training in DRY_RUNS]


class CustomModule(nn.Module):
    """The user's module around flowrec's flat input convention: x (B, In) -> (B, out)."""

    def __init__(self, inner: nn.Module, path: str = "?"):
        super().__init__()
        self.inner = inner
        self.path = path  # the class path; `label` (the spec's module name) is set by lowering
        self.label = "?"
        self.one_row: str | None = None  # why it cannot train on one row (`one_row_refusal`), set at its build
        self.width: int | None = None  # values per sample the next modules were built for (the spec's out_width)
        self.last: torch.Tensor | None = None  # its last output, detached: named by `non_finite_outputs`

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "CustomModule":
        """The module, built once; a spec's own `out_width` is checked against it (`built_width`),
        and whether it trains on a batch of one row is tried (`one_row`).

        Raises:
            CustomModuleError: the class cannot be used, or returns another width than `out_width`.
        """
        path = config["class"]
        with user_failure(path, "building the model"):  # an override of train(), parameters() ... may raise
            return cls._built(config, input_shapes)

    @classmethod
    def _built(cls, config: dict[str, Any], input_shapes: Shapes) -> "CustomModule":
        path, params, in_width = config["class"], _mapping(config.get("params", {})), sum(prod(s) for s in input_shapes)
        inner = build_custom(path, params)  # once: a constructor may take long (pretrained weights)
        _materialize_lazy(inner, path, in_width)
        meta = [name for name, t in (*inner.named_parameters(), *inner.named_buffers()) if t.is_meta]
        if meta:
            raise CustomModuleError(f"{path} keeps {', '.join(meta[:3])} on the meta device (no values): "
                                    "create its tensors without device='meta'")
        declared = config.get("out_width")
        if declared is not None:
            try:
                width = built_width(inner, path, params, in_width)
            except NoRoomForDryRun:  # no room for a second one: its forward checks its width at each call
                width = declared
            if width != declared:
                raise CustomModuleError(f"custom module {path} returns {width} values per sample, "
                                        f"not its out_width {declared}: correct out_width or leave it out")
        module = cls(inner, path)
        module.width = declared
        check_state_round_trip(module, path)
        check_rows_independent(inner, path, in_width)
        module.one_row = one_row_refusal(inner, path, in_width, params)
        return module

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """nn.Module's, where the class's own state code may not end the process (a state_dict that
        called sys.exit(0) at a checkpoint ended the run with status 0, no checkpoint and no word):
        an `ExitAttempt`, which `state_failure` names."""
        with exits_refused():
            return super().state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # its own copy: x may be another module's output itself (one input), which a forward that
        # changes its input in place (nn.ReLU(inplace=True)) would change for its other readers and
        # for autograd (which keeps it for that module's backward)
        # under the guards of the import and the dry run: sys.exit(0) or os._exit(0) ended a run with status 0
        # and no word, os.chdir() or torch.set_default_dtype() in a forward moved the run's relative paths and
        # made flowrec's later tensors float64 (put back after each call; compiled code is not traced through them)
        with contextlib.nullcontext() if torch.compiler.is_compiling() else settings_kept(signals=False):
            out = self.inner(x.clone())
        if not isinstance(out, torch.Tensor):  # the dry run saw a tensor: a forward that returns other at times
            raise TypeError(f"it returned a {type(out).__name__}, not one (B, ...) tensor")
        if out.device != x.device:  # `.cpu()`, a tensor made without device=: the next module fails far from here
            raise RuntimeError(f"it returned a tensor on {out.device} for its input on {x.device}: return it on the "
                               "input's device (make new tensors with device=x.device)")
        if out.dim() == 0 or out.shape[0] != x.shape[0]:  # h[:1], h.sum(0): the loss failed far from here
            raise RuntimeError(f"it returned {tuple(out.shape)} for {x.shape[0]:,} rows: return one (B, ...) tensor, "
                               "a row of output for each row of input")
        out = out if out.dim() == 2 else out.reshape(out.shape[0], -1)
        if self.width is not None and out.shape[1] != self.width:
            # a width that changes after the build (a counter, a mode): the next module failed with a traceback
            raise RuntimeError(f"it returned {out.shape[1]:,} values per sample where it returned {self.width:,} when "
                               "the model was built (its out_width): its values per sample must not change between "
                               "calls")
        if not torch.compiler.is_compiling():
            self.last = out.detach()
        return out


DATA_DEPENDENT_FLOW = ("uses a tensor's values in Python (an if or while on a tensor, its bool(), int() or "
                       "float(): data-dependent control flow), which torch.export cannot export: compute both "
                       "sides and choose with torch.where, or use torch.cond")


def custom_failure(exc: BaseException) -> str | None:
    """`custom module 'NAME' (CLASS) raised TYPE: first line` when `exc` came out of a custom
    module's forward (its traceback passes through `CustomModule.forward`), else None. torch's
    guard error of a forward that uses a tensor's values in Python while `flowrec export` traces it
    (`if x.sum() > 0:` trains, but cannot be exported) is said as that, with what to write instead
    (`DATA_DEPENDENT_FLOW`), where it was torch's message of many lines."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is CustomModule.forward.__code__:
            module = tb.tb_frame.f_locals.get("self")
            named = f"custom module {getattr(module, 'label', '?')!r} ({getattr(module, 'path', '?')})"
            if isinstance(exc, GuardOnDataDependentSymNode):
                return f"{named} {DATA_DEPENDENT_FLOW}"
            return f"{named} {'' if isinstance(exc, UserCodeRefused) else 'raised '}{why(exc)}"
        tb = tb.tb_next
    return None


def non_finite_rows(model: nn.Module) -> dict[str, tuple[int, int]]:
    """`'NAME' (CLASS)` -> (rows holding NaN or infinity, rows) of each custom module's last output
    in `model` (evaluation sums them over its batches: `flowrec.runtime.evaluation.evaluate`)."""
    found = {}
    for module in model.modules():
        last = getattr(module, "last", None) if isinstance(module, CustomModule) else None
        if last is None or not last.numel() or not last.is_floating_point():
            continue
        bad = int((~torch.isfinite(last)).reshape(len(last), -1).any(1).sum())
        found[f"{module.label!r} ({module.path})"] = (bad, len(last))
    return found


def forget_outputs(model: nn.Module) -> None:
    """Drop each custom module's last output (a compiled forward keeps none: an earlier one stays)."""
    for module in model.modules():
        if isinstance(module, CustomModule):
            module.last = None


def non_finite_note(counts: dict[str, tuple[int, int]]) -> str | None:
    """`custom module 'NAME' (CLASS) returned non-finite values for R of B rows` for each module of
    `counts` (`non_finite_rows`) with such rows, or None.

    >>> non_finite_note({"'mine' (x.py:Mine)": (3, 64), "'other' (x.py:Other)": (0, 64)})
    "custom module 'mine' (x.py:Mine) returned non-finite values for 3 of 64 rows"
    """
    said = [f"custom module {name} returned non-finite values for {bad:,} of {rows:,} rows"
            for name, (bad, rows) in counts.items() if bad]
    return "; ".join(said) or None


def non_finite_outputs(model: nn.Module) -> str | None:
    """`custom module 'NAME' (CLASS) returned non-finite values for R of B rows` for each custom
    module of `model` whose last output holds NaN or infinity, or None: a non-finite loss named its
    head only, far from the module that made it (a forward returning NaN on some rows)."""
    return non_finite_note(non_finite_rows(model))


def backward_failure(exc: BaseException, model: nn.Module) -> str | None:
    """`the backward pass of a model with custom modules ('NAME' (CLASS)) failed: TYPE: first line`
    with what usually causes it, when `exc` came out of autograd's backward (`torch.autograd.backward`,
    which `Tensor.backward` calls) of a `model` holding custom modules, else None. A forward that
    keeps a tensor of one step for the next (a running mean not detached) or changes a tensor
    autograd saved in place raises there, far from the user's code: its traceback went through
    torch's engine and flowrec's step."""
    customs = [m for m in model.modules() if isinstance(m, CustomModule)]
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not torch.autograd.backward.__code__:
        tb = tb.tb_next
    if not customs or tb is None:
        return None
    named = ", ".join(f"{m.label!r} ({m.path})" for m in customs[:3]) + (", ..." if len(customs) > 3 else "")
    return (f"the backward pass of a model with custom modules ({named}) failed: {why(exc)}; a custom module's "
            "forward must not keep a tensor of one step for the next (detach it: self.kept = y.detach()) nor "
            "change in place a tensor it computed with")


def state_failure(exc: BaseException, model: nn.Module) -> str | None:
    """`custom module 'NAME' (CLASS): its METHOD() raised TYPE: first line` when `exc` came out of
    the state code (`state_dict`, `_load_from_state_dict`, `get_extra_state`, ...) of a custom module
    of `model` or of one of its submodules, else None: a state_dict that raises only after some
    steps (the model's build checks one round trip) stopped a checkpoint with a traceback through
    flowrec's trainer. The walk ends at the innermost such frame."""
    owners = {id(sub): custom for custom in model.modules() if isinstance(custom, CustomModule)
              for sub in custom.modules()}
    found, tb = None, exc.__traceback__
    while tb is not None:
        owner = owners.get(id(tb.tb_frame.f_locals.get("self")))
        if owner is not None and "state" in tb.tb_frame.f_code.co_name:
            found = (owner, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if found is None:
        return None
    owner, method = found
    return (f"custom module {owner.label!r} ({owner.path}): its {method}() "
            f"{'' if isinstance(exc, UserCodeRefused) else 'raised '}{why(exc)}")


def _materialize_lazy(inner: nn.Module, path: str, in_width: int) -> None:
    """Give a module with lazy parameters (`nn.LazyLinear`, ...) their shapes and values by one
    forward of zeros, in eval mode and without gradients, as torch asks of lazy modules before an
    optimizer sees them (the meta dry run gives meta values only).

    Raises:
        CustomModuleError: that forward fails.
    """
    if not any(nn.parameter.is_lazy(t) for t in (*inner.parameters(), *inner.buffers())):
        return
    training = inner.training
    inner.eval()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            _forward_zeros(inner, path, in_width, " initialising its lazy parameters")
    finally:
        inner.train(training)


def _forward_zeros(inner: nn.Module, path: str, in_width: int, doing: str = "",
                   batch: int = DRY_RUN_BATCH, grad: bool = False) -> tuple[Any, torch.Tensor]:
    """`inner`'s output on (batch, in_width) CPU zeros without gradients (`grad`: a copy of zeros
    that require one, as training gives it), and those zeros.

    Raises:
        CustomModuleError: the forward fails (naming `path` and what it was `doing`).
    """
    x = torch.zeros(batch, in_width, requires_grad=grad)
    try:
        with torch.set_grad_enabled(grad), settings_kept(), stop_named(path, "running"):
            return inner(x.clone() if grad else x), x
    except (Exception, SystemExit) as exc:
        raise CustomModuleError(f"{path} failed on a ({batch}, {in_width}) input{doing}: {why(exc)}") from None


def _mapping(params: Any) -> dict[str, Any]:
    """Params as a dict (a mapping, or the (key, value) pairs a plan document holds)."""
    return dict(params)
