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

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from operators.dense import Shapes


class CustomModuleError(ValueError):
    """A custom class that cannot be used (import, construction, sparse parameters); one line."""


def import_class(path: str) -> type:
    """The class named by ``module:Class`` or ``file.py:Class``.

    Raises:
        CustomModuleError: it does not import, or is not an nn.Module class.
    """
    module_name, _, class_name = path.partition(":")
    try:
        module = _load_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        cls = getattr(module, class_name)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise CustomModuleError(f"cannot import {path!r}: {type(exc).__name__}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise CustomModuleError(f"{path!r} is not a torch.nn.Module class")
    return cls


def _load_file(file: str) -> Any:
    path = Path(file).resolve()
    name = f"flowrec_custom_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_custom(path: str, params: Mapping[str, Any]) -> nn.Module:
    """`Class(**params)`, refused when it has sparse parameters (CustomModuleError)."""
    cls = import_class(path)
    try:
        module = cls(**dict(params))
    except Exception as exc:  # a user's constructor may raise anything
        raise CustomModuleError(f"{path}(**{dict(params)}) failed: {type(exc).__name__}: {exc}") from None
    sparse = [name for name, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise CustomModuleError(f"{path} has sparse parameters ({', '.join(sparse)}): declare tables as flowrec "
                                f"features instead")
    return module


class CustomModule(nn.Module):
    """The user's module around flowrec's flat input convention: x (B, In) -> (B, out)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "CustomModule":
        return cls(build_custom(config["class"], _mapping(config.get("params", {}))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out if out.dim() == 2 else out.reshape(out.shape[0], -1)


def _mapping(params: Any) -> dict[str, Any]:
    """Params as a dict (a mapping, or the (key, value) pairs a plan document holds)."""
    return dict(params)
