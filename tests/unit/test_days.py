"""Day partitions: ordered by name or by a date column that conversion records; the distinct raw
ids of managed tables per day (and the new ones) equal a plain-Python count over the raw files."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.days import DayOrder, day_key, day_partitions, inspect_days, parse_order
from flowrec.data.layout import DataError
from flowrec.data.rawstats import read_stats

SPEC = Path(__file__).parents[1].joinpath("integration", "test_managed_runs.py").read_text() \
    .split('SPEC = """')[1].split('"""')[0]
DATES = {"a": 3000, "b": 1000, "c": 2000}  # first date of each day: date order b, c, a (not name order)
runner = CliRunner()


def write_day(path: Path, rng: np.random.Generator, start: int, rows: int = 60) -> list[dict]:
    users = [f"u{k}" for k in rng.zipf(1.3, rows) % 90]
    lines = []
    for i, user in enumerate(users):
        friends = "^".join(f"u{k}" for k in rng.integers(0, 120, rng.integers(0, 4)))
        lines.append({"d1": float(rng.random() * 5), "user": user if rng.random() > 0.1 else "",
                      "friends": friends, "item": f"i{rng.integers(0, 50)}", "label": int(rng.random() < 0.3),
                      "ts": start + int(rng.integers(0, 900))})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)
    return lines


def raw_ids(lines: list[dict]) -> set[str]:
    return {x["user"] for x in lines if x["user"]} | {v for x in lines for v in x["friends"].split("^") if v}


@pytest.fixture
def days(tmp_path: Path) -> tuple[Path, Path, dict[str, list[dict]]]:
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: raw, options: {date_column: ts}}\n")
    rng = np.random.default_rng()
    folder, raw = tmp_path / "days", {}
    for name, start in DATES.items():
        raw[name] = write_day(tmp_path / f"{name}.csv", rng, start)
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{name}.csv"), str(folder / name),
                                   "--spec", str(spec), "-q"])
        assert made.exit_code == 0, made.output
    return spec, folder, raw


def test_conversion_records_dates_and_distinct_managed_ids(days):
    _, folder, raw = days
    for name, lines in raw.items():
        stats = read_stats(folder / name)
        ts = [x["ts"] for x in lines]
        assert stats["dates"] == {"column": "ts", "min": float(min(ts)), "max": float(max(ts))}
        managed = stats["managed"]["users"]
        assert managed["features"] == ["user", "friends"]
        assert managed["distinct_ids"] == len(raw_ids(lines))
        looked = sum(1 for x in lines if x["user"]) + sum(len([v for v in x["friends"].split("^") if v]) for x in lines)
        assert managed["lookups"] == looked


def test_days_in_order_of_name_or_date(days):
    _, folder, _ = days
    assert [d.name for d in day_partitions(folder, parse_order("name"))] == ["a", "b", "c"]
    assert [d.name for d in day_partitions(folder, parse_order("date:ts"))] == ["b", "c", "a"]
    assert day_key(folder / "b", DayOrder("ts"))[0] >= DATES["b"]
    with pytest.raises(DataError, match="date_column: other"):
        day_partitions(folder, DayOrder("other"))


@pytest.mark.parametrize("text", ["date", "date:", "size", "date: "])
def test_bad_orders_are_refused(text):
    with pytest.raises(ValueError, match="day order"):
        parse_order(text)


def test_inspect_days_counts_distinct_and_new_ids_as_sets_do(days):
    _, folder, raw = days
    got = inspect_days(folder, DayOrder("ts"))
    seen: set[str] = set()
    assert [x["day"] for x in got] == ["b", "c", "a"]
    for entry in got:
        ids = raw_ids(raw[entry["day"]])
        assert entry["managed"]["users"] == {"distinct_ids": len(ids), "new_ids": len(ids - seen)}
        assert entry["rows"] == len(raw[entry["day"]])
        seen |= ids
    shown = runner.invoke(app, ["data", "inspect", str(folder), "--follow-order", "date:ts", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output) == {"order": "date:ts", "days": got}
    table = runner.invoke(app, ["data", "inspect", str(folder)]).output.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["a", "b", "c"]
    one = runner.invoke(app, ["data", "inspect", str(folder / "b")])
    ids = raw_ids(raw["b"])
    assert f"managed table users: {len(ids):,} distinct raw ids" in one.output


def test_inspect_days_counts_the_managed_ids_of_synthetic_days(tmp_path: Path):
    """Days made with `flowrec data synth` (the quickest way to try `--follow`, docs/managed.md)
    showed only their rows in `flowrec data inspect DAYS`, no managed table's distinct and new ids."""
    import pyarrow.parquet as pq

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    folder = tmp_path / "days"
    for seed, day in ((1, "d1"), (2, "d2")):
        made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "300", "--out", str(folder / day),
                                   "--seed", str(seed)])
        assert made.exit_code == 0, made.output
    got = inspect_days(folder, DayOrder(None))
    seen: set[int] = set()
    for entry in got:
        table = pq.read_table(folder / entry["day"])
        ids = {v for v in table.column("user").to_pylist() if v != 0}
        ids |= {v for row in table.column("friends").to_pylist() for v in row if v != 0}
        assert entry["managed"]["users"] == {"distinct_ids": len(ids), "new_ids": len(ids - seen)}
        seen |= ids
    shown = runner.invoke(app, ["data", "inspect", str(folder)])
    assert "users distinct ids" in shown.output and "users new ids" in shown.output


