"""A model package's files are each read once to check their digests (`verify_files`), and every
listed file is checked in that one pass, before any is read: a file needed later (vocabularies,
retrieval items, managed maps) need only be listed (`require_listed`)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.serving import package
from flowrec.serving.predict import load_model


def _folder(tmp_path: Path) -> tuple[Path, dict]:
    folder = tmp_path / "pkg"
    (folder / "vocab").mkdir(parents=True)
    (folder / "model.pt2").write_bytes(bytes(range(256)) * 64)
    (folder / "vocab" / "user.json").write_text('["a", "b"]')
    (folder / "spec.json").write_text("{}")
    return folder, {"files": package.file_digests(folder)}


def _counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    reads: Counter = Counter()
    plain = package._sha256
    monkeypatch.setattr(package, "_sha256", lambda path: (reads.update([Path(path).name]), plain(path))[1])
    return reads


def test_every_listed_file_is_checked_once_in_one_pass(tmp_path: Path, monkeypatch) -> None:
    folder, manifest = _folder(tmp_path)
    reads = _counted(monkeypatch)
    package.verify_files(folder, manifest, ["model.pt2"])
    assert reads == Counter({"model.pt2": 1, "user.json": 1, "spec.json": 1})
    assert package.require_listed(folder, manifest, ["vocab/user.json"]) == manifest["files"]
    assert sum(reads.values()) == 3  # naming a file needed later reads nothing
    with pytest.raises(ValueError, match="not among the files its manifest records"):
        package.require_listed(folder, manifest, ["vocab/item.json"])
    with pytest.raises(ValueError, match="records no file digests"):
        package.require_listed(folder, {"files": ["model.pt2"]}, [])


def test_a_changed_file_needed_later_is_refused_in_the_first_pass(tmp_path: Path) -> None:
    folder, manifest = _folder(tmp_path)
    (folder / "vocab" / "user.json").write_text('["a", "c"]')  # not among `needed` of the first call
    with pytest.raises(ValueError, match="does not match the digest"):
        package.verify_files(folder, manifest, ["model.pt2"])


def test_loading_a_package_reads_each_file_once_for_its_digest(tmp_path: Path, monkeypatch) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text("""
name: tiny
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user_id, type: categorical, hash_buckets: 300, dim: 8}
modules:
  - {name: deep, kind: mlp, inputs: ["@dense", user_id], layers: [8]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
training: {batch_size: 64, eval_every: 0}
""")
    flowrec.train(spec, out=tmp_path / "run", rows=600, max_steps=2)
    exported = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    listed = package.read_manifest(tmp_path / "pkg")["files"]
    reads = _counted(monkeypatch)
    load_model(tmp_path / "pkg")
    assert set(reads) == {Path(name).name for name in listed} and "model.pt2" in reads
    assert set(reads.values()) == {1}  # model.pt2 (the tables) was hashed three times before


@pytest.mark.parametrize("version", ["2", True, 2.0, None])
def test_a_record_whose_version_is_not_an_integer_says_so(tmp_path: Path, version) -> None:
    """A manifest.json (or _flowrec.json, device profile, checkpoint) with "version": "2" said
    "package format version '2' (this flowrec reads version 2)", which reads as a contradiction;
    now the line says the version must be an integer (or is missing)."""
    import json

    from flowrec.data.layout import DataError, DatasetMeta
    from flowrec.planner.calibration import ProfileError, read_profile

    folder = tmp_path / "pkg"
    folder.mkdir()
    doc = {"format": "flowrec-model", "files": {}} | ({} if version is None else {"version": version})
    (folder / "manifest.json").write_text(json.dumps(doc))
    words = "is missing" if version is None else "must be an integer"
    with pytest.raises(ValueError, match=f"manifest.json: package format version {words}") as caught:
        package.read_manifest(folder)
    assert "reads versions 2, 3" in str(caught.value) and "version '2' (" not in str(caught.value)
    meta = {"format": "flowrec-dataset", "spec": "s", "data_hash": "h", "rows": 1, "labels": []}
    with pytest.raises(DataError, match=f"dataset metadata version {words}"):
        DatasetMeta.from_json(json.dumps(meta | ({} if version is None else {"version": version})))
    profile = tmp_path / "device.json"
    profile.write_text(json.dumps({"format": "flowrec-device-profile", "version": version}))
    with pytest.raises(ProfileError, match=f"device profile version {words}"):
        read_profile(profile)
    from flowrec.planner.manager import load_profile

    access = tmp_path / "access.json"
    access.write_text(json.dumps({"format": "flowrec-access-profile"} | ({} if version is None else {"version": version})))
    with pytest.raises(ValueError, match=f"access profile version {words}"):
        load_profile(access)
    with pytest.raises(ValueError, match="missing required key 'flowrec_version'"):  # past the version
        package.read_manifest(_with_version(folder, 2))


def _with_version(folder: Path, version: int) -> Path:
    import json

    path = folder / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"version": version}))
    return folder
