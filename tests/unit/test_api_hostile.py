"""The Python API given what a hostile or careless notebook user gives it (pyapi14): each argument of
the wrong kind one `RunError` line naming it, before anything is written; a callback's answer never
ignored without a word; the run's refusals in the call's own words (`rows=`, not `--rows`). One test
per defect; each fails on the code before its fix.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

import flowrec
from flowrec.runs.errors import RunError


def _spec(folder: Path, early_stopping: bool = False) -> Path:
    """A tiny spec of random sizes; with early stopping on auc where asked."""
    path = folder / "t.yaml"
    stopping = "  early_stopping: {metric: auc, patience: 2}\n" if early_stopping else ""
    path.write_text(f"""
name: hostile
features:
  - {{name: price, type: dense, transform: log1p}}
  - {{name: user_id, type: categorical, hash_buckets: {random.randint(30, 90)}, dim: 4}}
modules:
  - {{name: deep, kind: mlp, inputs: ["@dense", user_id], layers: [{random.choice([4, 8])}]}}
heads:
  - {{name: click, input: deep, task: binary, loss: bce}}
training:
  batch_size: {random.choice([16, 32])}
  epochs: 1
{stopping}""")
    return path


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", "meta:0"])
def test_a_device_torch_reads_but_flowrec_does_not_run_on_is_one_line_before_anything(tmp_path: Path,
                                                                                     device: str) -> None:
    """`device="meta"` passed the check (torch reads the name): `flowrec.load` returned a run whose
    model had no weights (torch's warnings only, every score from nothing) and `flowrec.train`
    failed deep in torch ('Tensor.item() cannot be called on meta tensors'; mps: 'Could not run
    aten::empty.memory_format'), after the run folder was made. Both are one RunError line now."""
    spec = _spec(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(RunError, match=rf"^device must be auto, cpu or cuda\[:N\], not '{device}'") as err:
        flowrec.train(spec, out=out, rows=200, max_steps=1, device=device)
    assert "\n" not in str(err.value) and not out.exists()
    with pytest.raises(RunError, match=rf"^device must be auto, cpu or cuda\[:N\], not '{device}'"):
        flowrec.load(tmp_path / "nowhere", device=device)


@pytest.mark.parametrize("argument", ["spec", "out", "data", "eval_data", "resume", "run_dir"])
def test_a_path_holding_a_nul_character_is_one_line_naming_the_argument(tmp_path: Path, argument: str) -> None:
    """A NUL in a path (text pasted from a binary file, a C string's end) met os.stat's bare
    ValueError ('embedded null byte') deep in the loader; a shell's argument cannot hold one, so only
    the API meets it. It is one RunError naming the argument."""
    spec = _spec(tmp_path)
    bad = str(tmp_path / f"r{random.randint(0, 9)}\0x")
    given = Path(bad) if random.random() < 0.5 else bad
    with pytest.raises(RunError, match=rf"^{argument}: the path .* holds a NUL character") as err:
        if argument == "run_dir":
            flowrec.load(given)
        elif argument == "spec":
            flowrec.train(given, out=None)
        else:
            flowrec.train(spec, **{argument: given})
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml"]
