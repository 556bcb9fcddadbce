"""Running a user's custom module class (the spec's `custom` kind): importing its file or module,
constructing it, and the guards around its code: a stop while it runs names it
(`UserCodeInterrupted`), torch's process-wide settings it changes are put back
(`settings_kept`), and whatever it raises is one line (`CustomModuleError`, `why`).

Example:
    >>> build_custom("torch.nn:Linear", {"in_features": 4, "out_features": 2}).out_features
    2
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules import module as torch_module

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # whose handlers stop flowrec (Ctrl-C, a scheduler's stop)
THREAD_MARK = "flowrec_started_while"  # attribute of a thread a user's code started and left running


class CustomModuleError(ValueError):
    """A custom class that cannot be used (import, construction, sparse parameters); one line."""


class UserCodeRefused(RuntimeError):
    """Something a user's code did under flowrec's guards that flowrec undid and refuses (its
    message says what, in words that follow the class's name)."""


class ExitAttempt(UserCodeRefused):
    """A user's code asked to end the process (`sys.exit(0)`, `exit()`, `os._exit(0)`) while it ran
    under flowrec's guards (`exits_refused`): flowrec ended with that status and no word, where a
    scripted pipeline took status 0 for a trained model. Said as the user's error, in one line."""


class GlobalHookMade(UserCodeRefused):
    """A user's code registered a hook on every module of the process
    (`torch.nn.modules.module.register_module_forward_hook` and its kin): it ran on flowrec's own
    modules too (a forward hook doubling every output trained a wrong model without a word)."""


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                "_global_forward_hooks_with_kwargs", "_global_buffer_registration_hooks",
                "_global_module_registration_hooks", "_global_parameter_registration_hooks")  # torch.nn.modules.module's


class UserCodeInterrupted(KeyboardInterrupt):
    """A stop (Ctrl-C; SIGTERM where it is raised as one, its `__cause__`) while a custom class's
    own code ran and had not returned (an endless loop at its file's top level, a constructor
    that waits): `running` says whose code and doing what, for the command's line."""

    def __init__(self, running: str) -> None:
        super().__init__(running)
        self.running = running


@contextlib.contextmanager
def stop_named(path: str, doing: str) -> Iterator[None]:
    """Within: a stop becomes UserCodeInterrupted naming `path` and what it was `doing` (the
    innermost such block names it)."""
    try:
        yield
    except UserCodeInterrupted:
        raise
    except KeyboardInterrupt as exc:
        raise UserCodeInterrupted(f"{doing} the custom module class {path}") from exc


def why(exc: BaseException) -> str:
    """`Type: first line of the message` of a user's exception (one line); a `UserCodeRefused` its message."""
    text = str(exc).strip()
    if isinstance(exc, UserCodeRefused):
        return text
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def exits_refused() -> Iterator[None]:
    """Within: the user's code may not end the process. `sys.exit(...)`, `exit()` and `quit()`
    (SystemExit) and `os._exit(...)` called from this thread raise `ExitAttempt` instead (os._exit
    from another thread ends the process as it would: flowrec's own teardown); a stop
    (KeyboardInterrupt) passes. Cheap: an attribute set and put back."""
    real, owner = os._exit, threading.get_ident()

    def refused(status: int) -> None:
        if threading.get_ident() != owner:
            real(status)
        raise ExitAttempt(f"tried to end the process: os._exit({status!r}) (raise an exception to fail)")

    os._exit = refused
    try:
        yield
    except SystemExit as exc:
        # with the user's frames (where it exited), so `state_failure` can name whose code it was
        raise ExitAttempt(f"tried to end the process: sys.exit({exc.code!r}) (or exit(), quit(); raise an exception "
                          "to fail)").with_traceback(exc.__traceback__) from None
    finally:
        os._exit = real


@contextlib.contextmanager
def settings_kept(signals: bool = True) -> Iterator[None]:
    """Within: a user's code may change process-wide settings (a module file's top-level
    `torch.set_default_dtype(torch.float64)`, `torch.set_grad_enabled(False)`, `os.chdir(...)`,
    `sys.stdout = open(os.devnull, "w")` or `signal.signal(signal.SIGINT, signal.SIG_IGN)`); they
    are put back after it, so flowrec's own tables and layers stay float32, its training keeps its
    gradients, the paths it was given (`--out runs/x`, `--json plan.json`) name what they named, its
    lines are seen and Ctrl-C and SIGTERM stop it as they did (a setting changed by the user's code
    holds while that code runs). An exit it attempts is an `ExitAttempt` (`exits_refused`); a hook
    it registers on every module of the process is removed, and refused (`GlobalHookMade`).
    `signals=False`: the stop handlers are left as they are (a forward's guard at every call, where
    they cost most of its time)."""
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    streams = sys.stdout, sys.stderr
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if signals else {}
    try:
        folder = os.getcwd()
    except OSError:  # the working folder is gone: nothing to put back
        folder = None
    hooks = _global_hook_keys()
    try:
        with exits_refused():
            yield
    finally:
        if torch.get_default_dtype() is not dtype:
            torch.set_default_dtype(dtype)
        if torch.is_grad_enabled() is not grad:
            torch.set_grad_enabled(grad)
        sys.stdout, sys.stderr = streams
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                with contextlib.suppress(ValueError):  # set from the main thread only; elsewhere the user could not either
                    signal.signal(sig, handler)
        if folder is not None:
            with contextlib.suppress(OSError):  # removed meanwhile: paths fail there as they would have
                os.chdir(folder)
        made = _drop_global_hooks(hooks)
    if made:  # said where the code returned; a failure of its own is said as it is
        raise GlobalHookMade(f"registered a hook on every module of the process ({', '.join(made)}: "
                             "torch.nn.modules.module.register_module_*_hook), which would run on flowrec's own "
                             "modules too; it was removed: register hooks on the class's own submodules "
                             "(self.proj.register_forward_hook(...))")


