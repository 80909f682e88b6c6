"""Issue 34's remainder: collect's bundle under a closed or full stdout, duplicate JSON keys in a
bundle's manifest and in verify records, a 0 ns all-reduce in a trace, and the docs' commands
from a fresh clone."""

from __future__ import annotations

import io
import json
import shlex
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import run_with_stdout

from fastverify.cli import main
from fastverify.errors import UserError
from fastverify.verify_records import read_log_dir
from tests import cycle_traces as ct
from tests.test_cycle_report import make_bundle, report_json
from tests.test_readme_commands import readme_commands


@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_collect_keeps_and_names_its_bundle_when_stdout_cannot_be_written(tmp_path, stdout):
    """The bundle is collect's output: a stdout that cannot be written loses only the "wrote" line,
    which goes to stderr after why (exit 1, as ``profile``'s own files); before, exit 2 and a line
    that named no bundle."""
    out = tmp_path / "b.tar.gz"
    argv = [sys.executable, "-m", "fastverify", "collect", "--budget", "30", "--skip", "doctor", "--output", str(out)]
    cp, why = run_with_stdout(argv, tmp_path, stdout)
    assert "Traceback" not in cp.stderr, cp.stderr
    assert cp.returncode == 1, cp.stderr
    last = cp.stderr.splitlines()[-1]
    assert last.startswith(f"fastverify: error: cannot write to standard output ({why}); wrote {out} ("), last
    assert last.endswith(" ok, 9 skipped, 0 failed)") or last.endswith(" failed)"), last
    with tarfile.open(out) as tar:
        assert "manifest.json" in tar.getnames()


# ---- duplicate keys: a bundle's manifest, a verify record ------------------------------------------


def _with_manifest(src, out, edit):
    """``src`` member by member into ``out``, the manifest's bytes passed through ``edit``."""
    with tarfile.open(src, "r:gz") as a, tarfile.open(out, "w:gz") as b:
        for m in a.getmembers():
            body = a.extractfile(m).read()
            if m.name == "manifest.json":
                body = edit(body)
                m.size = len(body)
            b.addfile(m, io.BytesIO(body))
    return out


def test_a_manifest_key_given_twice_is_refused_naming_bundle_member_and_key(tmp_path, capsys):
    """Before: the last ``budget_s`` was kept silently and the report printed (exit 0)."""
    real = make_bundle(tmp_path, None)
    bad = _with_manifest(real, tmp_path / "twice.tar.gz", lambda b: b'{"budget_s": 1e9, ' + b[1:])
    assert main(["report", str(real)]) == 0
    capsys.readouterr()
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"fastverify: error: {bad}:manifest.json: the key 'budget_s' is given twice in one object\n"


RECORD = {
    "step": 0,
    "verify_ms": 1.5,
    "clock": "cuda_events",
    "rank": "0",
    "pid": 4242,
    "batch": 2,
    "tokens": 8,
    "accepted": [1, 3],
    "allreduce_paths": {"verify": {"sglang.custom_all_reduce": 61}},
}


def _log(tmp_path, *lines: str):
    d = tmp_path / "vlog"
    d.mkdir()
    (d / "verify-rank0.jsonl").write_text("".join(ln + "\n" for ln in lines))
    return d


def _line(step: int, **extra) -> str:
    return json.dumps({**RECORD, "step": step, **extra})


@pytest.mark.parametrize(
    "twice, key",
    [
        ('"verify_ms": 900.0, ', "verify_ms"),  # a top-level key
        ('"allreduce_paths": {"verify": {"sglang.custom_all_reduce": 1, ', "sglang.custom_all_reduce"),  # nested
    ],
)
def test_a_verify_record_key_given_twice_is_refused_naming_file_line_and_key(tmp_path, twice, key):
    """Before: the last value was kept silently (900 ms given first, 1.5 ms read)."""
    second = _line(1)
    if key == "verify_ms":
        second = "{" + twice + second[1:]
    else:
        second = second.replace('"allreduce_paths": {"verify": {', twice)
    d = _log(tmp_path, _line(0), second)
    with pytest.raises(UserError) as e:
        read_log_dir(d)
    assert str(e.value) == (
        f"{d / 'verify-rank0.jsonl'}:2: the key {key!r} is given twice in one record; a record "
        "the verify timer writes gives each key once"
    )