@pytest.mark.parametrize("order", ["ts", "d1", None])  # recorded dates, a stored column, by name
def test_inspect_days_dates_each_day_once_and_reads_its_meta_once(days, monkeypatch, order):
    import flowrec.data.days as days_module
    _, folder, _ = days
    want = inspect_days(folder, DayOrder(order))
    calls: dict[str, list[str]] = {"meta": [], "dated": []}
    read_meta, dated = days_module.read_meta, days_module._dated

    def counted_meta(path):
        calls["meta"].append(Path(path).name)
        return read_meta(path)

    def counted_dated(day, *args):
        calls["dated"].append(day.name)
        return dated(day, *args)

    monkeypatch.setattr(days_module, "read_meta", counted_meta)
    monkeypatch.setattr(days_module, "_dated", counted_dated)
    assert inspect_days(folder, DayOrder(order)) == want
    assert sorted(calls["meta"]) == ["a", "b", "c"]
    assert sorted(calls["dated"]) == ([] if order is None else ["a", "b", "c"])
    assert [x["day"] for x in want] == (["a", "b", "c"] if order is None else
                                        sorted("abc", key=lambda d: min(x["d1" if order == "d1" else "ts"]
                                                                        for x in days[2][d])))


def test_follow_order_needs_follow_and_a_known_form(days, tmp_path: Path):
    spec, folder, _ = days
    bad = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(tmp_path / "s"),
                              "--follow-order", "size"])
    assert bad.exit_code == 2 and "--follow-order" in bad.output
    alone = runner.invoke(app, ["train", str(spec), "--data", str(folder / "a"), "--out", str(tmp_path / "t"),
                                "--follow-order", "date:ts"])
    assert alone.exit_code == 2 and "give --follow" in alone.output


@pytest.mark.parametrize("flags", [["--follow-wait", "5"], ["--follow-once"], ["--follow-export"],
                                   ["--follow-once", "--follow-export"]])
def test_follow_flags_without_follow_are_refused_not_ignored(days, tmp_path: Path, flags: list[str]):
    """--follow-wait, --follow-once and --follow-export without --follow trained the one dataset as if
    they were not given, without a word (--follow-order alone was refused already)."""
    spec, folder, _ = days
    alone = runner.invoke(app, ["train", str(spec), "--data", str(folder / "a"), "--out", str(tmp_path / "t"),
                                *flags])
    assert alone.exit_code == 2 and "give --follow DAYS" in alone.output, alone.output
    assert all(flag in alone.output for flag in flags if flag.startswith("--"))
    assert not (tmp_path / "t").exists()


def test_a_day_converted_with_a_test_split_is_refused_not_skipped(days, tmp_path: Path):
    """A day converted with a train/test split (`--test-fraction`, or the spec's test_fraction, as
    specs/managed_movielens.yaml has) holds no _flowrec.json of its own: --follow and `data inspect
    DAYS` skipped it without a word, so the stream never trained it."""
    spec, folder, _ = days
    write_day(tmp_path / "d.csv", np.random.default_rng(), 4000)
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "d.csv"), str(folder / "d"), "--spec",
                               str(spec), "--test-fraction", "0.3", "-q"])
    assert made.exit_code == 0, made.output
    with pytest.raises(DataError, match=r"day d under .* split into train/ and test/.*--test-fraction 0"):
        day_partitions(folder, DayOrder(None))
    shown = runner.invoke(app, ["data", "inspect", str(folder)])
    assert shown.exit_code == 2 and "day d under" in shown.output and "Traceback" not in shown.output
    again = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "d.csv"), str(folder / "d"), "--spec",
                                str(spec), "--test-fraction", "0", "--overwrite", "-q"])
    assert again.exit_code == 0, again.output
    assert [d.name for d in day_partitions(folder, DayOrder(None))] == ["a", "b", "c", "d"]


