"""The tune journal and trial records, without starting any process."""

from __future__ import annotations

import pytest

from fastverify.errors import UserError
from fastverify.tune.sweep import JOURNAL_SCHEMA_VERSION, Journal, fingerprint, read_journal
from fastverify.tune.trial import SizeResult, TrialResult, TrialSpec


def _spec(**kw) -> TrialSpec:
    base = dict(
        backend="gloo",
        env={"NCCL_PROTO": "LL"},
        world_size=2,
        device="cpu",
        dtype="bfloat16",
        hidden=64,
        sizes=((64, 2), (512, 4)),
        warmup=1,
        iters=3,
    )
    base.update(kw)
    return TrialSpec(**base)


def _result(spec: TrialSpec) -> TrialResult:
    sizes = tuple(SizeResult(n, n * 2, c, 10.0 + n, 12.0 + n, 0.0) for n, c in spec.sizes)
    return TrialResult(
        spec.trial_id,
        "ok",
        "",
        sizes,
        sum(s.count_per_step * s.median_us for s in sizes),
        "cpu_wall_clock",
        1.0,
        2.0,
        note="CPU/gloo",
    )


def _trials(n: int = 3) -> list[TrialSpec]:
    return [_spec(env={"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": str(i + 1)}) for i in range(n)]


def test_trial_id_is_stable_and_ignores_label_and_key_order():
    a = _spec(env={"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}, label="one")
    b = _spec(env={"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"}, label="two")
    assert a.trial_id == b.trial_id and len(a.trial_id) == 16
    assert _spec(iters=4).trial_id != _spec().trial_id
    assert TrialSpec.from_dict(a.to_dict()) == a


def test_records_round_trip():
    spec = _spec(options={"max_numel": 512}, probe_facts={"p2p_ok": True})
    res = _result(spec)
    assert TrialSpec.from_dict(spec.to_dict()) == spec
    assert TrialResult.from_dict(res.to_dict()) == res


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"world_size": 0}, "world_size"),
        ({"env": {"nccl_proto": "LL"}}, "env"),
        ({"env": {"NCCL_NTHREADS": 64}}, "env"),
        ({"sizes": ()}, "sizes"),
        ({"op": "all_reduce_residual_rmsnorm", "sizes": ((100, 1),)}, "multiple of hidden"),
        ({"iters": 0}, "iters"),
        ({"probe_facts": {"gpu": True}}, "probe_facts"),
    ],
)
def test_bad_spec_is_refused_with_the_field_named(kw, word):
    with pytest.raises(ValueError, match=word):
        _spec(**kw)


def _write(path, trials, n_done):
    """The journal fixture of these tests, written by the current writer: its header is always at
    the schema the reader reads, so a torn or corrupt line below is what a test exercises (a stale
    schema-1 header would be refused first, for its schema)."""
    fp = fingerprint(trials)
    with Journal.open(path, fingerprint=fp, resume=False, trial_ids=[t.trial_id for t in trials]) as j:
        for t in trials[:n_done]:
            j.append(t, _result(t))
    assert read_journal(path).header["schema_version"] == JOURNAL_SCHEMA_VERSION
    return fp


def test_journal_round_trip(tmp_path):
    trials = _trials()
    path = tmp_path / "j.jsonl"
    fp = _write(path, trials, 2)
    got = read_journal(path)
    assert got.fingerprint == fp and got.torn_bytes == 0
    assert [r.spec for r in got.records] == trials[:2]
    assert [r.result for r in got.records] == [_result(t) for t in trials[:2]]


@pytest.mark.parametrize("tail", [b'{"kind": "trial", "spec": {"backe', b"\x00\x00\x00"])
def test_torn_last_line_is_dropped_reported_and_cut_on_resume(tmp_path, tail, caplog):
    trials = _trials()
    path = tmp_path / "j.jsonl"
    fp = _write(path, trials, 2)
    good = path.read_bytes()
    path.write_bytes(good + tail)
    got = read_journal(path)
    assert len(got.records) == 2 and got.torn_bytes == len(tail) and got.good_bytes == len(good)
    assert "torn" in caplog.text
    with Journal.open(path, fingerprint=fp, resume=True) as j:
        assert set(j.done) == {t.trial_id for t in trials[:2]} and j.torn_bytes == len(tail)
        j.append(trials[2], _result(trials[2]))
    again = read_journal(path)
    assert again.torn_bytes == 0 and [r.spec for r in again.records] == trials
    assert path.read_bytes().startswith(good)


def test_complete_but_corrupt_last_line_is_not_taken_for_a_torn_write(tmp_path):
    """A record is written with its newline in one write, so a last line that has its newline but
    does not parse is corruption, not an interrupted write: refuse it rather than drop it."""
    trials = _trials()
    path = tmp_path / "j.jsonl"
    _write(path, trials, 2)
    path.write_bytes(path.read_bytes() + b'{"kind": "tri\n')
    with pytest.raises(UserError, match="line 4 is corrupt"):
        read_journal(path)


def test_torn_header_only_starts_over(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"kind": "head')
    trials = _trials()
    with Journal.open(path, fingerprint=fingerprint(trials), resume=True) as j:
        assert j.done == {}
    assert read_journal(path).fingerprint == fingerprint(trials)


def test_fingerprint_mismatch_on_resume_is_one_line_user_error(tmp_path):
    path = tmp_path / "j.jsonl"
    _write(path, _trials(3), 1)
    with pytest.raises(UserError) as err:
        Journal.open(path, fingerprint=fingerprint(_trials(2)), resume=True)
    msg = str(err.value)
    assert "different sweep" in msg and "\n" not in msg and str(path) in msg
    assert fingerprint(_trials(3), {"model": "a"}) != fingerprint(_trials(3), {"model": "b"})
    assert fingerprint(_trials(3)) == fingerprint(list(reversed(_trials(3))))


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "j.jsonl"
    _write(path, _trials(), 2)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b"garbage"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(UserError, match="line 2 is corrupt"):
        read_journal(path)


def test_not_a_journal(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text('{"hello": 1}\n')
    with pytest.raises(UserError, match="not a fastverify tune journal"):
        Journal.open(path, fingerprint="x", resume=True)


def test_fresh_start_keeps_the_old_journal_as_backup(tmp_path):
    path = tmp_path / "j.jsonl"
    _write(path, _trials(), 2)
    old = path.read_bytes()
    _write(path, _trials(), 0)
    assert (tmp_path / "j.jsonl.bak").read_bytes() == old
    assert read_journal(path).records == ()
