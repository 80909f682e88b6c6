"""Hostile bundles against ``fastverify report`` and ``tune --draft-shape --bundle``: archive
reading bounded in time and memory (one pass, only listed members, text members capped as files
are, nothing after the gzip data, extended headers and pax times checked), errors that name
``BUNDLE:member``, unreadable parts said (not ignored), manifest figures bounded, and
``collect --verify-log`` with names that are not UTF-8.

Each hostile bundle is made from a real one (written by :func:`fastverify.bundle.write_bundle`,
as collect writes it) and rewritten with the standard library's ``tarfile``."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import time
import zlib
from pathlib import Path

import msgspec
import pytest

from fastverify import inputs
from fastverify.bundle import PART_NAMES, Manifest, Part, open_bundle, write_bundle
from fastverify.cli import main
from fastverify.errors import UserError
from tests import cycle_traces as ct
from tests.test_cycle_report import P2P_OFF_LOG, make_bundle

TRACE1 = "server/traces/1700000000-TP-1.trace.json.gz"


class _Zeros(io.RawIOBase):
    """``n`` zero bytes as a stream (a large member without holding it in memory)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        k = min(len(b), self.n)
        b[:k] = bytes(k)
        self.n -= k
        return k


def _rewrite(
    src: Path, out: Path, *, data: dict | None = None, pax: dict | None = None, extra=(), manifest=None
) -> Path:
    """``src`` member by member into ``out`` (pax format): ``data`` replaces a member's bytes (an
    int: that many zeros), ``pax`` sets a member's pax headers, ``extra`` appends members
    ``(name, bytes or int)``, ``manifest`` edits the manifest dict."""
    data, pax = data or {}, pax or {}
    with tarfile.open(src, "r:gz") as a, tarfile.open(out, "w:gz", format=tarfile.PAX_FORMAT, compresslevel=1) as b:
        for m in a.getmembers():
            body = a.extractfile(m).read()
            if m.name == "manifest.json" and manifest is not None:
                doc = json.loads(body)
                manifest(doc)
                body = json.dumps(doc).encode()
            body = data.get(m.name, body)
            if m.name in pax:
                m.pax_headers = dict(pax[m.name])
            m.size = body if isinstance(body, int) else len(body)
            b.addfile(m, _Zeros(body) if isinstance(body, int) else io.BytesIO(body))
        for name, body in extra:
            info = tarfile.TarInfo(name)
            info.size = body if isinstance(body, int) else len(body)
            b.addfile(info, _Zeros(body) if isinstance(body, int) else io.BytesIO(body))
    return out


def _report(bundle: Path, capsys, *more: str) -> tuple[int, str, str]:
    rc = main(["report", str(bundle), *more])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def real(tmp_path) -> Path:
    return make_bundle(
        tmp_path / "real",
        ct.Plan(world=2, cycles=2),
        nccl_log=P2P_OFF_LOG,
        iommu={"cmdline_iommu_tokens": [], "iommu_groups": 0, "acs": []},
    )


# ---- 1. bytes after the gzip data ------------------------------------------------------------------


def test_zeros_appended_after_the_gzip_data_are_refused_at_once(real, tmp_path, capsys):
    bad = tmp_path / "zeros.tar.gz"
    bad.write_bytes(real.read_bytes() + bytes(12_000_000))
    t0 = time.monotonic()
    rc, out, err = _report(bad, capsys)
    _one_line_error(rc, err, str(bad), "12,000,000 bytes after the end of the gzip data")
    assert out == "" and time.monotonic() - t0 < 10
    second = tmp_path / "two.tar.gz"  # a second gzip member (cat a.tar.gz b.gz)
    second.write_bytes(real.read_bytes() + gzip.compress(b"more"))
    with pytest.raises(UserError, match=f"{len(gzip.compress(b'more'))} bytes after the end of the gzip data"):
        open_bundle(second)


def test_data_after_the_tar_end_inside_the_gzip_is_refused(real, tmp_path):
    tar = gzip.decompress(real.read_bytes())
    bad = tmp_path / "tail.tar.gz"
    bad.write_bytes(gzip.compress(tar + bytes(2 << 20), 1))  # 2 MiB of zeros past the end-of-archive block
    with pytest.raises(UserError, match="data after the tar's end-of-archive block"):
        open_bundle(bad)
    bad.write_bytes(gzip.compress(tar + b"x" * 512, 1))  # a little, but not zero padding
    with pytest.raises(UserError, match="data after the tar's end-of-archive block"):
        open_bundle(bad)


