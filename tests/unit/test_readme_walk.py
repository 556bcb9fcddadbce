"""What a new user found following README.md and the pages it links, command by command: one test
per defect (each fails on the code before its fix)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrec.data import sources
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import META_FILE, DataError

TEXT_READERS = {"csv": sources.read_csv, "avazu": sources.read_avazu, "criteo": sources.read_criteo,
                "libsvm": sources.read_libsvm}


def _split_dataset(tmp_path: Path) -> Path:
    """What `flowrec data convert ... data/clicks/ --test-fraction 0.1` leaves: train/ and test/."""
    root = tmp_path / "clicks"
    for part in ("train", "test"):
        (root / part).mkdir(parents=True)
        (root / part / META_FILE).write_text(json.dumps({"format": "flowrec-dataset", "part": part}), encoding="utf-8")
        (root / part / "part-00000.parquet").write_bytes(b"PAR1")
    return root


@pytest.mark.parametrize("fmt", sorted(TEXT_READERS))
@pytest.mark.parametrize("which", ["test part", "split root"])
def test_an_encoded_dataset_given_to_a_text_format_is_named_as_one(tmp_path: Path, fmt: str, which: str) -> None:
    """`flowrec predict pkg/first data/clicks/test --out s.parquet` (the README's test split, scored
    with the package's csv format) said pyarrow's "Expected file path, but data/clicks/test is a
    directory"; `data convert csv data/clicks/test ...` the same."""
    root = _split_dataset(tmp_path)
    path = root / "test" if which == "test part" else root
    options = {"fields": ["a"]} if fmt == "libsvm" else {}
    with pytest.raises(DataError, match=f"encoded flowrec dataset.*{META_FILE}.*flowrec eval") as err:
        list(TEXT_READERS[fmt](path, options, ErrorLog("fail", str(path)), set()))
    assert "Expected file path" not in str(err.value)


@pytest.mark.parametrize("fmt", sorted(TEXT_READERS))
def test_a_folder_of_raw_files_given_to_a_text_format_says_it_reads_one_file(tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / "raw"
    folder.mkdir()
    (folder / "clicks.csv").write_text("label,a\n1,x\n", encoding="utf-8")
    options = {"fields": ["a"]} if fmt == "libsvm" else {}
    with pytest.raises(DataError, match=rf"raw is a folder, not a file: the {fmt} format reads one file"):
        list(TEXT_READERS[fmt](folder, options, ErrorLog("fail", str(folder)), set()))


def test_criteo_predict_on_a_folder_is_one_line_before_the_label_probe(tmp_path: Path) -> None:
    """`flowrec predict PKG FOLDER` of a Criteo package probes the first row for the label column."""
    root = _split_dataset(tmp_path)
    with pytest.raises(DataError, match="encoded flowrec dataset"):
        sources.criteo_has_label(root / "test")


def test_eval_of_run_best_without_early_stopping_says_why_there_is_none(tmp_path: Path) -> None:
    """`flowrec eval runs/ml/best` (an example of `flowrec eval --help`) on a run trained without
    training.early_stopping said only "no checkpoint at runs/ml/best"."""
    from flowrec.runtime.checkpoint.format import CheckpointError
    from flowrec.runtime.checkpoint.store import load_checkpoint

    run = tmp_path / "ml"
    run.mkdir()
    (run / "run.json").write_text("{}", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*best: .*early_stopping.*holds the run's last checkpoint"):
        load_checkpoint(run / "best")


@pytest.mark.parametrize("given", ["folder", "checkpoint file"])
def test_a_model_package_or_dataset_given_for_a_run_is_named(tmp_path: Path, given: str) -> None:
    """`flowrec eval pkg/first` (the README's package for the run runs/first) said only "no
    checkpoint at pkg/first/checkpoint.pt"; a dataset folder given to `export` the same."""
    from flowrec.runtime.checkpoint.format import CheckpointError
    from flowrec.runtime.checkpoint.store import load_checkpoint

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "manifest.json").write_text(json.dumps({"format": "flowrec-model"}), encoding="utf-8")
    data = _split_dataset(tmp_path)
    for folder, says in ((pkg, "is a model package .*flowrec predict"), (data, "is a dataset's folder, not a run")):
        path = folder if given == "folder" else folder / "checkpoint.pt"
        with pytest.raises(CheckpointError, match=f"no checkpoint at .*: .*{says}"):
            load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"^no checkpoint at \S+: there is no such file or folder$"):
        load_checkpoint(tmp_path / "nope")  # a path that is nothing, no run of a close name beside it


def _package_spec(fmt: str):
    from types import SimpleNamespace

    return SimpleNamespace(spec=SimpleNamespace(data=SimpleNamespace(format=fmt, options={})))


@pytest.mark.parametrize("fmt, name, says", [
    ("movielens", "new_ratings.csv", "is a file, but the package's spec reads a MovieLens folder .*--format csv"),
    ("csv", "clicks.parquet", "is named as Parquet, but the package's spec reads csv .*--format parquet"),
    ("criteo", "day_24.pq", "is named as Parquet, but the package's spec reads criteo .*--format parquet"),
])
def test_predict_without_format_names_the_flag_when_the_file_is_not_the_specs_format(
        tmp_path: Path, fmt: str, name: str, says: str) -> None:
    """`flowrec predict pkg/ml new_ratings.csv --out s.parquet` (the help's example without its
    --format csv) said only that the file is not a MovieLens folder, listing every release's
    files; a Parquet file scored by a csv package that a row "is not valid UTF-8"."""
    from flowrec.cli.predict_cmd import _raw_chunks

    raw = tmp_path / name
    raw.write_bytes(b"PAR1" if name.endswith(("parquet", "pq")) else b"user_id,item_id\n1,2\n")
    with pytest.raises(ValueError, match=f"{name} {says}"):
        _raw_chunks(_package_spec(fmt), raw, None, "fail")


def test_predict_with_format_or_a_movielens_folder_is_not_second_guessed(tmp_path: Path) -> None:
    from flowrec.cli.predict_cmd import default_format_mismatch

    assert default_format_mismatch(tmp_path, "movielens") is None  # a folder: the spec's format reads it
    assert default_format_mismatch(tmp_path / "x.parquet", "parquet") is None
    assert default_format_mismatch(tmp_path / "x.tsv", "criteo_tsv") is None


def test_export_names_a_retrieval_packages_items_and_a_managed_packages_maps(tmp_path: Path) -> None:
    """`flowrec export runs/tt pkg/tt` printed "wrote pkg/tt (model.pt2, encoder.json, spec.json,
    plan.json, manifest.json)": not items.parquet, the catalogue `predict --top-k` reads (nor
    items.faiss with --index faiss, nor a managed model's managed/ maps)."""
    from flowrec.cli import export_cmd

    pkg = tmp_path / "tt"
    (pkg / "vocab").mkdir(parents=True)
    (pkg / "managed").mkdir()
    for name in ("model.pt2", "encoder.json", "spec.json", "plan.json", "manifest.json", "items.parquet",
                 "items.faiss"):
        (pkg / name).write_bytes(b"")
    assert export_cmd.package_listing(pkg) == ["model.pt2", "encoder.json", "spec.json", "plan.json",
                                               "manifest.json", "items.faiss", "items.parquet", "managed/"]


@pytest.mark.parametrize("env", [{"FLOWREC_CPU_GEMM": "mlk"}, {"FLOWREC_MALLOC_TUNING": "off"},
                                 {"FLOWREC_CHECKPOINT_WRITES": "inlne"}, {"FLOWREC_DATA_PRIORITY": "hi"}])
def test_calibrate_refuses_a_bad_switch_in_one_line_before_measuring(tmp_path: Path, env: dict, monkeypatch) -> None:
    """`FLOWREC_CPU_GEMM=mlk flowrec calibrate` (the README's calibrate, with docs/guide.md's GEMM
    switch misspelt) ended in a ValueError traceback after its first measurements; `flowrec train`
    refused it in one line."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from operators import onednn

    monkeypatch.setattr(onednn, "_LIBRARY", None)  # decided once a process: an earlier test decided it

    out = tmp_path / "cal.json"
    result = CliRunner().invoke(app, ["calibrate", "--seconds", "0.01", "--out", str(out)], env=env)
    (name,) = env
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [result.output.strip()] and f"error: {name}=" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_a_split_dataset_given_where_one_dataset_is_read_names_its_parts(tmp_path: Path) -> None:
    """`flowrec data profile my_model.yaml data/clicks/` (the README's converted, split dataset) and
    `--eval-data data/clicks` said "data/clicks is not a flowrec dataset (no _flowrec.json); convert it
    first", of a folder just converted."""
    from flowrec.data.layout import read_meta

    root = _split_dataset(tmp_path)
    with pytest.raises(DataError, match=r"clicks is a split dataset: its parts \S+train and \S+test are the "
                                        r"datasets; give one of them"):
        read_meta(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="is not a flowrec dataset"):  # any other folder: as before
        read_meta(empty)


def _quoted_block(page: str, opening: str) -> list[str]:
    """The lines of the first fenced block of `page` whose first line starts with `opening`."""
    text = (Path(__file__).resolve().parents[2] / page).read_text(encoding="utf-8")
    for block in text.split("```")[1::2]:
        lines = block.split("\n")[1:]
        if lines and lines[0].startswith(opening):
            return [line for line in lines if line.strip()]
    raise AssertionError(f"{page}: no block opening with {opening!r}")


@pytest.mark.parametrize("page, opening, args", [
    ("README.md", "$ flowrec plan specs/dlrm_criteo.yaml", ["plan", "specs/dlrm_criteo.yaml"]),
    ("docs/plan.md", "packed groups:",
     ["plan", "specs/dlrm_criteo.yaml", "--target", "h100", "--device-budget", "1GiB"]),
])
def test_a_plan_report_quoted_in_the_docs_is_what_flowrec_plan_prints(page: str, opening: str, args: list[str],
                                                                      monkeypatch) -> None:
    """docs/plan.md's "Reading the report" quoted `flowrec plan specs/dlrm_criteo.yaml --target h100
    --device-budget 1GiB` with an older cost model's figures (transfer 0.040 ms, step 2.516 ms
    serial, 1.9 MiB host->device per step, where the command prints 0.127 ms, 2.935 ms, 4.5 MiB).
    Every quoted line but the elided ones (`...`) and the underline of the table is one the
    command prints (the report is the same on any machine: datasheet constants, no profile)."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    shown = CliRunner().invoke(app, args)
    assert shown.exit_code == 0, shown.output
    printed = set(shown.output.splitlines())
    quoted = [line for line in _quoted_block(page, opening) if not line.startswith("$ ") and "..." not in line]
    assert len(quoted) >= 5
    assert [line for line in quoted if line not in printed] == []


def test_the_managed_table_of_managed_md_validates_and_plans_as_the_page_says(tmp_path: Path) -> None:
    """docs/managed.md opened with a managed table setting `decay: 0.5` beside `evict: lfu`, which
    `flowrec validate` refuses ('decay' applies to evict: decayed_lfu), as the page itself says a
    line below: copied into a spec, the page's first example was an error. Now it validates, and
    `flowrec plan` prints the line the page quotes for it."""
    import re

    from typer.testing import CliRunner

    from flowrec.cli import app

    page = (Path(__file__).resolve().parents[2] / "docs" / "managed.md").read_text(encoding="utf-8")
    tables = re.search(r"```yaml\n(tables:\n.*?)```", page, re.S).group(1)
    spec = tmp_path / "m.yaml"
    spec.write_text("name: m\nfeatures:\n  - {name: user_id, type: categorical, table: users}\n" + tables
                    + "modules:\n  - {name: deep, kind: mlp, inputs: [\"@sparse\"], layers: [8]}\n"
                    + "heads:\n  - {name: ctr, input: deep, task: binary, loss: bce}\n", encoding="utf-8")
    checked = CliRunner().invoke(app, ["validate", str(spec)])
    assert checked.exit_code == 0, checked.output
    planned = CliRunner().invoke(app, ["plan", str(spec)])
    assert planned.exit_code == 0, planned.output
    quoted = re.search(r"\(`(managed table users: [^`]*)`\)", " ".join(page.split())).group(1)
    assert quoted in planned.output


PAGES = ("README.md", "docs/guide.md", "docs/spec.md", "docs/data.md", "docs/runs.md", "docs/production.md",
         "docs/python.md", "docs/plan.md", "docs/managed.md", "docs/distributed.md", "docs/caching.md",
         "docs/architecture.md", "docs/operators.md")


def _resolves(name: str) -> bool:
    """Whether a dotted name (`flowrec.spec.files.validate_file`) is a module or an attribute of one."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_every_python_name_the_pages_give_can_be_imported() -> None:
    """spec.md gave `validate_file(path)` and `validate_paths(paths)` after
    `flowrec.spec.validate.validate_document`, where they live in `flowrec.spec.files` (moved when
    folder scans learned to leave out flowrec's own files), and operators.md
    `flowrec.graph.types.OP_KINDS`, which is `flowrec.graph.kinds.OP_KINDS`: a reader's import
    failed. Every dotted flowrec or operators name on the pages is importable."""
    import re

    root = Path(__file__).resolve().parents[2]
    names = {(page, found.rstrip(".")) for page in PAGES
             for found in re.findall(r"(?<![\w/.-])((?:flowrec|operators)(?:\.[A-Za-z_]\w*)+)",
                                     (root / page).read_text(encoding="utf-8"))}
    names = {(page, name) for page, name in names if not name.endswith((".py", ".md", ".json", ".yaml", ".dev"))}
    assert len(names) > 50
    assert sorted((page, name) for page, name in names if not _resolves(name)) == []
    assert ("docs/spec.md", "flowrec.spec.files.validate_file") in names


@pytest.mark.parametrize("fmt", sorted(TEXT_READERS))
def test_a_part_file_of_an_encoded_dataset_given_to_a_text_format_is_named_as_one(tmp_path: Path, fmt: str) -> None:
    """`flowrec data convert csv data/clicks/test/part-00000.parquet ...` (a file of the README's
    split) said to read it with the parquet format, which then refused it as an encoded dataset:
    a hint that led to a second refusal. A Parquet file that is not a dataset's keeps the hint."""
    root = _split_dataset(tmp_path)
    part = root / "test" / "part-00000.parquet"
    options = {"fields": ["a"]} if fmt == "libsvm" else {}
    with pytest.raises(DataError, match="encoded flowrec dataset") as err:
        list(TEXT_READERS[fmt](part, options, ErrorLog("fail", str(part)), set()))
    assert "parquet format" not in str(err.value)
    loose = tmp_path / "rows.parquet"
    loose.write_bytes(part.read_bytes())
    with pytest.raises(DataError, match="is a Parquet file, not .* text: read it with the parquet format"):
        list(TEXT_READERS[fmt](loose, options, ErrorLog("fail", str(loose)), set()))


def test_predict_without_format_names_a_part_file_of_an_encoded_dataset(tmp_path: Path) -> None:
    """`flowrec predict pkg/first data/clicks/test/part-00000.parquet --out s.parquet` said to give
    --format parquet, which then refused the file as an encoded dataset."""
    from flowrec.cli.predict_cmd import default_format_mismatch

    root = _split_dataset(tmp_path)
    line = default_format_mismatch(root / "test" / "part-00000.parquet", "csv")
    assert line is not None and "encoded flowrec dataset" in line and "--format parquet" not in line
    loose = tmp_path / "rows.parquet"
    loose.write_bytes(b"PAR1")
    assert "give --format parquet" in default_format_mismatch(loose, "csv")


@pytest.mark.parametrize("page, opening, name", [("docs/guide.md", "$ flowrec validate broken.yaml", "broken.yaml"),
                                                 ("docs/spec.md", "$ flowrec validate specs/", "bad.yaml")])
def test_the_validate_output_the_pages_quote_is_what_validate_prints(tmp_path: Path, monkeypatch, page: str,
                                                                      opening: str, name: str) -> None:
    """guide.md quoted `flowrec validate broken.yaml` with the module's problem before the
    feature's and at `features[3].dim` (a dense feature of the DLRM spec, which has no dim), where
    validate lists problems in the document's order, as spec.md quotes them. Both quotes are what
    validate prints for specs/dlrm_criteo.yaml with C2's dim 0 and the top MLP reading 'botom'."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = (Path(__file__).resolve().parents[2] / "specs" / "dlrm_criteo.yaml").read_text(encoding="utf-8")
    broken = spec.replace("{name: C2, type: categorical, hash_buckets: 584, dim: 16}",
                          "{name: C2, type: categorical, hash_buckets: 584, dim: 0}")
    broken = broken.replace("inputs: [interaction, bottom]", "inputs: [interaction, botom]")
    assert broken.count("dim: 0") == 1 and "botom" in broken
    (tmp_path / name).write_text(broken, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["validate", name])
    assert shown.exit_code == 2
    quoted = [line for line in _quoted_block(page, opening) if line.startswith(f"{name}: ")]
    assert len(quoted) == 2 and quoted == shown.output.strip().splitlines()


def test_the_cost_train_help_gives_for_cache_data_is_the_row_caches() -> None:
    """`flowrec train --help` said --cache-data costs '8 per sparse id ... (about 400 MB per 1.5M
    Criteo rows)', the cost before round 9's row matrix, where data.md says 4 bytes per id, 160
    bytes a Criteo row, 229 MiB per 1.5M rows: the figure is the row layout's."""
    import re

    import typer.main

    from flowrec.cli import app
    from flowrec.data.rowcache import RowLayout

    command = typer.main.get_command(app).commands["train"]
    text = next(p.help for p in command.params if "--cache-data" in getattr(p, "opts", ()))
    found = re.search(r"about ([\d,]+) MiB per 1\.5M Criteo rows, (\d+) bytes each", text)
    assert found is not None, text
    layout = RowLayout.of(13, 1, [26], [33_762_603])  # DLRM-Criteo: 13 dense, a label, 26 ids of a packed table
    assert int(found.group(2)) == layout.stride
    assert int(found.group(1).replace(",", "")) == round(1.5e6 * layout.stride / 2**20)


@pytest.mark.parametrize("command, argument", [(("data", "convert"), "source"), (("predict",), "raw")])
def test_the_help_of_the_raw_input_says_which_formats_read_a_folder(command: tuple, argument: str) -> None:
    """`flowrec data convert --help` said SOURCE is an 'Input file (folder for movielens)' and
    `flowrec predict --help` RAW 'a file ... (a folder for movielens)', where the parquet format
    reads a folder of Parquet files too (README, data.md, production.md: a Hive-partitioned table)."""
    import typer.main

    from flowrec.cli import app

    found = typer.main.get_command(app)
    for name in command:
        found = found.commands[name]
    text = next(p.help for p in found.params if p.name == argument)
    assert "movielens" in text and "a folder of them for parquet" in text, text


def test_the_help_of_eval_data_gives_the_default_of_a_run_on_synthetic_rows() -> None:
    """`flowrec eval --help` gave --data's default as the run's --eval-data or its split's test part,
    where a run on synthetic rows (the README's default job) is scored on its evaluation rows, drawn
    again from its seed (guide.md, python.md)."""
    import typer.main

    from flowrec.cli import app

    command = typer.main.get_command(app).commands["eval"]
    text = next(p.help for p in command.params if "--data" in getattr(p, "opts", ()))
    assert "--eval-data" in text and "synthetic rows" in text and "seed" in text, text


def test_every_option_of_every_command_is_on_a_page() -> None:
    """`flowrec calibrate --seconds` (the time per measured kernel, 0.01 to 10) was in no page but
    the GPU one's run log, and `flowrec --version` in none: every option a command takes is named
    on README.md or a page it links."""
    import typer.main

    from flowrec.cli import app

    root = Path(__file__).resolve().parents[2]
    text = "".join((root / page).read_text(encoding="utf-8") for page in PAGES)
    missing = []

    def walk(command, path: tuple) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, path + (name,))
        missing.extend(" ".join(("flowrec",) + path + (opt,)) for p in getattr(command, "params", ())
                       for opt in getattr(p, "opts", ()) if opt.startswith("--") and opt != "--help"
                       and opt not in text)

    walk(typer.main.get_command(app), ())
    assert missing == []