def test_one_day_given_as_the_days_is_refused_not_waited_on(days, tmp_path: Path):
    """`--follow days/a` (one day's folder, not the folder of days) found no day partition under
    it: with --follow-wait it waited the whole time for days that would never land there, then
    stopped saying only that there was no new day."""
    spec, folder, _ = days
    with pytest.raises(DataError, match=r"is one dataset \(it holds _flowrec.json\), not a folder of day partitions"):
        day_partitions(folder / "a", DayOrder(None))
    refused = runner.invoke(app, ["train", str(spec), "--follow", str(folder / "a"), "--out", str(tmp_path / "s"),
                                  "--quiet"])
    assert refused.exit_code == 2 and f"{folder / 'a'} is one dataset" in refused.output
    assert not (tmp_path / "s").exists()


def test_a_folder_of_days_given_as_one_dataset_names_its_days(days, tmp_path: Path):
    """`train --data DAYS` (or eval, profile) of the folder of converted days said "DAYS is not a
    flowrec dataset (no _flowrec.json); convert it first with `flowrec data convert`", of days
    just converted."""
    from flowrec.data.layout import read_meta

    spec, folder, _ = days
    with pytest.raises(DataError, match=r"days holds datasets \(a, b, c\) and is not one: give one of them, or, "
                                        r"for day partitions, train on each in turn with `flowrec train SPEC --follow"):
        read_meta(folder)
    refused = runner.invoke(app, ["train", str(spec), "--data", str(folder), "--out", str(tmp_path / "run"), "--quiet"])
    assert refused.exit_code == 2 and "holds datasets (a, b, c) and is not one" in refused.output
    assert "convert it first" not in refused.output and not (tmp_path / "run").exists()


def test_a_runs_split_data_is_no_day_converted_with_a_split(days, tmp_path: Path):
    """`data inspect RUN` of a run on bound data (its data/ a split dataset) said 'day data under
    RUN is one dataset split into train/ and test/ ... convert it again with --test-fraction 0':
    a run folder holds no days."""
    spec, _, _ = days
    run = tmp_path / "run"
    write_day(tmp_path / "d.csv", np.random.default_rng(), 4000)
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "d.csv"), str(run / "data"), "--spec",
                               str(spec), "--test-fraction", "0.3", "-q"])
    assert made.exit_code == 0, made.output
    (run / "run.json").write_text("{}\n")  # as a run on bound data holds it
    with pytest.raises(DataError, match="a training run's folder, not a folder of day partitions"):
        day_partitions(run, DayOrder(None))
    shown = runner.invoke(app, ["data", "inspect", str(run)])
    assert shown.exit_code == 2 and f"a training run's folder, not a dataset: inspect the data it trained on, {run / 'data'}" \
        in shown.output
    assert "split into train/ and test/" not in shown.output


def test_a_runs_unsplit_data_is_no_day(days, tmp_path: Path):
    """`data inspect RUN` of a run on bound data not split (its data/ one dataset) listed the run
    folder as a folder of days, one day 'data', exit 0, where data.md says a run folder is one line
    naming the dataset it trained on."""
    spec, _, _ = days
    run = tmp_path / "run"
    write_day(tmp_path / "d.csv", np.random.default_rng(), 400)
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "d.csv"), str(run / "data"), "--spec",
                               str(spec), "-q"])
    assert made.exit_code == 0, made.output
    (run / "run.json").write_text("{}\n")  # as a run on bound data holds it
    shown = runner.invoke(app, ["data", "inspect", str(run)])
    assert shown.exit_code == 2 and f"a training run's folder, not a dataset: inspect the data it trained on, {run / 'data'}" \
        in shown.output, shown.output
    assert len(shown.output.strip().splitlines()) == 1