# ---- 2. one pass; only listed members ----------------------------------------------------------------


def test_a_member_not_in_the_manifest_is_refused_before_its_data_is_read(real, tmp_path, capsys):
    bad = _rewrite(real, tmp_path / "unlisted.tar.gz", extra=[("junk/big.bin", 256 << 20)])  # 256 MiB of zeros
    t0 = time.monotonic()
    rc, _, err = _report(bad, capsys)
    _one_line_error(rc, err, "'junk/big.bin' is not listed in manifest.json")
    assert time.monotonic() - t0 < 10


def test_report_reads_the_archive_once(real, capsys, monkeypatch):
    opened = []
    real_open = tarfile.open

    def counting(*a, **k):
        opened.append(1)
        return real_open(*a, **k)

    monkeypatch.setattr(tarfile, "open", counting)
    rc, out, _ = _report(real, capsys, "--json")
    assert rc == 0 and json.loads(out)["cycles"] is not None
    assert len(opened) == 1  # one pass: no part read opens the archive again


def test_an_opened_bundle_never_reads_the_archive_again(real, tmp_path):
    moved = tmp_path / "moved.tar.gz"
    with open_bundle(real) as b:
        os.replace(real, moved)  # the file is gone: every read is served by the single pass
        assert b.read("nccl/nccl-debug.log") == P2P_OFF_LOG.encode()
        assert len(b.local(b.part("server_trace").files)) == 2
    with pytest.raises(UserError, match="closed"):
        b.read("nccl/nccl-debug.log")


# ---- 3. text members capped as files are; inflation bounded ------------------------------------------


