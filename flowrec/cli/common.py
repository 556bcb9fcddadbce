"""What every command shares: one-line errors with exit status 2, and loading a spec that way."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer

from flowrec.spec.errors import SpecError
from flowrec.spec.load import load_spec
from flowrec.spec.model import ModelSpec

EXIT_INVALID = 2  # invalid spec, option, data or profile


def fail(message: str, code: int = EXIT_INVALID) -> NoReturn:
    """Print `error: message` on stderr and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def launch_world_size() -> int:
    """WORLD_SIZE of the launch environment (torchrun sets it), else 1; a bad value is one line."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        fail(f"the environment's WORLD_SIZE must be a positive integer, not {text!r}")
    return int(text)


def load_spec_or_exit(path: Path) -> ModelSpec:
    """Load a spec; on problems print one line per issue (`path: location: message`) and exit 2."""
    try:
        return load_spec(path)
    except SpecError as exc:
        for issue in exc.issues:
            typer.echo(f"{path}: {issue}", err=True)
        raise typer.Exit(EXIT_INVALID)