def test_inspect_counts_a_managed_columns_distinct_raw_ids_without_the_missing_value(days):
    """`unique` of a managed table's one-id column counted the missing value (0) as one more raw id
    (29 for 28 distinct ids); docs/managed.md: it shows the distinct raw ids."""
    from flowrec.data.inspect import inspect_dataset

    _, folder, raw = days
    missing = 0
    for name, lines in raw.items():
        column = next(c for c in inspect_dataset(folder / name)["columns"] if c["name"] == "user")
        assert column["unique"] == len({x["user"] for x in lines if x["user"]})
        assert column["missing"] == sum(1 for x in lines if not x["user"])
        missing += column["missing"]
    assert missing > 0  # some rows miss their user (one in ten)


def _named_days(folder: Path, names: list[str]) -> Path:
    """Day folders ordered by name only (a `_flowrec.json` is all `day_partitions` looks at then)."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "_flowrec.json").write_text("{}")
    return folder


def test_day_names_order_their_numbers_as_numbers(tmp_path: Path):
    """Days sorted as text: day10 trained before day2 (and day_10 of Criteo's day_0..day_23 before day_2)."""
    folder = _named_days(tmp_path / "days", ["day10", "day2", "day1", "day_0", "2026-11-10", "2026-11-02"])
    assert [d.name for d in day_partitions(folder, DayOrder())] == [
        "2026-11-02", "2026-11-10", "day1", "day2", "day10", "day_0"]
    assert [d.name for d in day_partitions(folder, DayOrder(text=True))] == [
        "2026-11-02", "2026-11-10", "day1", "day10", "day2", "day_0"]
    assert day_key(folder / "day2", DayOrder()) < day_key(folder / "day10", DayOrder())


@dataclass
class _Request:  # what `follow` reads of a RunRequest
    spec_path: Path
    out: Path | None
    resume: Path | None = None
    overwrite: bool = False
    init_from: Path | None = None
    given: dict = field(default_factory=dict)
    continue_command: str | None = None
    json_lines: bool = False


def _stream(tmp_path: Path, monkeypatch, landed: list[str]) -> tuple[Path, Path, list[tuple[str, str | None]]]:
    """Days named `landed`, the stream's folder, and the list `_follow` records its days' training in
    (the days are no datasets: their progressive validation and completeness check are left out)."""
    from flowrec.cli import follow as follow_mod

    monkeypatch.setattr(follow_mod, "_progressive", lambda *args: None)
    monkeypatch.setattr(follow_mod, "_unready", lambda day: None)
    return _named_days(tmp_path / "days", landed), tmp_path / "stream", []


def _follow(days: Path, stream: Path, trained: list) -> None:
    """`train --follow DAYS --out STREAM` whose days train instantly: each appends (day, the day it
    starts from, or 'resumed') to `trained`."""
    from flowrec.cli.follow import follow

    def train(request) -> None:
        folder = request.out or request.resume
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "checkpoint.pt").write_text("")
        trained.append((folder.name, "resumed" if request.resume else request.init_from and request.init_from.name))

    follow(_Request(Path("spec.yaml"), stream), days, 0.0, False, train)


def test_a_stream_trains_day2_before_day10_and_records_it(tmp_path: Path, monkeypatch):
    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day10", "day2"])
    _follow(days, stream, trained)
    assert trained == [("day1", None), ("day2", "day1"), ("day10", "day2")]
    assert json.loads((stream / "follow.json").read_text())["days"] == ["day1", "day2", "day10"]
    _named_days(days, ["day11", "day3"])  # day3 lands after day10 trained: refused, in natural order
    with pytest.raises(typer.Exit):
        _follow(days, stream, trained)
    assert trained[3:] == []


def test_a_stream_begun_with_names_as_text_keeps_that_order(tmp_path: Path, monkeypatch):
    """A stream whose follow.json was written when names sorted as text (no `names`) trained day10
    before day2: in natural order day2 would land 'before the last day trained' and be refused."""
    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day10", "day2", "day3"])
    (stream / "days").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["day1", "day10"], "order": "name"}))
    _follow(days, stream, trained)
    assert trained == [("day2", "day10"), ("day3", "day2")]
    record = json.loads((stream / "follow.json").read_text())
    assert record["days"] == ["day1", "day10", "day2", "day3"] and record["names"] == "text"