@pytest.mark.parametrize("owner, marker, says", [
    ("package", ("manifest.json", '{"format": "flowrec-model"}'), "a model package's folder"),
    ("run", ("run.json", "{}"), "a training run's folder"),
    ("stream", ("follow.json", "{}"), "a --follow stream's folder"),
])
def test_a_folder_flowrec_owns_given_as_raw_parquet_rows_is_named(tmp_path: Path, owner: str, marker: tuple,
                                                                   says: str) -> None:
    """`flowrec predict pkg/first pkg/first --format parquet` said pyarrow's "cannot read pkg/first as
    Parquet: ... 'pkg/first/encoder.json': Parquet magic bytes not found", `data convert parquet
    RUN` of a run on bound data called the run an encoded dataset; now each folder is named."""
    folder = tmp_path / owner
    folder.mkdir()
    (folder / marker[0]).write_text(marker[1], encoding="utf-8")
    (folder / "encoder.json").write_text("{}", encoding="utf-8")
    with pytest.raises(DataError, match=f"is {says}, not raw rows"):
        list(sources.read_parquet(folder, {}, ErrorLog("fail", str(folder)), set()))


def test_a_csv_file_given_as_criteo_names_the_separator_not_the_skip_option(tmp_path: Path) -> None:
    """`flowrec data convert criteo taobao.csv ...` (a CSV given the Criteo format, whose rows read
    as one field each) said 'wrong field count (1, expected 40) ... (use --on-error skip to skip
    such rows)': skipping them drops every row. It names the separator the rows hold instead."""
    raw = tmp_path / "clicks.csv"
    raw.write_text("1,2,3\n0,5,6\n", encoding="utf-8")
    with pytest.raises(DataError, match="holds ',', not this format's separator") as err:
        list(TEXT_READERS["criteo"](raw, {}, ErrorLog("fail", str(raw)), set()))
    assert "--on-error skip" not in str(err.value)
    tsv = tmp_path / "short.tsv"
    tsv.write_text("1\t2\n", encoding="utf-8")  # a short row of the format's own separator keeps the hint
    with pytest.raises(DataError, match="wrong field count .*--on-error skip"):
        list(TEXT_READERS["criteo"](tsv, {}, ErrorLog("fail", str(tsv)), set()))


def test_the_readme_and_the_guide_give_the_default_jobs_time_as_one_figure() -> None:
    """README's quickstart said the default job takes about 30 s, docs/guide.md's headline figures
    35 s: a reader could not tell which; both give the one measured figure (27 s wall: about 30 s)."""
    import re

    repo = Path(__file__).resolve().parents[2]
    readme = re.findall(r"about (\d+) s on 2 cores", (repo / "README.md").read_text(encoding="utf-8"))
    guide = re.findall(r"\| default job `flowrec train specs/dlrm_criteo\.yaml` \|[^|\d]*(\d+) s wall",
                       (repo / "docs" / "guide.md").read_text(encoding="utf-8"))
    assert len(readme) == 1 and len(guide) == 1, (readme, guide)
    assert readme == guide
