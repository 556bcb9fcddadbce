"""flowrec: declarative, inspectable, fast training of wide-and-deep / DLRM-style recommenders.

The Python API (`flowrec.train`, `flowrec.load`, `Run`; see docs/python.md) lives in `flowrec.api`
and is imported on first use, so `import flowrec` (and every CLI command) stays free of torch.
This module is the face only: it imports nothing at load and no flowrec module imports it
(`flowrec.version` holds `__version__`).

Example:
    >>> import flowrec
    >>> run = flowrec.train("specs/movielens.yaml", out="runs/ml", epochs=1)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

API = ("train", "load", "Run", "StepEvent", "EvalEvent", "CheckpointEvent")
__all__ = ["__version__", "load_model", *API]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from flowrec.version import __version__

        return __version__
    if name in API:
        import flowrec.api

        return getattr(flowrec.api, name)
    raise AttributeError(f"module 'flowrec' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the API's, which load on first use: a notebook's completion of
    `flowrec.` reads dir(), which offered load_model alone (not train, load or Run)."""
    return sorted({*globals(), *__all__})


def load_model(path):
    """Load a model package written by `flowrec export` for scoring raw rows.

    Raises:
        TypeError: `path` is not a path (str or os.PathLike): None, bytes, a frame of rows; it was
            pathlib's TypeError ('expected str, bytes or os.PathLike object'), naming no argument.
        ValueError: `path` holds a NUL character (it was os.stat's bare 'embedded null byte'), or
            is not a package, or a part of it is missing, damaged or refused (one line).

    Example:
        >>> model = flowrec.load_model("pkg/ml")  # doctest: +SKIP
        >>> model.predict(raw_table)  # one score column per head  # doctest: +SKIP
    """
    import os

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a model package's folder (str or pathlib.Path), not {type(path).__name__}"
                        + (": a package is read from its folder, `flowrec export RUN PKG` writes one; "
                           "model.predict(rows) then scores rows in memory" if hasattr(path, "columns") else ""))
    if "\0" in os.fsdecode(path):
        raise ValueError(f"path {os.fsdecode(path)[:80]!r} holds a NUL character ('\\0'), which no file name can hold")
    from flowrec.serving.predict import load_model as load

    return load(path)
