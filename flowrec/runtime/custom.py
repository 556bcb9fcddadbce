"""Custom modules at planning: import each `custom` module's class and learn its output width by a
dry run on the meta device (no memory, no compute), before the planner sees the spec.

`validate` never imports user code; planning, training and export do (through the CLI and API).
Every problem (a class path that does not import, a constructor or forward that fails on the dry
run, sparse parameters) is a `SpecError` issue at the module's path: one line, exit 2.

Example:
    >>> spec = resolve_custom(load_spec("specs/custom_gate.yaml"))  # doctest: +SKIP
    >>> spec.modules[1].param("out_width")  # doctest: +SKIP
    16
"""
from __future__ import annotations

from dataclasses import replace

from flowrec.graph.build import module_input_width
from flowrec.spec.class_paths import absolute_class_files
from flowrec.spec.errors import SpecError, SpecIssue
from flowrec.spec.load import to_dict
from flowrec.spec.model import DRY_RUN_KINDS, FrozenMapping, ModelSpec, ModuleSpec, thaw, unresolved_modules
from flowrec.spec.module_checks import check_shapes
from flowrec.spec.view import DocView
from operators.custom import DryRun, dry_run, measured_memory
from operators.custom_code import CustomModuleError, UserCodeInterrupted


class CustomInterrupted(KeyboardInterrupt):
    """A stop (Ctrl-C; SIGTERM where it is raised as one) while a custom module's class was
    imported, built or dry-run: its code had not returned (an endless loop at a file's top level,
    a constructor that waits). `where`: the module's path in the spec; `what`: which class of which
    module; `cause`: the stop itself."""

    def __init__(self, where: str, what: str, cause: KeyboardInterrupt) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what, self.cause = where, what, cause


def resolve_custom(spec: ModelSpec, check_given: bool = False, notes: list[str] | None = None) -> ModelSpec:
    """`spec` with the `out_width` of every custom module that lacks one measured (and with it
    `param_bytes` and `buffer_bytes`, the bytes of its trainable parameters and of what it holds
    once, buffers and frozen parameters, which the planner counts in the plan's memory; a module
    whose `out_width` is given and `param_bytes` not gets them from the class built on the meta
    device, without a dry run, a `buffer_bytes` given kept; where that class cannot be built, the
    spec plans as before, without them, and `notes` gets a line saying so); with
    `check_given`, a given `out_width` is measured and checked too (for commands that build the
    model only after long work, such as `flowrec calibrate`).

    Raises:
        SpecError: every custom module that cannot be used, each at its path; every module whose
            inputs' widths do not fit it once the measured widths are known (a dot of a custom
            module's 5 values and a field of dim 4), at its path as `flowrec validate` says it.
        CustomInterrupted: a stop while a module's class was imported or run.
    """
    spec = absolute_class_files(spec)  # a run records the file, found from any folder
    issues, measured = [], False
    unresolved = unresolved_modules(spec)
    for index, module in enumerate(spec.modules):
        given = module.param("out_width") if module.kind in DRY_RUN_KINDS else None
        # a given out_width skips the dry run; its memory is still counted (built on the meta device)
        uncounted = given is not None and module.param("param_bytes") is None
        if module.name not in unresolved and not (check_given and given is not None) and not uncounted:
            continue
        try:
            if module.name in unresolved or (check_given and given is not None):
                measured_run = dry_run_of(module, module_input_width(spec, module.name))
            else:
                measured_run = DryRun(given, *measured_memory(module.param("class"),
                                                              thaw(module.param("params", FrozenMapping()))))
        except KeyboardInterrupt as exc:  # the stop itself: the line names the class and module
            stop = exc.__cause__ if isinstance(exc, UserCodeInterrupted) and exc.__cause__ is not None else exc
            raise CustomInterrupted(f"modules[{index}].class", f"importing and dry-running {module.param('class')} "
                                    f"(custom module {module.name!r})", stop) from None
        except CustomModuleError as exc:
            if uncounted and not (module.name in unresolved or check_given):  # out_width given: plans without it
                if notes is not None:
                    notes.append(f"module {module.name!r}: its parameters are not counted in the plan's memory ({exc}); "
                                 "give param_bytes and buffer_bytes with out_width, or leave out_width out")
                continue
            issues.append(SpecIssue(f"modules[{index}].class", str(exc)))
            continue
        width = measured_run.width
        if given is not None and width != given:
            issues.append(SpecIssue(f"modules[{index}].out_width",
                                    f"{module.param('class')} returns {width} values per sample, not {given}: "
                                    "correct out_width or leave it out"))
            continue
        if given is not None and not uncounted:
            continue
        modules = list(spec.modules)
        # its parameters and buffers, which the planner counts in the plan's memory as an mlp's
        modules[index] = (module.with_param("out_width", width)
                          .with_param("param_bytes", measured_run.param_bytes)
                          .with_param("buffer_bytes", module.param("buffer_bytes") if uncounted and module.param(
                              "buffer_bytes") is not None else measured_run.buffer_bytes))
        spec = replace(spec, modules=tuple(modules))
        measured = True
    if measured and not issues:  # validate could not tell these widths: its shape rules where they meet others
        issues = check_shapes(DocView.of(to_dict(spec), frozenset()))
    if issues:
        raise SpecError(issues)
    return spec


def dry_run_of(module: ModuleSpec, in_width: int) -> DryRun:
    """Output width per sample of a custom module on a (DRY_RUN_BATCH, in_width) meta input, and
    the bytes of its parameters and buffers."""
    return dry_run(module.param("class"), thaw(module.param("params", FrozenMapping())), in_width)
