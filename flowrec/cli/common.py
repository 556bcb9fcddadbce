"""What every command shares: one-line errors with exit status 2, and loading a spec that way."""
from __future__ import annotations

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


def load_spec_or_exit(path: Path) -> ModelSpec:
    """Load a spec; on problems print one line per issue (`path: location: message`) and exit 2."""
    try:
        return load_spec(path)
    except SpecError as exc:
        for issue in exc.issues:
            typer.echo(f"{path}: {issue}", err=True)
        raise typer.Exit(EXIT_INVALID)