def test_an_nccl_log_member_over_the_log_cap_is_a_note_and_never_parsed(real, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(inputs.CAPS, "log", 1 << 20)  # a 1 MiB cap stands for the 512 MiB one
    bad = _rewrite(real, tmp_path / "biglog.tar.gz", data={"nccl/nccl-debug.log": 2 << 20})
    rc, out, _ = _report(bad, capsys, "--json")
    doc = json.loads(out)
    assert rc == 0 and "nccl_log" not in doc["sources"]
    assert (
        f"nccl_log: not read ({bad}:nccl/nccl-debug.log: 2,097,152 bytes, over the 1 MiB limit for a log input)"
        in doc["notes"]
    )
    assert doc["cycles"] is not None  # the rest of the report stands


def test_a_topology_member_over_the_16_mib_text_cap_is_not_read(real, tmp_path, capsys):
    base = make_bundle(tmp_path / "t", None, topo="GPU0\tX\n")
    bad = _rewrite(base, tmp_path / "bigtopo.tar.gz", data={"topo/nvidia-smi-topo.txt": (16 << 20) + 1})
    rc, out, _ = _report(bad, capsys, "--json")
    assert rc == 0
    assert any(
        n.startswith(
            f"nvidia_smi_topo: not read ({bad}:topo/nvidia-smi-topo.txt: 16,777,217 bytes, over "
            "the 16 MiB limit for a text input"
        )
        for n in json.loads(out)["notes"]
    )


def test_inflated_bytes_are_bounded_whatever_the_headers_say(real, tmp_path, monkeypatch):
    from fastverify import bundle

    monkeypatch.setattr(bundle, "MAX_TOTAL_BYTES", 1 << 20)
    monkeypatch.setattr(bundle, "MAX_HEADERS_BYTES", 1 << 16)
    big = {"comment": "x" * (600 << 10)}  # each header under its 1 MiB bound; together over the total
    bad = _rewrite(real, tmp_path / "pad.tar.gz", pax={TRACE1: big, "nccl/nccl-debug.log": big})
    with pytest.raises(UserError, match="inflates to over 1,114,112 bytes"):
        open_bundle(bad)


def test_an_extended_header_over_1_mib_is_refused(real, tmp_path):
    bad = _rewrite(real, tmp_path / "hdr.tar.gz", pax={TRACE1: {"comment": "x" * (2 << 20)}})
    with pytest.raises(UserError, match="an extended header of 2,097,1[0-9][0-9] bytes"):
        open_bundle(bad)


# ---- 4. pax headers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mtime", ["nan", "1e30", "-1e30", "inf"])
def test_a_bad_pax_mtime_is_one_line_in_report(real, tmp_path, capsys, mtime):
    bad = _rewrite(real, tmp_path / "pax.tar.gz", pax={TRACE1: {"mtime": mtime}})
    rc, _, err = _report(bad, capsys)
    _one_line_error(rc, err, str(bad), TRACE1, f"a member time of {mtime!r} s")


def _draft_bundle(tmp: Path, records: str) -> Path:
    """A bundle with a verify-log part (one rank's records) and server args, as collect writes it."""
    files = {
        "verify-log/verify-rank0.jsonl": records.encode(),
        "server/server_info.json": json.dumps({"speculative_num_steps": 3, "speculative_eagle_topk": 1}).encode(),
    }
    parts = tuple(
        Part(n, "ok", None, ("verify-log/verify-rank0.jsonl",))
        if n == "verify_log"
        else Part(n, "ok", None, ("server/server_info.json",))
        if n == "server_args"
        else Part(n, "skipped", "not in this test")
        for n in PART_NAMES
    )
    out = tmp / "draft.tar.gz"
    write_bundle(
        out,
        Manifest(
            created_utc="2026-12-01T00:00:00Z",
            fastverify_version="test",
            host={"hostname": "box"},
            budget_s=60.0,
            elapsed_s=1.0,
            parts=parts,
        ),
        files,
    )
    return out


RECORDS = "".join(
    json.dumps(
        {
            "step": i,
            "verify_ms": 2.0,
            "clock": "cuda_events",
            "rank": "0",
            "pid": 1,
            "batch": 2,
            "tokens": 8,
            "accepted": [i % 4, 3],
        }
    )
    + "\n"
    for i in range(8)
)


def test_a_bad_pax_mtime_is_one_line_in_draft_shape(tmp_path, capsys):
    good = _draft_bundle(tmp_path, RECORDS)
    bad = _rewrite(good, tmp_path / "pax.tar.gz", pax={"verify-log/verify-rank0.jsonl": {"mtime": "nan"}})
    rc = main(["tune", "--draft-shape", "--bundle", str(bad)])
    _one_line_error(rc, capsys.readouterr().err, str(bad), "verify-log/verify-rank0.jsonl", "'nan'")


# ---- 5. errors name BUNDLE:member ---------------------------------------------------------------------


def test_a_bad_verify_record_is_named_by_its_member(tmp_path, capsys):
    bad = _draft_bundle(tmp_path, RECORDS + "{not a record}\n" + RECORDS.splitlines(True)[0])
    rc = main(["tune", "--draft-shape", "--bundle", str(bad)])
    err = capsys.readouterr().err
    _one_line_error(rc, err, f"{bad}:verify-log/verify-rank0.jsonl")
    assert "fastverify-" not in err.replace(str(bad), "")  # no temporary copy is named
    rc, out, _ = _report(bad, capsys, "--json")  # in report, the draft-shape section says it
    section = json.loads(out)["draft_shape"]
    assert rc == 0 and section["error"].startswith(f"{bad}:verify-log/verify-rank0.jsonl")


# ---- 6. a part that cannot be read is said ---------------------------------------------------------------


@pytest.mark.parametrize("member, part", [("doctor.json", "doctor"), ("host/iommu.json", "host_iommu")])
def test_a_corrupt_json_part_is_a_note_naming_its_member(real, tmp_path, capsys, member, part):
    base = real
    if member == "doctor.json":  # the test bundle has no doctor part: list one

        def add_doctor(doc):
            doc["parts"][0] = {"name": "doctor", "status": "ok", "reason": None, "files": ["doctor.json"]}

        base = _rewrite(real, tmp_path / "with-doctor.tar.gz", extra=[("doctor.json", b"{}")], manifest=add_doctor)
    bad = _rewrite(base, tmp_path / "corrupt.tar.gz", data={member: b"{not json"})
    rc, out, _ = _report(bad, capsys, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["cycles"] is not None
    assert any(n.startswith(f"{part}: not read ({bad}:{member}: not valid JSON") for n in doc["notes"]), doc["notes"]
    wrong = _rewrite(base, tmp_path / "list.tar.gz", data={member: b"[1, 2]"})
    rc, out, _ = _report(wrong, capsys, "--json")
    assert f"{part}: not read ({wrong}:{member}: an array, not an object)" in json.loads(out)["notes"]


# ---- 7. manifest figures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda d: d["parts"][7].update(meta={"verify_shapes": {"hidden": 10**12, "draft_tokens": 4}}),
            "parts[server_args].meta.verify_shapes.hidden = 1000000000000 is not an integer in [1, 65,536]",
        ),
        (lambda d: d["parts"][7].update(meta={"tp_size": 10**18}), "tp_size = 1000000000000000000"),
        (lambda d: d["parts"][6].update(meta={"draft_tokens": 65, "batch": 8}), "draft_tokens = 65"),
        (lambda d: d["parts"][6].update(meta={"swept_msg_bytes": 14 * 10**21}), "swept_msg_bytes"),
        (lambda d: d.update(elapsed_s=1e300), "elapsed_s = 1e+300 s is outside"),
        (lambda d: d["host"].update(gpu_count=10**18), "host.gpu_count"),
        (lambda d: d["parts"][5].update(meta={"median_us": {"57344": -1.0}}), "median_us.57344 = -1.0 µs"),
    ],
)
def test_manifest_figures_out_of_bounds_are_refused(real, tmp_path, capsys, edit, words):
    assert PART_NAMES[7] == "server_args" and PART_NAMES[6] == "sweep" and PART_NAMES[5] == "nccl_log"
    bad = _rewrite(real, tmp_path / "fig.tar.gz", manifest=edit)
    rc, _, err = _report(bad, capsys)
    _one_line_error(rc, err, f"{bad}: manifest.json: ", words)


