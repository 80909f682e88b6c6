"""Bad input found by an outside tester after the modules were regrouped: a number past a float's
range (a trace's ``dur``, a bundle's manifest, a deployment record), ``traceEvents`` given twice,
a tune journal line that gives a key twice or sits behind a symlink, and ``--draft-shape`` with
flags it does not read. Each was a traceback, a misleading line or silence before."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import msgspec
import pytest
from conftest import SHARED, SHARED_MISSING

from fastverify.cli import main
from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, decode_record, encode_record
from fastverify.errors import UserError
from fastverify.inputs import decode_json, loads_json
from fastverify.nccl.perftable import parse_all_reduce_perf
from fastverify.registry import BackendName
from fastverify.tune.sweep import Journal, fingerprint, read_journal
from fastverify.tune.trial import TrialSpec
from tests.test_cycle_report import make_bundle

PAST_FLOAT = "holds a number past a float's range (such as 1e999)"


def _kernel(ts, dur) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": {"stream": 7}}


def _profile(tmp_path: Path, events_json: str, capsys, *extra: str) -> tuple[int, str, Path]:
    trace = tmp_path / "t.json"
    trace.write_text('{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ' + events_json + "}")
    out = tmp_path / "p.json"
    rc = main(["profile", "--trace", str(trace), "--output", str(out), "--no-png", "--quiet", *extra])
    return rc, capsys.readouterr().err, out


@pytest.mark.parametrize("field", ["dur", "ts"])
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_time_past_a_floats_range_beside_decimals_is_one_skipped_event(tmp_path, capsys, field, jobs):
    """Before: ``OverflowError: int too large to convert to float`` from the columns' float64 route
    (decimals beside a 401-digit integer); now the text rule skips that event, as for any unusable
    time, and counts it."""
    events = [_kernel(0.5, 5.25), _kernel(10.5, 3.5), _kernel(20.5, 2.0)]
    text = json.dumps(events).replace('"ts": 10.5' if field == "ts" else '"dur": 3.5', f'"{field}": 1{"0" * 400}')
    rc, err, out = _profile(tmp_path, text, capsys, "--jobs", jobs)
    assert rc == 0, err
    prof = json.loads(out.read_text())
    assert any("1 GPU events without a usable ts/dur were skipped" in w for w in prof["warnings"]), prof["warnings"]
    assert prof["ranks"][0]["hta"]["kernel_time_us"] > 0


def test_trace_events_given_twice_is_said_so_not_an_empty_trace(tmp_path, capsys):
    """Before: the last (empty) list won and the line was "the trace has no events"."""
    trace = tmp_path / "t.json.gz"
    body = json.dumps({"traceEvents": [_kernel(0.5, 5.25)]})
    trace.write_bytes(gzip.compress((body[:-1] + ', "traceEvents": []}').encode()))
    assert main(["profile", "--trace", str(trace), "--output", str(tmp_path / "p.json"), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert err == f"fastverify: error: {trace}: the key 'traceEvents' is given twice; which list holds is not known\n"
    empty = tmp_path / "e.json"
    empty.write_text('{"traceEvents": []}')
    assert main(["profile", "--trace", str(empty), "--output", str(tmp_path / "q.json"), "--no-png"]) == 2
    assert capsys.readouterr().err == f"fastverify: error: {empty}: the trace has no events\n"


@pytest.mark.parametrize("text", ['{"a": 1e999}', "[1, -1e999]", '{"a": {"b": 2.5e400}}'])
def test_the_json_helpers_refuse_a_number_past_a_floats_range(text):
    """Before: ``loads_json`` gave ``inf`` silently (the standard library's fallback) and
    ``decode_json`` raised ``msgspec.ValidationError: Number out of range``."""
    with pytest.raises(UserError) as a:
        loads_json(text.encode(), "x.json")
    assert str(a.value) == f"x.json: the JSON {PAST_FLOAT}"
    with pytest.raises(UserError) as b:
        decode_json(text.encode(), "y.json", what="manifest.json")
    assert str(b.value) == f"y.json: manifest.json {PAST_FLOAT}"
    assert loads_json(b'{"a": 1.5e300, "b": NaN}', "z.json")["a"] == 1.5e300  # large but finite; NaN as before


def test_a_bundle_manifest_number_past_a_floats_range_is_one_line(tmp_path, capsys):
    real = make_bundle(tmp_path, None)
    bad = tmp_path / "inf.tar.gz"
    with tarfile.open(real, "r:gz") as a, tarfile.open(bad, "w:gz") as b:
        for m in a.getmembers():
            body = a.extractfile(m).read()
            if m.name == "manifest.json":
                doc = json.loads(body)
                body = json.dumps({**doc, "budget_s": 1}).replace('"budget_s": 1', '"budget_s": 1e999').encode()
                m.size = len(body)
            b.addfile(m, io.BytesIO(body))
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and PAST_FLOAT in err and str(bad) in err, err


def test_a_deployment_record_number_past_a_floats_range_is_one_line():
    record = DeploymentRecord(
        backend=BackendName.nccl,
        shapes=VerifyShapes(max_batch=32, draft_tokens=4, hidden=7168),
        p2p=P2PFacts(ok=True, source="p2p_check", pairs=2),
        box=BoxFingerprint(gpu_name="NVIDIA H100", sm=(9, 0), gpu_count=2, tp=2),
        nccl_settings={},
        sglang_version="0.5.23",
    )
    data = encode_record(record)
    assert decode_record(data) == record
    bad = data.replace(b'"max_batch": 32', b'"max_batch": 1e999').replace(b'"max_batch":32', b'"max_batch":1e999')
    assert bad != data
    with pytest.raises(UserError) as e:
        decode_record(bad, source="a.deploy.json")
    assert PAST_FLOAT in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(msgspec.ValidationError):  # not swallowed: the JSON helper converts only this case
        msgspec.json.decode(bad)


def _spec() -> TrialSpec:
    return TrialSpec(backend="gloo", env={}, world_size=2, device="cpu", dtype="float32", hidden=64, sizes=((64, 2),))


def test_a_journal_line_giving_a_key_twice_is_corrupt(tmp_path):
    """Before: a hand-edited line with ``"kind"`` twice resumed silently (the last value kept)."""
    path = tmp_path / "j.jsonl"
    with Journal.open(path, fingerprint=fingerprint([_spec()]), resume=False):
        pass
    header = path.read_bytes()
    read_journal(path)  # the header alone reads
    path.write_bytes(header.replace(b'{"kind":"header"', b'{"kind":"trial","kind":"header"', 1))
    assert path.read_bytes() != header
    with pytest.raises(UserError) as e:
        read_journal(path)
    assert "line 1 is corrupt (the key 'kind' is given twice)" in str(e.value)


def test_the_journal_is_never_written_through_a_symlink(tmp_path, capsys):
    """Before: the sweep created and appended the link's target."""
    victim, link = tmp_path / "victim.jsonl", tmp_path / "j.jsonl"
    link.symlink_to(victim)
    argv = ["tune", "--device", "cpu", "--iters", "2", "--warmup", "1", "--top", "1", "--journal", str(link)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--journal {link}: is a symlink" in err, err
    assert not victim.exists()


def test_draft_shape_refuses_flags_it_does_not_read(tmp_path, capsys):
    """Before: ``--tok-s -5 --accept-length 99`` were ignored: exit 0, the same table."""
    hist = tmp_path / "h.json"
    hist.write_text('{"steps": 3, "counts": [10, 20, 30, 40], "topk": 1, "verify_ms": [[4, 5.0]]}')
    base = ["tune", "--draft-shape", "--accept-histogram", str(hist)]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "--tok-s", "-5", "--accept-length", "99"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "fastverify: error: --draft-shape reads accept lengths and verify costs only; --tok-s, --accept-length "
        "do not apply to it\n"
    )


def test_a_perf_table_size_given_twice_in_one_table_is_refused():
    """Before: a second 8192 B row with other times was kept beside the first, silently. Another
    table (a new column header) may repeat a size, as before."""
    path = SHARED / "inputs" / "allreduceperf-blog-chlc-rtx4090-p2punlocked.txt"
    if not path.exists():
        pytest.skip(SHARED_MISSING)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["8192"])
    again = lines[at].replace("42.14", "99.14")
    assert again != lines[at]
    assert len(parse_all_reduce_perf(text).rows) == 25
    with pytest.raises(UserError) as e:
        parse_all_reduce_perf("".join(lines[: at + 1] + [again] + lines[at + 1 :]), source="t.txt")
    assert str(e.value) == (
        f"t.txt: line {at + 2}: 8,192 B float sum again (first on line {at + 1}); all_reduce_perf prints each "
        "size once per table, so which row holds is not known"
    )
    header = next(ln for ln in lines if ln.lstrip("#").split()[:2] == ["size", "count"])
    second = parse_all_reduce_perf("".join(lines + [header, again]))
    assert len(second.rows) == 26 and any("a second table starts here" in p for p in second.problems)
