"""Refresh `constraints.txt` (the tested versions), or try the newest releases against the tests.

pyproject.toml keeps version ranges, for people who install flowrec into an environment of their
own; `constraints.txt` pins every package of a fresh install to the versions the tests passed with,
and the README's set-up lines and `.ci/run` install through it, so a new release of a dependency
cannot break a fresh install unnoticed. Both modes build a fresh virtual environment in a
temporary folder (torch first, pinned, so pip never resolves a CUDA build), never touching yours.

    python tools/lock_deps.py                  # refresh constraints.txt from the newest releases
    python tools/lock_deps.py --check-latest   # newest releases: what changed against constraints.txt,
                                               # then the README's test line with them (exit 1 if it fails)
    python tools/lock_deps.py --check-latest -- tests/unit -x   # ... with these pytest arguments

Refresh, then run the tests with the new file (`.ci/run` does) before committing it.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

CONSTRAINTS = REPO / "constraints.txt"
TORCH = "torch==2.13.0"  # the CPU build CI uses; GPU users install their CUDA build of torch first
EXTRAS = ".[dev,gpucheck,tensorboard,ann]"  # every optional group the tests or CI install
INSTALL_TIMEOUT_S = 1800
HEADER = """\
# Tested versions of every package a fresh install of flowrec takes (all extras but gpu and gpu-cuda13).
# pyproject.toml keeps ranges; the README's set-up lines and .ci/run install with `-c constraints.txt`.
# Refresh: python tools/lock_deps.py   (then run the tests with it before committing)
# Newest releases against the tests: python tools/lock_deps.py --check-latest
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--check-latest", action="store_true",
                        help="install the newest releases and run the tests, without writing constraints.txt")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest with --check-latest (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrec-lock-") as tmp:
        python = _fresh_env(Path(tmp))
        frozen = _freeze(python)
        if not args.check_latest:
            CONSTRAINTS.write_text(HEADER + "".join(f"{line}\n" for line in frozen), encoding="utf-8")
            print(f"wrote {CONSTRAINTS.relative_to(REPO)}: {len(frozen)} packages")
            return 0
        _report_changes(frozen)
        code = subprocess.call([str(python), "-m", "pytest", *args.pytest_args], cwd=REPO,
                               env={**os.environ, "TMPDIR": tmp})
        print(f"newest releases: the tests {'passed' if code == 0 else f'FAILED (pytest exit {code})'}")
        return 0 if code == 0 else 1


def _fresh_env(tmp: Path) -> Path:
    """A new virtual environment with torch (pinned) and flowrec with every extra, newest otherwise."""
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True)
    python = tmp / "venv" / "bin" / "python"
    pin = tmp / "torch.txt"
    pin.write_text(TORCH + "\n", encoding="utf-8")
    for packages in (["--upgrade", "pip"], [TORCH], ["-c", str(pin), "-e", EXTRAS]):
        run_tree([str(python), "-m", "pip", "install", "-q", *packages], cwd=REPO, check=True,
                 timeout_s=INSTALL_TIMEOUT_S)
    return python


def _freeze(python: Path) -> list[str]:
    """`name==version` of every installed package but flowrec itself, sorted by name."""
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    lines = [line.strip().split("+")[0]  # no local label: 2.13.0 admits torch's +cpu and +cu12x builds
             for line in out.splitlines() if "==" in line and not line.startswith("flowrec==")]
    return sorted(lines, key=lambda line: line.split("==")[0].lower())


def _report_changes(frozen: list[str]) -> None:
    """Print each package whose newest release differs from the tested version."""
    tested = _versions(CONSTRAINTS.read_text(encoding="utf-8").splitlines()) if CONSTRAINTS.exists() else {}
    newest = _versions(frozen)
    changed = [f"  {name}: {tested.get(name, 'not in constraints.txt')} -> {version}"
               for name, version in sorted(newest.items()) if tested.get(name) != version]
    gone = [f"  {name}: {version} -> not installed any more" for name, version in sorted(tested.items())
            if name not in newest]
    print("newest releases against constraints.txt:" if changed or gone else
          "newest releases: the same versions as constraints.txt")
    print("\n".join(changed + gone))


def _versions(lines: list[str]) -> dict[str, str]:
    pairs = (line.split("#")[0].strip().split("==", 1) for line in lines)
    return {re.sub(r"[-_.]+", "-", p[0]).lower(): p[1] for p in pairs if len(p) == 2}


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    sys.exit(run_stoppable(main))
