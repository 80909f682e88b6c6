"""The bundle of ``fastverify collect`` (:mod:`fastverify.bundle`): a round trip, and every bad
input refused with one ``UserError`` line naming the file. Hostile archives are built here with
the standard library's ``tarfile``, independently of the writer."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import msgspec
import pytest

from fastverify.bundle import (
    ARCNAMES,
    MANIFEST_NAME,
    PART_NAMES,
    Manifest,
    Part,
    is_bundle,
    open_bundle,
    write_bundle,
)
from fastverify.errors import UserError


def _manifest(parts: dict[str, tuple[str, ...]] | None = None) -> Manifest:
    parts = parts or {}
    return Manifest(
        created_utc="2026-01-01T00:00:00+00:00",
        fastverify_version="0.1.0",
        host={"hostname": "box", "gpu_count": 0},
        budget_s=60.0,
        elapsed_s=1.5,
        parts=tuple(
            Part(n, "ok", None, files=parts[n], seconds=0.1, meta={"k": 1})
            if n in parts
            else Part(n, "skipped", "no GPUs")
            for n in PART_NAMES
        ),
    )


def _raw_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _member(name: str, kind=tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def _manifest_bytes(m: Manifest | dict) -> bytes:
    return msgspec.json.encode(m) if isinstance(m, Manifest) else json.dumps(m).encode()


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(UserError) as err:
        open_bundle(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def test_round_trip(tmp_path):
    trace = tmp_path / "in" / "7-TP-0.trace.json.gz"
    trace.parent.mkdir()
    trace.write_bytes(gzip.compress(b'{"traceEvents": []}'))
    files = {ARCNAMES["doctor"]: b'{"verdict": "ok"}', ARCNAMES["server_trace"] + trace.name: trace}
    m = _manifest({"doctor": (ARCNAMES["doctor"],), "server_trace": (ARCNAMES["server_trace"] + trace.name,)})
    out = tmp_path / "b.tar.gz"
    write_bundle(out, m, files)
    assert is_bundle(out) and not list(tmp_path.glob(".b.tar.gz.*"))  # no temporary file left
    b = open_bundle(out)
    assert b.manifest == m
    assert [p.name for p in b.manifest.parts] == list(PART_NAMES)
    assert b.part("doctor").files == ("doctor.json",) and b.part("nope") is None
    assert b.read("doctor.json") == b'{"verdict": "ok"}'
    assert b.read("server/traces/7-TP-0.trace.json.gz") == trace.read_bytes()
    with tarfile.open(out) as tar:  # manifest first, the part files after it
        assert tar.getnames() == [MANIFEST_NAME, "doctor.json", "server/traces/7-TP-0.trace.json.gz"]
    got = b.extract(["doctor.json", "server/traces/7-TP-0.trace.json.gz"], tmp_path / "x")
    assert [p.read_bytes() for p in got] == [b'{"verdict": "ok"}', trace.read_bytes()]
    with pytest.raises(UserError, match="no member"):
        b.read("missing.json")
    # a bundle may be replaced by a new one
    write_bundle(out, _manifest(), {})
    assert open_bundle(out).members == {}


def test_write_refuses_a_file_that_is_not_a_bundle_and_its_own_inputs(tmp_path):
    other = tmp_path / "notes.tar.gz"
    other.write_text("my notes")
    with pytest.raises(UserError, match="not a fastverify bundle"):
        write_bundle(other, _manifest(), {})
    assert other.read_text() == "my notes"
    src = tmp_path / "verify-rank0.jsonl"
    src.write_text("{}\n")
    with pytest.raises(UserError, match="collected file"):
        write_bundle(
            src, _manifest({"verify_log": ("verify-log/verify-rank0.jsonl",)}), {"verify-log/verify-rank0.jsonl": src}
        )
    assert src.read_text() == "{}\n"
    with pytest.raises(UserError, match="not a regular file"):
        write_bundle(tmp_path, _manifest(), {})
    with pytest.raises(ValueError, match="manifest lists"):  # a programming error, not a user one
        write_bundle(tmp_path / "c.tar.gz", _manifest({"doctor": ("doctor.json",)}), {})
    with pytest.raises(ValueError, match="'..'"):
        write_bundle(tmp_path / "c.tar.gz", _manifest({"doctor": ("../x",)}), {"../x": b""})
    assert not (tmp_path / "c.tar.gz").exists()


def test_write_is_atomic_when_interrupted(tmp_path):
    class Boom:
        """Stands for a source that fails half-way (Ctrl-C while copying a trace)."""

    out = tmp_path / "b.tar.gz"
    write_bundle(out, _manifest(), {})
    before = out.read_bytes()
    with pytest.raises(TypeError):
        write_bundle(out, _manifest({"doctor": ("doctor.json",)}), {"doctor.json": Boom()})
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz"]


def test_not_gzip_and_not_tar(tmp_path):
    p = tmp_path / "plain.tar.gz"
    p.write_text("hello")
    _refused(p, "not a gzip")
    p.write_bytes(gzip.compress(b"not a tar archive " * 100))
    _refused(p, "not a tar")
    (tmp_path / "empty.tar.gz").write_bytes(b"")
    _refused(tmp_path / "empty.tar.gz", "not a gzip")
    _refused(tmp_path / "absent.tar.gz", "cannot read")
    _refused(tmp_path, "is a directory")


def test_truncated(tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(bytes(range(256)) * 4096)
    full = tmp_path / "full.tar.gz"
    write_bundle(full, _manifest({"doctor": ("doctor.json",)}), {"doctor.json": src})
    raw = full.read_bytes()
    for cut in (len(raw) - 4, len(raw) // 2, 40):
        p = tmp_path / f"cut{cut}.tar.gz"
        p.write_bytes(raw[:cut])
        _refused(p, "truncated")


def test_no_manifest(tmp_path):
    p = _raw_tar(tmp_path / "b.tar.gz", [(_member("doctor.json"), b"{}")])
    _refused(p, "no manifest.json")
    p = _raw_tar(
        tmp_path / "c.tar.gz", [(_member("doctor.json"), b"{}"), (_member(MANIFEST_NAME), _manifest_bytes(_manifest()))]
    )
    _refused(p, "no manifest.json as the first member")


def test_wrong_schema_and_version(tmp_path):
    doc = msgspec.to_builtins(_manifest())
    cases = {
        "schema": ({**doc, "schema": "fastverify.profile"}, "schema"),
        "version": ({**doc, "schema_version": 2}, "version 2"),
        "field": ({**doc, "budget_s": "a lot"}, "budget_s"),
        "status": ({**doc, "parts": [{**doc["parts"][0], "status": "great"}]}, "status"),
        "json": (None, "manifest.json is not valid JSON"),
    }
    for name, (bad, word) in cases.items():
        data = b"{not json" if bad is None else _manifest_bytes(bad)
        p = _raw_tar(tmp_path / f"{name}.tar.gz", [(_member(MANIFEST_NAME), data)])
        _refused(p, word)
        assert not is_bundle(p) or name not in ("schema", "json")


def test_member_named_in_the_manifest_but_missing(tmp_path):
    m = _manifest({"doctor": ("doctor.json",)})
    p = _raw_tar(tmp_path / "b.tar.gz", [(_member(MANIFEST_NAME), _manifest_bytes(m))])
    _refused(p, "doctor.json", "lacks")


@pytest.mark.parametrize(
    "member, word",
    [
        (_member("../evil.txt"), "'..'"),
        (_member("server/../../evil.txt"), "'..'"),
        (_member("/etc/evil"), "absolute"),
        (_member("topo/link", tarfile.SYMTYPE, "/etc/passwd"), "link"),
        (_member("topo/hard", tarfile.LNKTYPE, "doctor.json"), "link"),
        (_member("dev/null", tarfile.CHRTYPE), "device"),
        (_member("fifo", tarfile.FIFOTYPE), "device or FIFO"),
        (_member("folder", tarfile.DIRTYPE), "not a regular file"),
    ],
)
def test_hostile_members(tmp_path, member, word):
    p = _raw_tar(tmp_path / "b.tar.gz", [(_member(MANIFEST_NAME), _manifest_bytes(_manifest())), (member, b"x")])
    _refused(p, "refused member", word)


def test_duplicate_member_and_oversize_manifest(tmp_path, monkeypatch):
    listed = _manifest_bytes(_manifest({"doctor": ("a.json",)}))
    p = _raw_tar(
        tmp_path / "b.tar.gz", [(_member(MANIFEST_NAME), listed), (_member("a.json"), b"1"), (_member("a.json"), b"2")]
    )
    _refused(p, "twice")
    from fastverify import bundle

    monkeypatch.setattr(bundle, "MAX_MANIFEST_BYTES", 100)
    p = _raw_tar(tmp_path / "c.tar.gz", [(_member(MANIFEST_NAME), _manifest_bytes(_manifest()))])
    _refused(p, "manifest.json")
    monkeypatch.setattr(bundle, "MAX_MANIFEST_BYTES", 1 << 22)
    monkeypatch.setattr(bundle, "MAX_MEMBER_BYTES", 10)
    p = _raw_tar(
        tmp_path / "d.tar.gz",
        [
            (_member(MANIFEST_NAME), _manifest_bytes(_manifest({"doctor": ("big.bin",)}))),
            (_member("big.bin"), b"x" * 11),
        ],
    )
    _refused(p, "big.bin", "GiB")


def test_extract_stays_inside_the_folder(tmp_path):
    out = tmp_path / "b.tar.gz"
    write_bundle(out, _manifest({"doctor": ("doctor.json",)}), {"doctor.json": b"{}"})
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside.json"
    (dest / "doctor.json").symlink_to(outside)  # a planted link must not be followed
    with pytest.raises(UserError):
        open_bundle(out).extract(["doctor.json"], dest)
    assert not outside.exists()