def test_real_manifest_figures_pass(real):
    with open_bundle(real) as b:
        assert b.manifest.budget_s == 600.0


# ---- 8. collect --verify-log with names that are not UTF-8 ------------------------------------------------


def _collect(tmp_path: Path, folder: Path, capsys) -> Path:
    from fastverify.collect import command
    from tests.test_collect import _args

    out = tmp_path / "b.tar.gz"
    assert (
        command.run(
            _args(
                "--output",
                str(out),
                "--quiet",
                "--verify-log",
                str(folder),
                "--skip",
                "doctor",
                "--skip",
                "host_iommu",
                "--budget",
                "60",
            )
        )
        == 0
    )
    capsys.readouterr()
    return out


def test_collect_takes_a_verify_log_folder_whose_name_is_not_utf8(tmp_path, capsys):
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/prof\xff"))
    folder.mkdir()
    (folder / "verify-rank0.jsonl").write_text(RECORDS)
    with open_bundle(_collect(tmp_path, folder, capsys)) as b:
        p = b.part("verify_log")
        assert p.status == "ok" and p.files == ("verify-log/verify-rank0.jsonl",)
        assert p.meta["folder"].endswith("/prof\\xff")


def test_collect_leaves_out_and_says_a_record_name_that_is_not_utf8(tmp_path, capsys):
    folder = tmp_path / "prof"
    folder.mkdir()
    (folder / "verify-rank0.jsonl").write_text(RECORDS)
    (folder / os.fsdecode(b"rank\xff.trace.json")).write_text("{}")
    from fastverify.collect.parts import check_verify_log

    check_verify_log(folder)
    assert "leaving out 1 file(s) whose name is not UTF-8: rank\\xff.trace.json" in capsys.readouterr().err
    with open_bundle(_collect(tmp_path, folder, capsys)) as b:
        p = b.part("verify_log")
        assert p.files == ("verify-log/verify-rank0.jsonl",) and p.meta["left_out_not_utf8"] == ["rank\\xff.trace.json"]
    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    (only_bad / os.fsdecode(b"verify-rank\xff.jsonl")).write_text(RECORDS)
    with pytest.raises(UserError, match=r"no verify-rank\*\.jsonl that is a regular file with a UTF-8 name"):
        check_verify_log(only_bad)


def test_the_inflater_reads_a_real_bundle_to_its_trailer(real):
    raw = real.read_bytes()
    assert zlib.decompress(raw, 16 + zlib.MAX_WBITS)  # the fixture is one gzip member
    with open_bundle(real) as b:
        assert set(b.members) == {f for p in b.manifest.parts for f in p.files}
        assert msgspec.to_builtins(b.manifest)["schema"] == "fastverify.bundle"
