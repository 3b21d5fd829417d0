"""components/io.py's persistence path, which checkpoints, index versions, model folders and the
bench results share: atomic folders, the sha256 manifest (written last, verified on load), leftovers."""

from __future__ import annotations

import json

import pytest

from components import io


def _folder_with_manifest(root, **meta):
    with io.atomic_dir(root / "f") as tmp:
        (tmp / "a.bin").write_bytes(b"alpha" * 100)
        files = {"b.bin": io.write_file(tmp / "b.bin", b"beta")}  # hashed as written
        io.write_manifest(tmp, meta, {**files, "a.bin": io.file_entry(tmp / "a.bin")})
    return root / "f"


def test_manifest_round_trip_lists_every_file_with_sha256_and_size(tmp_path):
    f = _folder_with_manifest(tmp_path, kind="demo")
    meta = io.verify_manifest(f, required=("a.bin", "b.bin"))
    assert meta["kind"] == "demo" and meta["files"]["b.bin"]["bytes"] == 4 and len(meta["files"]["a.bin"]["sha256"]) == 64
    assert meta == json.loads((f / io.MANIFEST).read_text())
    assert io.write_manifest(f, {})["files"] == meta["files"]  # hashed from disk when not given
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((io.TMP_PREFIX, io.OLD_PREFIX))]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_file_fails_verification(tmp_path, damage):
    f = _folder_with_manifest(tmp_path)
    victim = f / "a.bin"
    raw = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(raw[:10])
    elif damage == "flip":
        victim.write_bytes(raw[:-1] + b"X")  # same size: only the sha256 tells
    else:
        victim.unlink()
    with pytest.raises(io.ManifestError, match="missing" if damage == "delete" else "a.bin does not match its sha256"):
        io.verify_manifest(f)
    if damage != "delete":  # the bytes a caller already read are what is checked
        io.verify_manifest(f, blobs={"a.bin": raw})


def test_a_manifest_is_refused_when_missing_malformed_or_pointing_outside(tmp_path):
    f = _folder_with_manifest(tmp_path)
    meta = io.read_manifest(f)
    with pytest.raises(io.ManifestError, match="lists no c.bin"):
        io.verify_manifest(f, required=("c.bin",))
    for bad in ({"../x": {"sha256": "0" * 64, "bytes": 0}}, {"a.bin": "0" * 64}):
        with pytest.raises(io.ManifestError, match=r"outside|not \{sha256, bytes\}"):
            io.verify_manifest(f, {**meta, "files": bad})
    (f / io.MANIFEST).write_text("{not json")
    with pytest.raises(io.ManifestError, match="not valid JSON"):
        io.read_manifest(f)
    (f / io.MANIFEST).unlink()
    with pytest.raises(io.ManifestError, match="no meta.json"):
        io.verify_manifest(f)


def test_commit_dir_replaces_or_refuses_and_an_error_leaves_the_old_folder(tmp_path):
    target = tmp_path / "t"
    with io.atomic_dir(target) as tmp:
        (tmp / "v").write_text("1")
    with io.atomic_dir(target) as tmp:
        (tmp / "v").write_text("2")
    assert (target / "v").read_text() == "2"
    with pytest.raises(FileExistsError):
        with io.atomic_dir(target, replace=False) as tmp:
            (tmp / "v").write_text("3")
    with pytest.raises(RuntimeError):
        with io.atomic_dir(target) as tmp:
            (tmp / "v").write_text("4")
            raise RuntimeError("killed mid-write")
    assert (target / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no temp or old folder left


def test_fixed_temp_name_and_leftovers(tmp_path):
    target = tmp_path / "v0002"
    tmp = io.begin_dir(target, unique=False)
    assert tmp == io.temp_sibling(target) == tmp_path / ".tmp-v0002"
    (tmp / "half").write_bytes(b"x")  # a write killed before its commit
    (tmp_path / ".old-v0001-dead").mkdir()
    (tmp_path / "keep").mkdir()
    assert [p.name for p in io.remove_leftovers(tmp_path)] == [".old-v0001-dead", ".tmp-v0002"]
    io.remove_dir(tmp_path / "keep")
    assert list(tmp_path.iterdir()) == []


def test_write_json_atomic_keeps_the_order_on_request(tmp_path):
    out = io.write_json_atomic(tmp_path / "r" / "x.json", {"b": 1, "a": 2}, sort_keys=False)
    assert list(json.loads(out.read_text())) == ["b", "a"]
    assert list(json.loads(io.write_json_atomic(out, {"b": 1, "a": 2}).read_text())) == ["a", "b"]
