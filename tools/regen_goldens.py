"""Regenerate the golden plans: tests/golden/<spec>.plan.json and <spec>.plan.txt for every spec,
and <spec>.lowering.txt: the module tree and every parameter's and buffer's shape and dtype of the
plan lowered on the meta device (no memory), so a move of the runtime is proven behaviour-free.

Usage:
    .venv/bin/python tools/regen_goldens.py            # rewrite every golden
    .venv/bin/python tools/regen_goldens.py --check    # exit 1 if any golden differs
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flowrec.planner.manager import make_plan
from flowrec.graph.plan_io import WRITER, plan_document
from flowrec.planner.report import text_report
from flowrec.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"


def lowering_text(plan, spec) -> str:
    """The lowered model of `plan` on the meta device: one line per module (name and class) and per
    parameter and buffer (name, shape, dtype, trainable or not), in registration order."""
    from flowrec.runtime.lowering import lower

    model = lower(plan, spec, device="meta")
    lines = [f"module {name or '<root>'}: {type(m).__module__}.{type(m).__qualname__}"
             for name, m in model.named_modules()]
    lines += [f"param {name}: {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
              f"{'' if p.requires_grad else ' frozen'}" for name, p in model.named_parameters()]
    lines += [f"buffer {name}: {tuple(b.shape)} {str(b.dtype).removeprefix('torch.')}"
              for name, b in model.named_buffers()]
    return "\n".join(lines) + "\n"


def golden_texts(spec_path: Path) -> dict[str, str]:
    """Golden file name -> content for one spec (default target and budget of the spec)."""
    spec = load_spec(spec_path)
    plan = make_plan(spec)
    stem = spec_path.stem
    doc = {k: v for k, v in plan_document(plan).items() if k != WRITER}  # `plan_json`'s text but the writer's
    # version, which would change every golden at every release
    return {f"{stem}.plan.json": json.dumps(doc, indent=2, sort_keys=True) + "\n",
            f"{stem}.plan.txt": "\n".join(text_report(plan)) + "\n",
            f"{stem}.lowering.txt": lowering_text(plan, spec)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    stale = []
    for spec_path in sorted((REPO / "specs").glob("*.yaml")):
        for name, text in golden_texts(spec_path).items():
            target = GOLDEN / name
            if args.check:
                if not target.exists() or target.read_text(encoding="utf-8") != text:
                    stale.append(name)
            else:
                target.write_text(text, encoding="utf-8")
                print(f"wrote {target.relative_to(REPO)}")
    for name in stale:
        print(f"stale golden: {name}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