def test_a_first_day_cut_short_under_names_as_text_is_resumed_first(tmp_path: Path, monkeypatch):
    """Killed in its first day (day10, first as text) before follow.json was written: day9, first in
    natural order, would train from nothing, then day10's checkpoint (trained from nothing too)."""
    days, stream, trained = _stream(tmp_path, monkeypatch, ["day10", "day9"])
    (stream / "days" / "day10").mkdir(parents=True)
    (stream / "days" / "day10" / "checkpoint.pt").write_text("")
    _follow(days, stream, trained)
    assert trained == [("day10", "resumed"), ("day9", "day10")]
    assert json.loads((stream / "follow.json").read_text())["names"] == "text"


def test_a_day_landing_before_the_day_under_way_is_refused(tmp_path: Path, monkeypatch, capsys):
    """A day that landed (while the stream was down) before the day whose training a crash cut short
    trained first, then the cut day resumed from a checkpoint that started from another day."""
    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day2", "day3"])
    (stream / "days" / "day3").mkdir(parents=True)
    (stream / "days" / "day3" / "checkpoint.pt").write_text("")
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name", "names": "natural"}))
    with pytest.raises(typer.Exit):
        _follow(days, stream, trained)
    assert trained == []
    assert "day day2 landed before day day3, whose training" in capsys.readouterr().err


def test_a_stream_reads_its_record_once_and_sorts_its_days_once(tmp_path: Path, monkeypatch):
    """`--follow` read follow.json four times before its first day (the check, the names' order
    twice, the loop) and once more per day; `day_partitions` sorted the days' names twice."""
    import flowrec.data.days as days_mod
    import flowrec.spec.json_doc as json_doc

    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day2", "day10"])
    (stream / "days" / "day1").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name", "names": "natural"}))
    reads, keyed = [], []
    read = json_doc.read_json_document
    monkeypatch.setattr(json_doc, "read_json_document",
                        lambda path, *a, **k: reads.append(Path(path).name) or read(path, *a, **k))
    _follow(days, stream, trained)
    assert trained == [("day2", "day1"), ("day10", "day2")]
    assert reads.count("follow.json") == 1
    key = days_mod.name_key
    monkeypatch.setattr(days_mod, "name_key", lambda name: keyed.append(name) or key(name))
    assert [d.name for d in day_partitions(days, DayOrder())] == ["day1", "day2", "day10"]
    assert sorted(keyed) == ["day1", "day10", "day2"]  # each name keyed once: one sort


def test_inspect_days_of_a_stream_lists_them_in_the_order_it_takes_them(days, tmp_path: Path):
    """`data inspect DAYS` listed day2 before day10 for a stream that keeps text order (begun before
    names compared naturally: its follow.json records no `names`), which trains day10 first."""
    _, folder, _ = days
    for old, new in (("a", "day1"), ("b", "day10"), ("c", "day2")):
        (folder / old).rename(folder / new)
    stream = tmp_path / "stream"
    (stream / "days" / "day1").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name"}))

    def listed(*options: str) -> list[str]:
        shown = runner.invoke(app, ["data", "inspect", str(folder), *options])
        assert shown.exit_code == 0, shown.output
        return [line.split()[0] for line in shown.output.splitlines()[1:]]

    assert listed() == ["day1", "day2", "day10"]
    assert listed("--stream", str(stream)) == ["day1", "day10", "day2"]
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name", "names": "natural"}))
    assert listed("--stream", str(stream)) == ["day1", "day2", "day10"]
    (stream / "follow.json").write_text(json.dumps({"days": ["day10"], "order": "date:ts", "names": "natural"}))
    assert listed("--stream", str(stream)) == ["day10", "day2", "day1"]  # its recorded order: by date
    other = runner.invoke(app, ["data", "inspect", str(folder), "--stream", str(tmp_path / "nowhere")])
    assert other.exit_code == 2 and "not a --follow stream's folder" in other.output


def test_inspect_days_refuses_a_day_whose_parts_do_not_match_its_meta(days):
    """A day holding a stray part file (another copy landed in it) was listed with the rows its
    _flowrec.json records, as if it were whole, while `train --follow` refuses it as not complete
    and `data inspect DAY` fails."""
    _, folder, _ = days
    part = sorted((folder / "b").glob("*.parquet"))[0]
    (folder / "b" / "part-99999.parquet").write_bytes(part.read_bytes())
    shown = runner.invoke(app, ["data", "inspect", str(folder)])
    assert shown.exit_code == 2 and str(folder / "b") in shown.output, shown.output
    with pytest.raises(DataError):
        inspect_days(folder, DayOrder())


