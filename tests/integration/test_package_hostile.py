"""Hostile model packages, one row per case: a package is untrusted input. Each case gives one line
and exit 2 through `flowrec predict` (and ValueError through `flowrec.load_model`), runs nothing
from the package (marker files never appear), writes nothing and changes nothing."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.layout import DataError
from flowrec.serving.predict import load_model
from flowrec.testing.processes import run_bounded

SPEC = """
name: pkg_hostile
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 40, dim: 4}
  - {name: city, type: categorical, hash_buckets: 20, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 64, epochs: 1, seed: 0}
"""
runner = CliRunner()
ROOT = "model/"  # the archive's root folder (torch names it after the file)


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 50, rows)
    return pd.DataFrame({"price": rng.lognormal(2.0, 1.0, rows), "user": [f"u{u}" for u in user],
                         "city": rng.integers(0, 90, rows), "label": (user % 3 == 0).astype(int)})


class Payload:
    """A pickle that would create `marker` when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A trained run of the package test's spec, its package and raw rows to score."""
    root = tmp_path_factory.mktemp("pkg_hostile")
    (root / "spec.yaml").write_text(SPEC)
    raw_rows(600, 0).to_csv(root / "train.csv", index=False)
    raw_rows(50, 1).to_csv(root / "new.csv", index=False)
    spec = str(root / "spec.yaml")
    made = runner.invoke(app, ["data", "convert", "csv", str(root / "train.csv"), str(root / "data"), "--spec",
                               spec, "-q"])
    assert made.exit_code == 0, made.output
    run = runner.invoke(app, ["train", spec, "--data", str(root / "data"), "--out", str(root / "run"), "--quiet",
                              "--device", "cpu"])
    assert run.exit_code == 0, run.output
    exported = runner.invoke(app, ["export", str(root / "run"), str(root / "pkg")])
    assert exported.exit_code == 0, exported.output
    return root