def _global_hook_keys() -> list[tuple[str, dict[Any, Any], tuple[Any, ...]]]:
    """(name, table, its handles) of torch's process-wide module hook tables (GLOBAL_HOOKS)."""
    return [(name, table, tuple(table)) for name in GLOBAL_HOOKS
            if isinstance(table := getattr(torch_module, name, None), dict)]


def _drop_global_hooks(before: list[tuple[str, dict[Any, Any], tuple[Any, ...]]]) -> list[str]:
    """Remove the process-wide module hooks registered since `before`; the tables that had one."""
    made = []
    for name, table, kept in before:
        if len(table) == len(kept) and tuple(table) == kept:
            continue
        new = [key for key in table if key not in kept]
        for key in new:
            del table[key]
        if new:
            made.append(name.removeprefix("_global_"))
    return made


@contextlib.contextmanager
def threads_marked(doing: str) -> Iterator[None]:
    """Within: a thread the user's code starts and leaves running, not a daemon (a prefetcher
    started at a file's top level), is marked with what flowrec was `doing` (`THREAD_MARK`), so the
    command can end without waiting for it for ever (`lingering_threads`)."""
    before = set(threading.enumerate())
    try:
        yield
    finally:
        for thread in threading.enumerate():
            if thread not in before and not thread.daemon and thread.is_alive():
                setattr(thread, THREAD_MARK, doing)


def lingering_threads() -> list[str]:
    """`'NAME' (started while importing blocks.py:X)` of each marked thread still running: the
    interpreter's exit would wait for it, for ever where it loops."""
    return [f"{thread.name!r} (started while {getattr(thread, THREAD_MARK)})" for thread in threading.enumerate()
            if thread.is_alive() and not thread.daemon and hasattr(thread, THREAD_MARK)]


def import_class(path: str) -> type:
    """The class named by ``module:Class`` or ``file.py:Class``.

    Raises:
        CustomModuleError: it does not import, or is not an nn.Module class.
    """
    module_name, _, class_name = path.partition(":")
    try:
        with settings_kept(), stop_named(path, "importing"), threads_marked(f"importing {path}"):
            module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except AttributeError as exc:
        if getattr(exc, "obj", None) is not module:  # raised inside the package or file: its own words
            raise CustomModuleError(f"cannot import {path!r}: {why(exc)}") from None
        close = difflib.get_close_matches(class_name, [n for n in dir(module) if not n.startswith("_")], n=1)
        meant = f" (did you mean {close[0]!r}?)" if close else ""  # a package's 100 names are not listed
        if not module_name.endswith(".py"):
            raise CustomModuleError(f"cannot import {path!r}: {why(exc)}{meant}") from None
        # a file is imported under a name of flowrec's (flowrec_custom_<stem>_<hashes>): name the file instead
        names = ", ".join(sorted(n for n in vars(module) if not n.startswith("_"))[:8]) or "nothing"
        raise CustomModuleError(f"cannot import {path!r}: {module_name} defines no {class_name!r}{meant} (it "
                                f"defines {names})") from None
    except (Exception, SystemExit) as exc:  # importing runs the module's top level: anything may fail
        raise CustomModuleError(f"cannot import {path!r}: {why(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise CustomModuleError(f"{path!r} is not a torch.nn.Module class")
    return cls


def _load_file(file: str) -> Any:
    path = Path(file).resolve()
    try:  # the file's content in the name: an edited file (a notebook's second call) is imported again
        content = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
    except OSError:
        content = "unread"
    name = f"flowrec_custom_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}_{content}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # while it runs, its folder comes first on the import path, as when Python runs the file itself:
    # its own imports of the files beside it (`import helpers`) find them
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import leaves no half-run module behind for the next try
        raise
    finally:
        with contextlib.suppress(ValueError):  # the first occurrence: the one put there above
            sys.path.remove(str(path.parent))
    return module


def build_custom(path: str, params: Mapping[str, Any]) -> nn.Module:
    """`Class(**params)`, refused when it has sparse parameters (CustomModuleError)."""
    cls = import_class(path)
    try:
        with settings_kept(), stop_named(path, "constructing"), threads_marked(f"constructing {path}"):
            module = cls(**dict(params))
    except (Exception, SystemExit) as exc:  # a user's constructor may raise anything, sys.exit included
        raise CustomModuleError(f"{path}(**{dict(params)}) failed: {why(exc)}") from None
    sparse = [name for name, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise CustomModuleError(f"{path} has sparse parameters ({', '.join(sparse)}): declare tables as flowrec "
                                f"features instead")
    return module


@contextlib.contextmanager
def user_failure(path: str, doing: str) -> Iterator[None]:
    """Within: an exception of a user's class (its overrides of nn.Module's own methods) becomes a
    CustomModuleError naming `path` and what flowrec was `doing`; CustomModuleError and stops pass."""
    try:
        yield
    except CustomModuleError:
        raise
    except (Exception, SystemExit) as exc:
        raise CustomModuleError(f"{path} failed in {doing}: {why(exc)}") from None
