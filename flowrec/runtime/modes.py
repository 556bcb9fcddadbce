"""A model in eval mode for a while: no dropout, batch norm reading its running statistics and
leaving them as they are; the mode it was in comes back after.

Example:
    >>> from torch import nn
    >>> net = nn.Dropout(0.5)
    >>> with eval_mode(net):
    ...     net.training
    False
    >>> net.training
    True
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within: `model` in eval mode; after (also on an error): the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
