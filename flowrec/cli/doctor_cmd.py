"""`flowrec doctor`: versions, devices and self-checks of this machine."""
from __future__ import annotations

import json

import typer

DOCTOR_HELP = """Check what this machine can run, and that it runs it right.

Prints versions (flowrec, torch and its CUDA, CuPy, NCCL, NVRTC, dask, pyarrow), the devices
and their memory, then self-checks: kernel compilation with NVRTC (with the gpucheck extra),
20 training steps of a small model on every device against a reference, and a two-process
collective (gloo; nccl with 2+ GPUs). Checks that cannot run here are listed as not checked.
Exit status 0 when every check that ran passed, 1 otherwise.

\b
Examples:
  flowrec doctor
  flowrec doctor --json > doctor.json
"""
MISSING = {"torch_cuda": "none (a CPU build of torch)", "nccl": "none (no CUDA)",
           "nvrtc": "not installed (pip install -e '.[gpucheck]')"}
STATUS_MARK = {"pass": "ok  ", "fail": "FAIL", "skip": "--  "}


def register(app: typer.Typer) -> None:
    """Add the `doctor` command to the `flowrec` app."""
    app.command("doctor", help=DOCTOR_HELP)(doctor)


def doctor(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")) -> None:
    from flowrec.planner.manager import make_plan
    from flowrec.measure.doctor import run_doctor

    report = run_doctor(lambda spec: make_plan(spec, target="cpu"),
                        status=lambda s: None if as_json else typer.echo(f"... {s}", err=True))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo("\n".join(text_lines(report.to_dict())))
    raise typer.Exit(0 if report.ok else 1)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def text_lines(report: dict) -> list[str]:
    """The report as text: versions, devices, one line per check, what was not checked."""
    lines = ["versions:"]
    lines += [f"  {k:<10} {v if v is not None else MISSING.get(k, 'not installed')}"
              for k, v in report["versions"].items()]
    lines.append("devices:")
    for d in report["devices"]:
        extra = f", capability {d['capability']}, {_gib(d['free_bytes'])} free" if "capability" in d \
            else f", {d['cores']} cores" + (f", {d['vendor']}, fp32 GEMMs by {d['gemm']}" if "gemm" in d else "") \
            + (", bf16 emulated (no faster than fp32): train in fp32 here (precision: fp32)"
               if d.get("bf16") == "emulated" else "")
        lines.append(f"  {d['device']:<10} {d['name']}: {_gib(d['memory_bytes'])}{extra}")
    lines.append("checks:")
    lines += [f"  {STATUS_MARK[c['status']]} {c['name']:<18} {c['detail']} ({c['seconds']:.1f} s)"
              for c in report["checks"]]
    if report["not_checked"]:
        lines.append("not checked here: " + "; ".join(report["not_checked"]))
    lines.append("all checks that ran passed" if report["ok"] else "some checks FAILED")
    return lines