def test_inspect_of_a_stream_folder_names_the_days_it_follows(days, tmp_path: Path):
    """`data inspect RUN` of a --follow stream folder said it is neither a dataset nor a folder of
    days; its days are runs: it now names the folder of days the stream follows and --stream."""
    _, folder, _ = days
    stream = tmp_path / "stream"
    (stream / "days" / "b").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["b"], "order": "name", "names": "natural"}))
    (stream / "days" / "b" / "run.json").write_text(json.dumps({"data": str(folder / "b")}))  # damaged

    def said() -> str:
        shown = runner.invoke(app, ["data", "inspect", str(stream)])
        assert shown.exit_code == 2, shown.output
        return " ".join(shown.output.split())

    assert f"flowrec data inspect DAYS --stream {stream}" in said()
    settings = {  # the run file as a day's run writes it"cache": None, "cache_data": "auto", "checkpoint_every": 0, "checkpoint_full_every": 0,
                "compile": False, "dask": None, "data": str(folder / "b"), "device": "auto", "device_budget": None,
                "epochs": 1, "eval_data": None, "eval_every": 0, "fresh_optimizer": False, "init_from": None,
                "interleave": True, "max_steps": None, "nan_policy": "stop", "plan": None, "profile": None,
                "rows": 400000, "seed": None, "target": None, "train_rows": 60}
    (stream / "days" / "b" / "run.json").write_text(json.dumps(settings))
    assert f"flowrec data inspect {folder} --stream {stream}" in said()


def test_a_stream_folder_given_as_a_dataset_is_named_as_one(tmp_path: Path):
    """`flowrec train SPEC --data runs/stream` (eval --data, data profile alike) of a --follow
    stream's folder said it 'is not a flowrec dataset (no _flowrec.json); convert it first with
    `flowrec data convert`', where its days are runs and the data is the days it follows."""
    from flowrec.data.layout import read_meta

    stream = tmp_path / "stream"
    (stream / "days" / "day1").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name", "names": "natural"}))
    with pytest.raises(DataError, match="is a --follow stream folder, not a dataset") as err:
        read_meta(stream)
    assert "convert it first" not in str(err.value) and f"--stream {stream}" in str(err.value)


@pytest.mark.parametrize("owned", ["run", "stream"])
def test_follow_of_a_run_or_stream_folder_is_refused_not_trained(days, tmp_path: Path, owned: str):
    """`flowrec train SPEC --follow RUN` of a run on the spec's bound data trained its encoding,
    RUN/data, as a day 'data' of a new stream; a stream's own folder given as the days said 'no new
    day partition', exit 0. A run, package or stream folder is never a folder of days: one line."""
    spec, _, _ = days
    folder = tmp_path / owned
    write_day(tmp_path / "d.csv", np.random.default_rng(), 400)
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "d.csv"), str(folder / "data"), "--spec",
                               str(spec), "-q"])
    assert made.exit_code == 0, made.output
    (folder / ("run.json" if owned == "run" else "follow.json")).write_text("{}\n")
    out = tmp_path / "out"
    shown = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "-q"])
    assert shown.exit_code == 2 and "not a folder of day partitions" in shown.output, shown.output
    assert not (out / "days").exists()


