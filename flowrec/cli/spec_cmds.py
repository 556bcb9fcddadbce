"""`flowrec validate` and `flowrec schema`: check spec files, print the JSON Schemas."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import typer

from flowrec.runtime.messages import one_line
from flowrec.spec.schemas import MODEL_SPEC_SCHEMA, PLAN_SCHEMA, load_schema, schema_path
from flowrec.spec.files import FileReport, validate_paths

EXIT_INVALID = 2  # any spec invalid, unreadable or missing

VALIDATE_HELP = """Check spec files (YAML or JSON) against the schema and the semantic rules.

Every problem of every file is reported at once, one line each, as `FILE: PATH: MESSAGE`.
Folders are scanned recursively for *.yaml, *.yml and *.json files, leaving out
hidden ones (.venv, .github) and those flowrec writes for itself (plans, runs'
settings, dataset and package records).
Exit status: 0 when every file is valid, 2 otherwise.

\b
Examples:
  flowrec validate specs/dlrm_criteo.yaml
  flowrec validate specs/ --quiet
  flowrec validate specs/ --json > report.json
"""

SCHEMA_HELP = """Print the model-spec JSON Schema (draft 2020-12), or the plan schema with --plan.

\b
Examples:
  flowrec schema > model-spec.schema.json
  flowrec schema --plan
"""


def register(app: typer.Typer) -> None:
    """Add the `validate` and `schema` commands to the `flowrec` app."""
    app.command("validate", help=VALIDATE_HELP)(validate)
    app.command("schema", help=SCHEMA_HELP)(schema)


def validate(
    paths: List[Path] = typer.Argument(..., metavar="SPEC", help="Spec files or folders to check."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable JSON report."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print errors only, not 'ok' lines."),
) -> None:
    try:
        reports = validate_paths(paths)
    except Exception as exc:  # noqa: BLE001 -- the CLI never shows a traceback
        typer.echo(f"internal error while validating: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID)
    if as_json:
        typer.echo(json.dumps({"files": [_report_json(r) for r in reports]}, indent=2))
    else:
        for report in reports:
            _print_report(report, quiet)
    if not reports or not all(r.valid for r in reports):
        raise typer.Exit(EXIT_INVALID)


def schema(plan: bool = typer.Option(False, "--plan", help="Print the plan output schema instead.")) -> None:
    name = PLAN_SCHEMA if plan else MODEL_SPEC_SCHEMA
    try:
        doc = load_schema(name)
    except (OSError, ValueError) as exc:
        typer.echo(f"cannot read schema {schema_path(name)}: {exc}", err=True)
        raise typer.Exit(EXIT_INVALID)
    typer.echo(json.dumps(doc, indent=2))


def _report_json(report: FileReport) -> dict:
    return {
        "path": report.path,
        "valid": report.valid,
        "errors": [{"path": i.path, "message": i.message} for i in report.issues],
    }


def _print_report(report: FileReport, quiet: bool) -> None:
    if report.valid:
        if not quiet:
            typer.echo(one_line(f"ok  {report.path}"))
        return
    for issue in report.issues:
        typer.echo(one_line(f"{report.path}: {issue}"))