def test_records_with_nulls_and_without_duplicates_still_load(tmp_path):
    """A null value (a line with more ``:`` than decoded values: the slow check runs) is no duplicate."""
    d = _log(tmp_path, _line(0), _line(1, batch=None, tokens=None, accepted=None, allreduce_paths=None))
    doc = read_log_dir(d)
    assert doc is not None


# ---- a trace's 0-ns all-reduces --------------------------------------------------------------------


def test_zero_ns_all_reduces_in_a_trace_form_no_slow_transfer_ratio(tmp_path, capsys):
    """Transfers of 0 ns (the last rank to arrive takes no time): before, the rank's WAIT was set
    against NCCL's reference as if it were the transfer ("177.2 µs each (all-reduce time (wait not
    separated)), 3.8x the reference"). The trace's time per all-reduce is floored at 1 µs."""
    plan = ct.Plan(world=8, cycles=2, transfer_us=0.0, straggle_us=500.0)
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    assert doc["verify_msg_bytes"] == 57344  # the published reference exists at this size
    assert not [f for f in doc["flags"] if f["kind"] == "slow_transfer"], doc["flags"]


def test_a_slow_transfer_is_still_flagged(tmp_path, capsys):
    plan = ct.Plan(world=8, cycles=2, transfer_us=200.0, straggle_us=500.0)
    doc = report_json(make_bundle(tmp_path, plan), capsys)
    flag = next(f for f in doc["flags"] if f["kind"] == "slow_transfer")
    assert "µs each (transfer)" in flag["finding"], flag


# ---- the docs' commands read files a fresh clone has ------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
INPUT_FLAGS = ("--trace", "--nvidia-smi", "--nccl-log", "--perf-table", "--topology", "--env-file")


@pytest.mark.parametrize("doc", ["docs/reference.md", "nccl_configs/README.md", "README.md"])
def test_the_docs_name_no_file_outside_the_repository(doc):
    """Before: docs/reference.md's examples and nccl_configs/README.md read ``../shared/inputs/...``,
    which a clone lacks. Every input a command line names is a file of the repository (or one an
    earlier line writes under /tmp); no text points into ``../shared`` but to say what is not here."""
    text = (REPO / doc).read_text()
    for cmd in readme_commands(text):
        args = shlex.split(cmd)
        for flag, value in zip(args, args[1:]):
            if flag in INPUT_FLAGS and not value.startswith("/tmp/"):
                assert (REPO / value).exists(), f"{doc}: {cmd}: {flag} {value} is not in the repository"
    for line in text.splitlines():
        if "../shared/" in line:
            assert not line.startswith(".venv/bin/fastverify") and "(`../shared" not in line, line


# ---- a verify-log file name with control characters ---------------------------------------------------

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
FORGED = "verify-rank1\x1b[2J\nP2P: proven.jsonl"
SKIP_ALL = [
    a
    for p in ("doctor", "sweep", "p2p_check", "nccl_log", "nvml", "nvidia_smi_topo", "host_iommu")
    for a in ("--skip", p)
]