@pytest.fixture
def case(base: Path, tmp_path: Path) -> Path:
    """A private copy of the package and the raw rows."""
    shutil.copytree(base / "pkg", tmp_path / "pkg")
    shutil.copy(base / "new.csv", tmp_path / "new.csv")
    return tmp_path


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_exit_2(result, fragment: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.output


def redigest(pkg: Path) -> None:
    """Rewrite the manifest's digests to the files as they are now (an attacker controls both)."""
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["files"] = {str(p.relative_to(pkg)): hashlib.sha256(p.read_bytes()).hexdigest()
                         for p in sorted(pkg.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (pkg / "manifest.json").write_text(json.dumps(manifest))


def rewrite_archive(pkg: Path, edit: Callable[[dict[str, bytes]], None]) -> None:
    """Edit the entries of model.pt2 (name -> bytes) and write it again as a plain zip."""
    path = pkg / "model.pt2"
    with zipfile.ZipFile(path) as z:
        entries = {i.filename: z.read(i) for i in z.infolist()}
    edit(entries)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries.items():
            z.writestr(name, data)


def pickled(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": Payload(marker)}, buffer)
    return buffer.getvalue()


def edit_json(entries: dict[str, bytes], name: str, edit: Callable[[dict], None]) -> None:
    doc = json.loads(entries[ROOT + name])
    edit(doc)
    entries[ROOT + name] = json.dumps(doc).encode()


def pickled_weight(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """The first weight's record says use_pickle, and its bytes are a hostile pickle."""
    def edit(entries: dict[str, bytes]) -> None:
        config = json.loads(entries[ROOT + "data/weights/model_weights_config.json"])
        meta = next(iter(config["config"].values()))
        meta["use_pickle"] = True
        entries[ROOT + "data/weights/" + meta["path_name"]] = pickled(marker)
        entries[ROOT + "data/weights/model_weights_config.json"] = json.dumps(config).encode()
    return edit


def pickled_constant(marker: Path) -> Callable[[dict[str, bytes]], None]:
    def edit(entries: dict[str, bytes]) -> None:
        entries[ROOT + "data/constants/tensor_constant0"] = pickled(marker)
        edit_json(entries, "data/constants/model_constants_config.json", lambda d: d["config"].update(
            c={"path_name": "tensor_constant0", "is_param": False, "use_pickle": True, "tensor_meta": None}))
    return edit


def extra_entry(name: str, data: Callable[[Path], bytes]) -> Callable[[Path], Callable[[dict[str, bytes]], None]]:
    return lambda marker: lambda entries: entries.update({ROOT + name: data(marker)})


def program_edit(edit: Callable[[dict, Path], None]) -> Callable[[Path], Callable[[dict[str, bytes]], None]]:
    return lambda marker: lambda entries: edit_json(entries, "models/model.json", lambda d: edit(d, marker))


def _first_node(doc: dict) -> dict:
    return doc["graph_module"]["graph"]["nodes"][0]


def _first_expr(doc: dict) -> dict:
    return next(iter(doc["graph_module"]["graph"]["sym_int_values"].values()))["as_expr"]


SYSTEM = "__import__('os').system('touch {m}')"
ARCHIVES = {  # case -> (edit of the archive given the marker path, flowrec's words)
    "pickled_weight": (pickled_weight, "needs pickle"),
    "pickled_constant": (pickled_constant, "needs pickle"),
    "pickled_example_inputs": (extra_entry("data/sample_inputs/model.pt", pickled), "example inputs need pickle"),
    "custom_object": (extra_entry("data/constants/custom_obj0", pickled), "never hold"),
    "legacy_weights_file": (extra_entry("data/weights/model.pt", pickled), "never hold"),
    "compiled_library": (extra_entry("data/aotinductor/model/model.so", lambda m: b"\x7fELF"), "never hold"),
    "guard_that_runs_code": (program_edit(lambda d, m: d.update(guards_code=[SYSTEM.format(m=m)])), "a guard"),
    "guard_breaking_out_of_its_message": (program_edit(lambda d, m: d.update(
        guards_code=["1 == 'a\" + str(__import__(\"os\").system(\"touch " + str(m) + "\")) + \"'"])), "a guard"),
    "shape_expression_that_runs_code": (program_edit(lambda d, m: _first_expr(d).update(
        expr_str=SYSTEM.format(m=m))), "shape expression"),
    "target_outside_aten": (program_edit(lambda d, m: _first_node(d).update(target="torch.save")), "not an ATen"),
    "parameter_name_as_code": (program_edit(lambda d, m: d["graph_module"]["signature"]["input_specs"][0][
        "parameter"].update(parameter_name='x") or __import__("os").system("touch ' + str(m) + '") or ("')),
        "names a parameter"),
    "stack_trace_with_a_carriage_return": (program_edit(lambda d, m: _first_node(d)["metadata"].update(
        stack_trace=f'File "x.py", line 1, in f\n    y = 1\rimport os; os.system("touch {m}")')), "carriage return"),
    "nested_program": (lambda m: lambda e: e.update({ROOT + "models/model.json": b"[" * 100_000}), "nested deeper"),
    "not_a_zip": (lambda m: None, "not a zip archive"),
    "empty": (lambda m: None, "is empty"),
}


def _plant(pkg: Path, name: str, marker: Path) -> None:
    if name == "not_a_zip":
        (pkg / "model.pt2").write_bytes((pkg / "model.pt2").read_bytes()[:200])
    elif name == "empty":
        (pkg / "model.pt2").write_bytes(b"")
    else:
        rewrite_archive(pkg, ARCHIVES[name][0](marker))
    redigest(pkg)


def _sym_int_values_present(base: Path) -> bool:
    with zipfile.ZipFile(base / "pkg" / "model.pt2") as z:
        doc = json.loads(z.read(ROOT + "models/model.json"))
    return bool(doc["graph_module"]["graph"]["sym_int_values"])


@pytest.mark.parametrize("name", sorted(ARCHIVES))
def test_a_hostile_model_pt2_is_refused_before_any_of_it_runs(case: Path, base: Path, name: str):
    if name == "shape_expression_that_runs_code":
        assert _sym_int_values_present(base)  # the exported program has shape expressions to plant in
    marker = case / "PWNED"
    _plant(case / "pkg", name, marker)
    before = snapshot(case)
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet"), "-q"])
    one_line_exit_2(result, ARCHIVES[name][1])
    with pytest.raises(ValueError, match=ARCHIVES[name][1]):
        load_model(case / "pkg")
    assert not marker.exists()
    assert snapshot(case) == before and not (case / "scores.parquet").exists()


PROOF = """
import sys, torch
try:
    program = torch.export.load(sys.argv[1])
    args, kwargs = program.example_inputs
    program.module()(*args, **kwargs)
except Exception:
    pass
"""


@pytest.mark.parametrize("name", ["pickled_weight", "pickled_example_inputs", "guard_that_runs_code",
                                  "shape_expression_that_runs_code", "guard_breaking_out_of_its_message"])
def test_the_planted_payload_runs_when_torch_loads_the_archive_unchecked(case: Path, name: str):
    """The refusal above is what keeps the marker away: torch alone runs the payload (when loading the
    archive, or at the first call of its program)."""
    marker = case / "PWNED"
    _plant(case / "pkg", name, marker)
    done = run_bounded([sys.executable, "-c", PROOF, str(case / "pkg" / "model.pt2")], capture_output=True,
                       timeout_s=300, cwd=case)
    assert marker.exists(), done.stderr[-2000:]


# ------------------------------------------------------------------ the other files of a package
def _reorder_vocab(pkg: Path) -> None:
    path = pkg / "vocab" / "user.parquet"
    values = pq.read_table(path).column("value").to_pylist()
    pq.write_table(pa.table({"value": values[1:] + values[:1]}), path)


def _manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def make(pkg: Path) -> None:
        doc = json.loads((pkg / "manifest.json").read_text())
        edit(doc)
        (pkg / "manifest.json").write_text(json.dumps(doc))
    return make


def _encoder(edit: Callable[[dict], None], digests: bool = True) -> Callable[[Path], None]:
    def make(pkg: Path) -> None:
        doc = json.loads((pkg / "encoder.json").read_text())
        edit(doc)
        (pkg / "encoder.json").write_text(json.dumps(doc))
        if digests:
            redigest(pkg)
    return make


def _then_redigest(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def both(pkg: Path) -> None:
        make(pkg)
        redigest(pkg)
    return both


def _vocab_link_out(pkg: Path) -> None:
    outside = pkg.parent / "elsewhere.parquet"
    shutil.copy(pkg / "vocab" / "user.parquet", outside)
    (pkg / "vocab" / "user.parquet").unlink()
    (pkg / "vocab" / "user.parquet").symlink_to(outside)


FILES = {
    "reordered_vocabulary": (_reorder_vocab, "does not match the digest its manifest records"),
    "reordered_vocabulary_digests_rewritten": (_then_redigest(_reorder_vocab), "does not match the digest its encoder"),
    "changed_spec": (lambda p: (p / "spec.json").write_text((p / "spec.json").read_text() + " "),
                     "does not match the digest"),
    "truncated_model": (lambda p: (p / "model.pt2").write_bytes((p / "model.pt2").read_bytes()[:999]),
                        "does not match the digest"),
    "missing_model": (lambda p: (p / "model.pt2").unlink(), "is missing"),
    "no_digests": (_manifest(lambda d: d.pop("files")), "missing required key 'files'"),
    "manifest_hides_the_model": (_manifest(lambda d: d["files"].pop("model.pt2")), "not among the files"),
    "manifest_names_a_file_outside": (_manifest(lambda d: d["files"].update({"../new.csv": "0" * 64})),
                                      "not a plain name"),
    "package_of_another_version": (_manifest(lambda d: d.update(version=99)), "package format version 99"),
    "nested_manifest": (lambda p: (p / "manifest.json").write_text("[" * 100_000), "nested deeper"),
    # the manifest's fields predict does not score with were never read: a wrong type or value passed
    # (a user calling model.pt2 with torch alone reads the order of its inputs from inputs.dense)
    "manifest_head_name_not_text": (_manifest(lambda d: d["heads"][0].update(name=5)), "].name must be a string"),
    "manifest_inputs_not_a_list": (_manifest(lambda d: d["inputs"].update(dense="price")), "inputs.dense must be a list"),
    "manifest_unknown_dtype": (_manifest(lambda d: d.update(dtype="fp64")), "dtype must be one of"),
    "manifest_table_bytes_as_text": (_manifest(lambda d: d.update(table_bytes="976")), "table_bytes must be an integer"),
    "manifest_inputs_reordered": (_manifest(lambda d: d["inputs"]["sparse"].reverse()),
                                  "inputs.sparse is not spec.json's"),
    "manifest_head_of_another_task": (_manifest(lambda d: d["heads"][0].update(task="regression")),
                                      "heads is not spec.json's"),
    "manifest_dtype_not_the_tables": (_manifest(lambda d: d.update(dtype="fp16")), "is not that of model.pt2's tables"),
    "manifest_table_bytes_not_the_tables": (_manifest(lambda d: d.update(table_bytes=d["table_bytes"] + 1)),
                                            "is not what model.pt2's tables hold"),
    "encoder_of_another_version": (_encoder(lambda d: d.update(version=7)), "encoder format version 7"),
    "encoder_vocab_up_and_out": (_encoder(lambda d: d["vocab_files"].update(user="../new.csv")), "not a plain name"),
    "encoder_vocab_absolute": (_encoder(lambda d: d["vocab_files"].update(user="/etc/passwd")),
                               "not a relative path"),
    "encoder_table_with_a_slash": (_encoder(lambda d: d["vocab_files"].update({"a/b": "vocab/user.parquet"})),
                                   "not a plain name"),
    "vocab_links_out_of_the_package": (_then_redigest(_vocab_link_out), "leads outside"),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_changed_or_hostile_package_file_is_one_line(case: Path, name: str):
    make, fragment = FILES[name]
    make(case / "pkg")
    before = snapshot(case)
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet"), "-q"])
    one_line_exit_2(result, fragment)
    with pytest.raises(ValueError, match=fragment):
        load_model(case / "pkg")
    assert snapshot(case) == before and not (case / "scores.parquet").exists()


def test_an_untouched_package_still_scores(case: Path):
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet"), "-q"])
    assert result.exit_code == 0, result.output
    assert len(pd.read_parquet(case / "scores.parquet")) == 50


def test_files_the_manifest_does_not_list_are_never_read(case: Path):
    """An encoder folder planted below the package (which `find_record` would prefer) is ignored."""
    (case / "pkg" / "encoder").mkdir()
    (case / "pkg" / "encoder" / "encoder.json").write_text('{"format": "flowrec-encoder", "version": 99}')
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet"), "-q"])
    assert result.exit_code == 0, result.output
    assert len(pd.read_parquet(case / "scores.parquet")) == 50


def test_a_raw_column_named_like_the_line_column_is_refused_not_replaced(case: Path):
    """`--keep __line__` wrote each row's line number instead of the user's column of that name."""
    rows = pd.read_csv(case / "new.csv")
    rows.insert(1, "__line__", np.arange(1000, 1000 + len(rows)))
    rows.to_csv(case / "lines.csv", index=False)
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "lines.csv"), "--format", "csv",
                                 "--keep", "__line__", "--out", str(case / "scores.parquet"), "-q"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'__line__'" in lines[0], result.stderr
    assert not (case / "scores.parquet").exists()


class _Program(torch.nn.Module):
    """A program of another export: its own sparse features, dense width and scores per row."""

    def __init__(self, scores: int) -> None:
        super().__init__()
        self.scores = scores

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = dense.sum(dim=1, keepdim=True)
        for ids, offsets in sparse.values():
            total = total + (offsets[1:] - offsets[:-1]).unsqueeze(1).float() + ids.float().sum()
        return torch.sigmoid(total.repeat(1, self.scores))


def _swap_program(sparse: list[str], dense: int, scores: int) -> Callable[[Path], None]:
    def make(pkg: Path) -> None:
        from flowrec.serving.pt2_save import save_program

        example = (torch.rand(4, dense), {name: (torch.arange(4), torch.arange(5)) for name in sparse})
        save_program(torch.export.export(_Program(scores), example, strict=False), pkg / "model.pt2")
        redigest(pkg)
    return make


class _Tables(torch.nn.Module):
    """A program of another export that takes the same inputs and returns one score, with its own
    embedding tables (rows x dim each, named as a package's are)."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(torch.rand(rows, dim), requires_grad=False)
                                              for rows, dim in shapes])

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = dense.sum(dim=1, keepdim=True)
        for (ids, offsets), weight in zip(sparse.values(), self.tables):
            pooled = torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum", include_last_offset=True)
            total = total + pooled.sum(dim=1, keepdim=True)
        return torch.sigmoid(total)


def _swap_tables(shapes: list[tuple[int, int]], any_batch: bool = True) -> Callable[[Path], None]:
    """A program of `_Tables(shapes)` for any number of rows and ids, as `flowrec export` writes
    one (`any_batch` False: for batches of 4 rows only)."""
    def make(pkg: Path) -> None:
        from flowrec.serving.pt2_save import save_program

        example = (torch.rand(4, 1), {name: (torch.arange(4) % 3, torch.arange(5)) for name in ("user", "city")})
        batch = torch.export.Dim("batch", min=1, max=1 << 20)
        dims = ({0: batch}, {name: ({0: torch.export.Dim(f"nnz_{name}", min=0, max=1 << 20)}, {0: batch + 1})
                             for name in ("user", "city")}) if any_batch else None
        save_program(torch.export.export(_Tables(shapes), example, dynamic_shapes=dims, strict=False),
                     pkg / "model.pt2")
        redigest(pkg)
    return make


SWAPPED = {  # model.pt2 of another model, its digest entered in the manifest (the spec: price; user, city; ctr)
    "other_sparse_features": _swap_program(["user"], 1, 1),
    "sparse_features_in_another_order": _swap_program(["city", "user"], 1, 1),
    "other_dense_width": _swap_program(["user", "city"], 2, 1),
    "other_head_count": _swap_program(["user", "city"], 1, 2),
    # the same inputs and scores, other tables (one packed group: user, vocab 40 + the unknown row, then
    # city, 20 buckets; dim 4):
    "smaller_tables": _swap_tables([(9, 4)]),  # torch's index error at the first id past their end
    "wider_tables": _swap_tables([(61, 8)]),  # scored without a word
    "a_table_per_logical_table": _swap_tables([(41, 4), (20, 4)]),  # (a version 2 program)
    "another_table_count": _swap_tables([(61, 4), (3, 4)]),
    "a_fixed_batch": _swap_tables([(61, 4)], any_batch=False),  # torch's AssertionError at the call
}


@pytest.mark.parametrize("name", sorted(SWAPPED))
def test_a_model_pt2_of_another_export_is_one_line(case: Path, name: str):
    """torch's own message at the first call was a multi-line pytree dump naming no file."""
    SWAPPED[name](case / "pkg")
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet"), "-q"])
    one_line_exit_2(result, "does not fit the package's spec.json")
    with pytest.raises(ValueError, match="model.pt2 does not fit"):
        load_model(case / "pkg").predict(pd.read_csv(case / "new.csv"))
    assert not (case / "scores.parquet").exists()


def test_a_package_loads_without_torchs_guard_code_and_scores_as_with_it(case: Path):
    """torch's module() wrote guard code by one pass over the placeholders per guard (17.8 s of a
    1,000-field package's load); flowrec's own check of the program's inputs proves those guards."""
    model = load_model(case / "pkg")
    assert not hasattr(model.program, "_guards_fn")
    rows = raw_rows(300, 9)
    fast = model.predict(rows)["ctr"].to_numpy()
    model.program = torch.export.load(case / "pkg" / "model.pt2").module()  # torch's guarded module
    assert hasattr(model.program, "_guards_fn")
    np.testing.assert_array_equal(model.predict(rows)["ctr"].to_numpy(), fast)


def test_a_package_is_read_with_each_schema_classs_type_hints_looked_up_once(case: Path, monkeypatch):
    """torch's deserialiser asked typing.get_type_hints of a class at each object it made: 154,010
    times, 10.1 s of a 1,000-field package's load (`flowrec.serving.pt2_load`)."""
    import typing
    from collections import Counter

    asked: Counter = Counter()
    real = typing.get_type_hints

    def counted(obj, *args, **kwargs):
        if getattr(obj, "__module__", "") == "torch._export.serde.schema":
            asked[obj.__name__] += 1
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counted)
    model = load_model(case / "pkg")
    assert asked["Node"] == 1 and asked["TensorMeta"] == 1 and max(asked.values()) == 1, asked
    assert len(model.predict(raw_rows(20, 4))) == 20


def test_a_wide_models_rows_are_scored_in_calls_bounded_by_their_looked_up_bytes(case: Path, monkeypatch):
    """A 1,000-field model's 65,536 rows a call held 2.8 GB of looked-up rows three times over
    (predict's peak 11.6 GB on 100,000 rows; 7.5 GB in calls of 256 MB). Here a row looks up 8
    floats (user, city: dim 4): calls of 224 bytes are 7 rows."""
    from flowrec.serving import predict as predicting

    rows = raw_rows(50, 12)
    model = load_model(case / "pkg")
    whole = model.predict(rows)["ctr"].to_numpy()
    monkeypatch.setattr(predicting, "CALL_BYTES", 4 * 8 * 7)
    sizes = []
    program = model.program

    def counted(dense, sparse):
        sizes.append(dense.shape[0])
        return program(dense, sparse)

    model.program = counted
    np.testing.assert_allclose(model.predict(rows)["ctr"].to_numpy(), whole, rtol=1e-6, atol=1e-7)
    assert sizes == [7] * 7 + [1]


WIDE_FIELDS = 40


@pytest.fixture(scope="module")
def wide_pkg(tmp_path_factory) -> Path:
    """The package of a 40-field model trained on synthetic rows (hashed tables: it scores raw rows)."""
    root = tmp_path_factory.mktemp("wide_pkg")
    features = "".join(f"  - {{name: c{i:03d}, type: categorical, hash_buckets: 20, dim: 2}}\n" for i in range(WIDE_FIELDS))
    (root / "wide.yaml").write_text(
        f"name: wide_rows\nfeatures:\n  - {{name: d0, type: dense, transform: log1p}}\n{features}"
        "modules:\n  - {name: top, kind: mlp, inputs: [\"@dense\", \"@sparse\"], layers: [4]}\n"
        "heads:\n  - {name: ctr, input: top, task: binary, loss: bce}\ntraining: {batch_size: 64, epochs: 1, seed: 0}\n")
    run = runner.invoke(app, ["train", str(root / "wide.yaml"), "--rows", "200", "--out", str(root / "run"),
                              "--quiet", "--device", "cpu"])
    assert run.exit_code == 0, run.output
    assert runner.invoke(app, ["export", str(root / "run"), str(root / "pkg")]).exit_code == 0
    return root / "pkg"


def test_rows_lacking_many_of_a_wide_models_columns_are_one_short_line(wide_pkg: Path, tmp_path: Path):
    """Rows lacking 500 of a 1,000-field model's columns were a line of 4,551 characters naming each;
    1,000 columns renamed a hint of 24,000 characters (2 s of difflib)."""
    rng = np.random.default_rng(8)
    rows = pd.DataFrame({"d0": rng.lognormal(1.0, 1.0, 30),
                         **{f"c{i:03d}": rng.zipf(1.4, 30) % 90 for i in range(WIDE_FIELDS)}})
    kept = rows.drop(columns=[f"c{i:03d}" for i in range(5, WIDE_FIELDS)])  # 35 lacking
    renamed = rows.rename(columns={f"c{i:03d}": f"col_{i:03d}" for i in range(WIDE_FIELDS)})  # 40 lacking, renamed
    model = load_model(wide_pkg)
    for frame, more in ((kept, "and 23 more"), (renamed, "and 28 more")):
        frame.to_csv(tmp_path / "rows.csv", index=False)
        result = runner.invoke(app, ["predict", str(wide_pkg), str(tmp_path / "rows.csv"), "--format", "csv",
                                     "--out", str(tmp_path / "scores.parquet"), "-q"])
        one_line_exit_2(result, more)
        assert len(result.stderr) < 900, result.stderr
        with pytest.raises(DataError, match=more) as caught:
            model.predict(frame)
        assert len(str(caught.value)) < 900
    assert "col_011" in str(caught.value) and "col_012" not in str(caught.value)  # 12 renames named, the first
    assert not (tmp_path / "scores.parquet").exists()


def test_rows_that_leave_most_of_a_wide_models_columns_empty_are_a_few_warning_lines(wide_pkg: Path, tmp_path: Path):
    """Two blank rows of a 1,000-field model were 1,004 warning lines, one a column."""
    import warnings

    rng = np.random.default_rng(21)
    blank = pd.DataFrame({"d0": rng.lognormal(1.0, 1.0, 6),
                          **{f"c{i:03d}": [" ", "", None, " ", "", None] if i % 7 else rng.zipf(1.4, 6) % 90
                             for i in range(WIDE_FIELDS)}})  # 34 of 40 columns empty
    blank.to_csv(tmp_path / "rows.csv", index=False)
    result = runner.invoke(app, ["predict", str(wide_pkg), str(tmp_path / "rows.csv"), "--format", "csv",
                                 "--out", str(tmp_path / "scores.parquet"), "-q"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(said) == 13 and "22 more feature columns are empty in every row as well (34 in all)" in said[-1], said
    assert len(pd.read_parquet(tmp_path / "scores.parquet")) == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(wide_pkg).predict(blank)
    empty = [str(w.message) for w in caught if "empty in every" in str(w.message)]
    assert len(empty) == 13 and "(34 in all)" in empty[-1], empty


def test_a_model_pt2_of_a_fixed_batch_is_refused_at_load(case: Path):
    """It loaded, and the first call of predict failed torch's guard."""
    SWAPPED["a_fixed_batch"](case / "pkg")
    with pytest.raises(ValueError, match="model.pt2 does not fit the package's spec.json: it takes batches of 4 rows only"):
        load_model(case / "pkg")


def test_an_id_beyond_64_bits_in_a_csv_scores_as_its_text(case: Path):
    """The CSV reader keeps an id column's text: a 30-digit city scores as that string does through
    the Python API (where a Python int of that size is refused: test_walk4_hostile)."""
    rows = pd.read_csv(case / "new.csv").head(4).drop(columns=["label"])
    big = ["123456789012345678901234567890", "98765432109876543210987654321", "-31415926535897932384626",
           "27182818284590452353602874713"]  # 4 ids: a reader taking them as floats hashes other text
    (case / "big.csv").write_text(rows.assign(city=big).to_csv(index=False))
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "big.csv"), "--format", "csv",
                                 "--out", str(case / "scores.csv"), "-q"])
    assert result.exit_code == 0, result.output
    scored = pd.read_csv(case / "scores.csv")["ctr"].to_numpy()
    expected = load_model(case / "pkg").predict(rows.assign(city=big))["ctr"].to_numpy()
    np.testing.assert_allclose(scored, expected, rtol=1e-6)


ML_SPEC = """
name: ml_hostile
features:
  - {name: user_id, type: categorical, vocab: 30, dim: 4}
  - {name: item_id, type: categorical, vocab: 40, dim: 4}
  - {name: age, type: categorical, vocab: 8, dim: 4}
  - {name: occupation, type: categorical, hash_buckets: 16, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
data: {format: movielens, path: ml, label: label}
training: {batch_size: 64, epochs: 1, seed: 0}
"""
BIG = "123456789012345678901234567890"  # beyond 64 bits


def _ml_1m(folder: Path, users: int = 30, extra_user: str = "", ratings: str = "", movies: str = "") -> Path:
    """A small MovieLens-1M folder (users.dat, movies.dat, ratings.dat), with lines appended."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True)
    (folder / "users.dat").write_text("".join(f"{u}::{'FM'[u % 2]}::{[1, 18, 25, 35][u % 4]}::{u % 21}::{10000 + u}\n"
                                              for u in range(1, users + 1)) + extra_user)
    (folder / "movies.dat").write_text("".join(f"{m}::Film {m} ({1950 + m})::Drama\n" for m in range(1, 41)) + movies)
    (folder / "ratings.dat").write_text("".join(f"{u}::{m}::{r}::{978300000 + i}\n" for i, (u, m, r) in enumerate(
        zip(rng.integers(1, users + 1, 400), rng.integers(1, 41, 400), rng.integers(1, 6, 400)))) + ratings)
    return folder


@pytest.fixture(scope="module")
def ml_pkg(tmp_path_factory) -> Path:
    """The package of a run on a small MovieLens-1M folder."""
    root = tmp_path_factory.mktemp("ml_hostile")
    (root / "spec.yaml").write_text(ML_SPEC)
    _ml_1m(root / "ml")
    run = runner.invoke(app, ["train", str(root / "spec.yaml"), "--out", str(root / "run"), "--quiet", "--device",
                              "cpu"])
    assert run.exit_code == 0, run.output
    exported = runner.invoke(app, ["export", str(root / "run"), str(root / "pkg")])
    assert exported.exit_code == 0, exported.output
    return root / "pkg"


@pytest.mark.parametrize("lines, says", [
    ({"ratings": f"{BIG}::2::4::978300999\n"}, "ratings.dat:401: user '1234"),
    ({"ratings": "1::2::4::-" + BIG + "\n"}, "ratings.dat:401: timestamp '-1234"),
    ({"movies": f"{BIG}::Other (1990)::Drama\n"}, "movies.dat:41: id '1234"),
    ({"extra_user": f"{BIG}::M::25::3::12345\n"}, "users.dat:31: id '1234"),
], ids=["user", "timestamp", "movie", "users_dat"])
def test_an_id_beyond_64_bits_in_movielens_files_is_one_line_naming_its_line(ml_pkg: Path, tmp_path: Path,
                                                                               lines: dict, says: str):
    """`flowrec predict PKG FOLDER --format movielens` scored a rating of a user or movie id beyond
    64 bits as id INT64_MIN without a word; in movies.dat or users.dat it was a traceback."""
    folder = _ml_1m(tmp_path / "new", **lines)
    result = runner.invoke(app, ["predict", str(ml_pkg), str(folder), "--format", "movielens", "--out",
                                 str(tmp_path / "scores.parquet"), "-q"])
    one_line_exit_2(result, says)
    assert "beyond 64 bits" in result.stderr
    assert not (tmp_path / "scores.parquet").exists()


def test_an_age_code_beyond_64_bits_in_movielens_scores_as_its_text(ml_pkg: Path, tmp_path: Path):
    """users.dat's age code beyond 64 bits was pandas' TypeError traceback; it scores as that text
    does through the Python API (as an id beyond 64 bits in a CSV does)."""
    folder = _ml_1m(tmp_path / "new", users=3, extra_user=f"4::M::{BIG}::3::12345\n",
                    ratings="4::2::4::978300999\n")
    result = runner.invoke(app, ["predict", str(ml_pkg), str(folder), "--format", "movielens", "--out",
                                 str(tmp_path / "scores.csv"), "--keep", "age", "-q"])
    assert result.exit_code == 0, result.output
    scored = pd.read_csv(tmp_path / "scores.csv", dtype={"age": str})
    assert scored["age"].iloc[-1] == BIG
    rows = pd.DataFrame({"user_id": [4], "item_id": [2], "age": [BIG], "occupation": ["3"]})
    np.testing.assert_allclose(scored["ctr"].iloc[-1], load_model(ml_pkg).predict(rows)["ctr"].iloc[0], rtol=1e-6)


def test_predict_into_a_log_writes_its_closing_line_not_a_spinner(case: Path):
    """Without a terminal (a log, a pipe, CI) predict's spinner printed its last frame ('⠋ scoring
    new.csv 50 rows 0:00:00') before the closing line."""
    result = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "new.csv"), "--format", "csv",
                                 "--out", str(case / "scores.parquet")])
    assert result.exit_code == 0, result.output
    assert "scoring" not in result.output and "wrote 50 scored rows to" in result.output, result.output


def test_the_program_scores_without_tracking_gradients(case: Path):
    """docs/production.md's torch-only call: its scores tracked gradients (the dense layers were
    exported as trainable parameters), so `.numpy()` on them failed outside torch.no_grad()."""
    model = torch.export.load(case / "pkg" / "model.pt2").module()
    sparse = {"user": (torch.tensor([3, 1, 7]), torch.arange(4)), "city": (torch.tensor([5, 0, 2]), torch.arange(4))}
    scores = model(torch.rand(3, 1) + 0.5, sparse)
    assert tuple(scores.shape) == (3, 1) and not scores.requires_grad
    assert ((scores.numpy() > 0) & (scores.numpy() < 1)).all()
    assert not any(p.requires_grad for p in model.parameters())