def test_inspect_days_names_each_entry_it_skips_in_one_line(days):
    """`data inspect DAYS` left out an empty day folder, a link to nothing and a link loop among the
    days without a word, as if the days were all there; it names each in one warning line and lists
    the other days with the exit code as before."""
    _, folder, raw = days
    (folder / "d_empty").mkdir()
    (folder / "d_gone").symlink_to(folder / "no_such_day")
    (folder / "d_loop").symlink_to(folder / "d_loop2")
    (folder / "d_loop2").symlink_to(folder / "d_loop")
    (folder / ".hidden").mkdir()  # a writer's own: skipped by design, unsaid
    shown = runner.invoke(app, ["data", "inspect", str(folder)])
    assert shown.exit_code == 0 and "Traceback" not in shown.output, shown.output
    said = [line for line in shown.output.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and "skipped 4 entries" in said[0], shown.output
    for why in ("d_empty (an empty folder)", "d_gone (a link to", "d_loop (a link loop)", "d_loop2 (a link loop)"):
        assert why in said[0], said
    assert ".hidden" not in said[0]
    table = [line.split()[0] for line in shown.output.splitlines() if not line.startswith("warning:")]
    assert table[1:] == sorted(raw)
    for name in ("d_empty", "d_gone", "d_loop", "d_loop2"):
        (folder / name).unlink() if (folder / name).is_symlink() else (folder / name).rmdir()
    shown = runner.invoke(app, ["data", "inspect", str(folder)])
    assert shown.exit_code == 0 and "warning" not in shown.output, shown.output


def test_follow_names_each_entry_it_skips_once_and_trains_the_days(tmp_path: Path, monkeypatch, capsys):
    """`train --follow DAYS` skipped an empty day folder, one without _flowrec.json (still being
    written), a link to nothing, a link loop and a stray file without a word, where `data inspect
    DAYS` names them: each is named once in a warning line (not at every look of --follow-wait),
    the day still being written once, and the good days train, that day too once it lands."""
    from types import SimpleNamespace

    from flowrec.cli import follow as follow_mod

    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day2"])
    (days / "d_empty").mkdir()
    (days / "d_gone").symlink_to(days / "no_such_day")
    (days / "d_loop").symlink_to(days / "d_loop2")
    (days / "d_loop2").symlink_to(days / "d_loop")
    (days / "stray.csv").write_text("a,b\n1,2\n")
    (days / ".hidden").mkdir()  # a writer's own: skipped by design, unsaid
    (days / "_tmp").mkdir()
    (days / "day3").mkdir()
    (days / "day3" / "part-0.parquet").write_bytes(np.random.default_rng().bytes(64))  # being written
    now, looks = [0.0], []

    def sleep(seconds: float) -> None:  # a clock of its own: every look is one poll, no real waiting
        looks.append(seconds)
        now[0] += follow_mod.POLL_S
        if len(looks) == 4:  # day3's conversion ends while the stream waits
            (days / "day3" / "_flowrec.json").write_text("{}")

    monkeypatch.setattr(follow_mod, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    follow_mod.follow(_Request(Path("spec.yaml"), stream), days, 10 * follow_mod.POLL_S, False,
                      lambda request: trained.append(request.out.name) or request.out.mkdir(parents=True))
    assert trained == ["day1", "day2", "day3"]
    assert len(looks) > 10  # it looked again and again
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    for name, why in (("d_empty", "an empty folder"), ("d_gone", "a link to"), ("d_loop", "a link loop"),
                      ("d_loop2", "a link loop"), ("stray.csv", "a file"),
                      ("day3", "a folder without _flowrec.json: not converted, or still being written")):
        named = [line.split(f" {name} (")[1] for line in said if f" {name} (" in line]
        assert len(named) == 1 and named[0].startswith(why), (name, said)
    assert len(said) == 1 and "skipped 6 entries" in said[0], said
    assert ".hidden" not in said[0] and "_tmp" not in said[0]


def test_follow_lists_the_days_folder_once_a_look(tmp_path: Path, monkeypatch, capsys):
    """Each look of `--follow` for a new day listed DAYS three times (the days that landed, twice,
    and the entries to name as skipped): once a look is enough, and the days still train and the
    skipped entries are still named."""
    from types import SimpleNamespace

    from flowrec.cli import follow as follow_mod

    rng = np.random.default_rng()
    days, stream, trained = _stream(tmp_path, monkeypatch, ["day1", "day2"])
    (stream / "days" / "day1").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["day1"], "order": "name", "names": "natural"}))
    stray = f"stray{rng.integers(1000)}.csv"
    (days / stray).write_text("a,b\n1,2\n")
    polls = int(rng.integers(3, 9))
    now, looks, listed = [0.0], [0], []
    iterdir = Path.iterdir

    def counted(self: Path):
        if self == days:
            listed.append(self)
        return iterdir(self)

    def sleep(seconds: float) -> None:  # every wait ends a look
        looks[0] += 1
        now[0] += follow_mod.POLL_S

    monkeypatch.setattr(Path, "iterdir", counted)
    monkeypatch.setattr(follow_mod, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    follow_mod.follow(_Request(Path("spec.yaml"), stream), days, polls * follow_mod.POLL_S, False,
                      lambda request: trained.append(request.out.name) or request.out.mkdir(parents=True))
    assert trained == ["day2"]
    looks_made = looks[0] + 2  # the look that found day2, the waits' looks, the last look that gave up
    assert looks[0] >= polls - 1 and len(listed) == looks_made, (looks[0], len(listed))
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(said) == 1 and f"{stray} (a file" in said[0], said