def test_collect_leaves_out_and_says_a_verify_log_name_with_control_characters(tmp_path, capsys):
    """Before: the name went into the bundle without a word, and the report's draft shape was
    "not read" for the whole verify log (the one name poisoned the folder)."""
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / "verify-rank0.jsonl").write_text(RECORDS)
    (folder / FORGED).write_text(RECORDS)
    out = tmp_path / "v.tar.gz"
    assert main(["collect", *SKIP_ALL, "--verify-log", str(folder), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "leaving out" in ln]
    assert said == [
        f"fastverify: collect: --verify-log {folder}: leaving out 1 file(s) whose name holds control "
        "characters: verify-rank1\\x1b[2J\\nP2P: proven.jsonl"
    ], err
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["manifest.json", "verify-log/verify-rank0.jsonl"]
        manifest = json.loads(tar.extractfile("manifest.json").read())
    part = next(p for p in manifest["parts"] if p["name"] == "verify_log")
    assert part["meta"]["left_out_control_chars"] == ["verify-rank1\\x1b[2J\\nP2P: proven.jsonl"]
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\nP2P: proven" not in text
    assert "draft shape (accept length by depth" in text and "not read" not in text


def test_any_part_leaves_out_a_member_name_with_control_characters(tmp_path):
    """The rule is collect's, not the verify log's: a server trace named so is left out too."""
    from fastverify.collect.core import ok

    f = tmp_path / "t.trace.json"
    f.write_text("{}")
    got = ok({"server/traces/a\x1b]0;x\x07.trace.json": f, "server/traces/b.trace.json": f})
    assert list(got.files) == ["server/traces/b.trace.json"]
    assert got.meta["left_out_control_chars"] == ["server/traces/a\\x1b]0;x\\x07.trace.json"]


# ---- a trace of 0-length (or sub-µs) events -----------------------------------------------------------

ZERO = dict(transfer_us=0, attn_us=0, moe_us=0, draft_us=0, d2h_us=0, host_pause_us=0, late_launch_us=0, straggle_us=0)


def test_a_trace_of_zero_length_events_gets_no_cycle_split_and_no_verdict(tmp_path, capsys):
    """Before: "14 complete cycles per rank; cycle 0.000 ms", then "next: neither helps much: the
    cycle is compute-bound", exit 0."""
    bundle = make_bundle(tmp_path, ct.Plan(world=2, cycles=2, **ZERO))
    doc = report_json(bundle, capsys)
    assert doc["cycles"] is None and doc["answer"] is None and doc["flags"] == []
    assert doc["notes"][0] == (
        "the traces' SGLang step spans (step[VERIFY ...]) all last 0 ns: no time was measured, no cycles to split"
    )
    assert main(["report", str(bundle)]) == 0
    text = capsys.readouterr().out
    assert "next:" not in text and "complete cycles" not in text


def test_a_cycle_under_one_microsecond_is_said_unmeasurable(tmp_path, capsys):
    """Each draft compute 0.5 ns, all else 0: 6 kernels per cycle, a cycle of 0.003 µs."""
    doc = report_json(make_bundle(tmp_path, ct.Plan(world=2, cycles=2, **{**ZERO, "draft_us": 0.0005})), capsys)
    assert doc["cycles"] is None and doc["answer"] is None
    assert doc["notes"][0] == (
        "TP rank 0's cycle lasts 0.003 µs over its 2 complete cycles, below 1 µs, less than "
        "any measured work takes: the trace's times are no measurements; no cycle split "
        "and no verdict"
    )


def test_a_zero_length_draft_stage_does_not_make_each_draft_step_a_cycle(tmp_path, capsys):
    """Draft compute and transfers of 0 µs: the draft stage spans last 0 ns and hold none of their
    steps. Before: every 0 ns draft step counted as a draft forward starting a cycle (14 "cycles"
    of 0 ms in a trace of 2); now 0 ns spans are no forwards and the verify forwards (which take
    time) mark the 2 cycles."""
    doc = report_json(make_bundle(tmp_path, ct.Plan(world=2, cycles=2, transfer_us=0, draft_us=0)), capsys)
    split = doc["cycles"]
    assert split["anchor"] == "verify forward"
    assert [r["cycles"] for r in split["ranks"]] == [2, 2]
    # a verify forward to the next: 4 layers x (150 + 200) µs + 10 µs D2H + 300 µs host pause + 50 µs late launch
    # + the straggler's 80 µs (rank 5 is not in a world of 2: none) = 1760 µs
    assert [r["cycle_mean_us"] for r in split["ranks"]] == [1760.0, 1760.0]


# ---- a key given twice in a bundle's JSON member; P2P results that are none ---------------------------

JSON_MEMBERS = {
    "p2p_check": "p2p.json",
    "doctor": "doctor.json",
    "server_args": "server/server_info.json",
    "sweep": "sweep/tune.json",
    "nvml": "topo/nvml.json",
    "host_iommu": "host/iommu.json",
}


def _bundle_with(tmp: Path, members: dict[str, bytes]) -> Path:
    """A bundle whose parts named in ``members`` (part → bytes) are ok, the others skipped."""
    from fastverify.bundle import PART_NAMES, Manifest, Part, write_bundle

    files, parts = {}, []
    for name in PART_NAMES:
        if name in members:
            files[JSON_MEMBERS[name]] = members[name]
            parts.append(Part(name, "ok", None, (JSON_MEMBERS[name],)))
        else:
            parts.append(Part(name, "skipped", "not in this test"))
    out = tmp / "b.tar.gz"
    write_bundle(
        out,
        Manifest(
            created_utc="2026-12-01T00:00:00Z",
            fastverify_version="test",
            host={"hostname": "box"},
            budget_s=600.0,
            elapsed_s=1.0,
            parts=tuple(parts),
        ),
        files,
    )
    return out


@pytest.mark.parametrize("part", list(JSON_MEMBERS))
def test_a_key_given_twice_in_a_json_member_is_a_note_naming_bundle_member_and_key(tmp_path, capsys, part):
    """Before: the last value held silently (p2p.json's ``"ok": false, "ok": true`` read as a pass)."""
    body = (
        b'[{"src": 0, "dst": 1, "ok": false, "ok": true, "reason": ""}]'
        if part == "p2p_check"
        else b'{"a": {"ok": false, "ok": true}}'
    )
    bundle = _bundle_with(tmp_path, {part: body})
    doc = report_json(bundle, capsys)
    assert (
        f"{part}: not read ({bundle}:{JSON_MEMBERS[part]}: the key 'ok' is given twice in one object; which "
        "value holds is not known)" in doc["notes"]
    ), doc["notes"]


def test_the_p2p_check_document_collect_stores_is_read(tmp_path, capsys):
    """collect stores what ``python -m fastverify.topo.p2p check`` prints: the version-2 document
    with ``results`` inside. Before: "p2p_check: not read (...: an object, not an array)", and a
    failed direction was never flagged."""
    from fastverify.topo.p2p_proof import P2PResult, check_document

    results = {(0, 1): P2PResult(False, "cudaErrorPeerAccessUnsupported", False), (1, 0): P2PResult(True, "", False)}
    gpus = [
        {"cuda": i, "index": i, "pci_bus_id": f"00000000:{i + 1:02x}:00.0", "uuid": f"GPU-{i}", "name": "x"}
        for i in range(2)
    ]
    doc = report_json(
        _bundle_with(tmp_path, {"p2p_check": json.dumps(check_document(results, gpus, {})).encode()}), capsys
    )
    assert not [n for n in doc["notes"] if n.startswith("p2p_check")], doc["notes"]
    flag = next(f for f in doc["flags"] if f["kind"] == "p2p_off")
    assert flag["evidence"][0] == (
        "P2P check: 1 of 2 directions failed, e.g. GPU 1 on GPU 0's memory: cudaErrorPeerAccessUnsupported"
    )


@pytest.mark.parametrize(
    "rows, said",
    [
        (
            [{"src": 10**18, "dst": 1, "ok": False, "reason": "x"}],
            "1 of 1 results left out ({b}:p2p.json: src: 1000000000000000000 is outside [0, 639])",
        ),
        (
            [{"src": 0, "dst": 1, "ok": "yes", "reason": ""}, {"src": 1, "dst": 0, "ok": True, "reason": ""}],
            "1 of 2 results left out ({b}:p2p.json: ok is 'yes', not true or false)",
        ),
        (
            [{"src": 0, "dst": 1, "ok": True, "reason": ""}, {"src": 0, "dst": 1, "ok": False, "reason": "x"}],
            "1 of 2 results left out ({b}:p2p.json: direction (0, 1) given again)",
        ),
    ],
)
def test_p2p_results_that_are_none_are_left_out_with_a_note(tmp_path, capsys, rows, said):
    """Before: such a row vanished without a word (or a GPU 10**18 was quoted as evidence)."""
    bundle = _bundle_with(tmp_path, {"p2p_check": json.dumps(rows).encode()})
    doc = report_json(bundle, capsys)
    assert "p2p_check: " + said.format(b=bundle) in doc["notes"], doc["notes"]
    assert not [f for f in doc["flags"] if f["kind"] == "p2p_off"], doc["flags"]


# ---- collect's flags: a password in --server, a batch size twice --------------------------------------


@pytest.mark.parametrize(
    "url, shown",
    [
        ("http://alice:s3cret@127.0.0.1:30000", "http://***@127.0.0.1:30000"),
        ("alice:s3cret@127.0.0.1:30000", "***@127.0.0.1:30000"),
        ("http://alice:s3 cret@host:1/", "http://***@host:1/"),  # refused for the password before the space
    ],
)
def test_a_server_url_with_a_password_is_refused_without_printing_it(tmp_path, capsys, url, shown):
    """Before: "cannot reach http://alice:s3cret@127.0.0.1:30000: ... Name or service not known"
    after a connection attempt: the password printed."""
    from fastverify.collect.client import normalise_url

    with pytest.raises(UserError) as e:
        normalise_url(url)
    assert str(e.value) == (
        f"--server '{shown}': a URL with a user name or password is not taken (collect writes "
        "the URL into the bundle): give http://host:port"
    )
    assert main(["collect", "--server", url, "--output", str(tmp_path / "b.tar.gz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3" not in err and "alice" not in err, err
    assert not (tmp_path / "b.tar.gz").exists()


def test_a_batch_size_given_twice_is_refused(tmp_path, capsys):
    """Before: ``--batch 4 4`` ran (the sweep timed batch 4 twice)."""
    out = tmp_path / "b.tar.gz"
    assert main(["collect", "--batch", "1", "4", "8", "4", "--skip", "doctor", "--output", str(out)]) == 2
    assert capsys.readouterr().err == (
        "fastverify: error: --batch 1 4 8 4: batch size 4 is given twice; give each verify batch size once\n"
    )
    assert not out.exists()


# ---- a pax time that is no number -------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [("mtime", "abc"), ("mtime", "0x10"), ("mtime", "1_000"), ("atime", "nan")])
def test_a_pax_time_that_is_no_number_is_refused(tmp_path, capsys, key, value):
    """Before: tarfile kept the header's own time for a pax mtime it could not read, and the bundle
    was read (exit 0) where nan, inf and 1e30 were refused."""
    real = make_bundle(tmp_path, None, p2p=[{"src": 0, "dst": 1, "ok": True, "reason": ""}])
    bad = tmp_path / "pax.tar.gz"
    with tarfile.open(real, "r:gz") as a, tarfile.open(bad, "w:gz", format=tarfile.PAX_FORMAT) as b:
        for m in a.getmembers():
            body = a.extractfile(m).read()
            if m.name == "p2p.json":
                m.pax_headers = {key: value}
            b.addfile(m, io.BytesIO(body))
    assert main(["report", str(real)]) == 0
    capsys.readouterr()
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "p2p.json" in err and f"a member time of {value!r} s" in err, err
