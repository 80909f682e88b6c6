"""Real P2P check: the no-GPU error, the cache, and the child handling (timeout and kill, exit
codes, result parsing) with fake child commands injected through ``child_argv``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import alive, subprocess_env
from hypothesis import HealthCheck, given, settings, strategies as st

from fastverify.errors import UserError
from fastverify.topo import p2p
from fastverify.topo.p2p import (
    P2PResult,
    cache_path,
    check_p2p,
    default_cache_dir,
    fingerprint_of,
    read_cache,
    write_cache,
)
from fastverify.topo.p2p_proof import results_from_json

KEY = {
    "gpus": [["NVIDIA GeForce RTX 4090", "00000000:18:00.0"], ["NVIDIA GeForce RTX 4090", "00000000:28:00.0"]],
    "driver": "NVML (driver 550.54.15)",
    "cuda_visible_devices": None,
    "cuda_device_order": None,
}


def torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def fake_child(tmp_path: Path, body: str):
    """child_argv running ``body`` with I, J, OUT and LOG (a file each run appends a line to)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys, time\nI, J, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
        f"LOG = {str(tmp_path / 'runs.log')!r}\n"
        "open(LOG, 'a').write(f'{I}-{J}\\n')\n" + textwrap.dedent(body)
    )

    def argv(i: int, j: int, out: Path) -> list[str]:
        return [sys.executable, str(script), str(i), str(j), str(out)]

    return argv


OK_BODY = """
rows = [{"src": I, "dst": J, "ok": True, "reason": f"fine {I}->{J}"},
        {"src": J, "dst": I, "ok": I != 0, "reason": f"bad {J}->{I}"}]
print("log line on stdout"); print("log line on stderr", file=sys.stderr)
json.dump({"results": rows}, open(OUT, "w"))
"""


def runs(tmp_path: Path) -> list[str]:
    log = tmp_path / "runs.log"
    return log.read_text().split() if log.exists() else []


# --- no GPU ------------------------------------------------------------------------------------


def test_no_cuda_user_error(tmp_path):
    if torch_has_cuda():
        pytest.skip("CUDA present")
    with pytest.raises(UserError, match=r"^no CUDA GPUs: the real P2P check needs a GPU box"):
        check_p2p(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_no_cuda_command_line(tmp_path):
    if torch_has_cuda():
        pytest.skip("CUDA present")
    proc = subprocess.run(
        [sys.executable, "-m", "fastverify.topo.p2p", "check", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == "error: no CUDA GPUs: the real P2P check needs a GPU box\n"


def test_real_pair_child_without_cuda_reports_both_directions(tmp_path):
    """The real pair child and its two side processes, on a box without CUDA: each side fails to
    allocate, says so through its files, and the pair child turns that into both results."""
    if torch_has_cuda():
        pytest.skip("CUDA present")
    out = tmp_path / "pair.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fastverify.topo.p2p", "pair", "0", "1", str(out), "--timeout", "60"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["src"], r["dst"], r["ok"]) for r in rows] == [(0, 1, False), (1, 0, False)]
    assert "GPU 1 could not share a buffer" in rows[0]["reason"]  # GPU 1 accesses GPU 0's memory
    assert "GPU 0 could not share a buffer" in rows[1]["reason"]


# --- cache -----------------------------------------------------------------------------------------


def test_results_are_cached(tmp_path):
    argv = fake_child(tmp_path, OK_BODY)
    cache = tmp_path / "cache"
    first = check_p2p(n_gpus=3, key=KEY, child_argv=argv, cache_dir=cache)
    assert sorted(runs(tmp_path)) == ["0-1", "0-2", "1-2"]
    assert first == {
        (0, 1): P2PResult(True, "fine 0->1"),
        (1, 0): P2PResult(False, "bad 1->0"),
        (0, 2): P2PResult(True, "fine 0->2"),
        (2, 0): P2PResult(False, "bad 2->0"),
        (1, 2): P2PResult(True, "fine 1->2"),
        (2, 1): P2PResult(True, "bad 2->1"),
    }
    path = cache / f"p2p-{fingerprint_of(KEY)}.json"
    assert path == cache_path(KEY, cache) and path.exists()
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 1 and doc["fingerprint"] == fingerprint_of(KEY) and doc["box"] == KEY
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left behind

    again = check_p2p(n_gpus=3, key=KEY, child_argv=argv, cache_dir=cache)
    assert again == first
    assert len(runs(tmp_path)) == 3  # nothing rerun
    subset = check_p2p(n_gpus=3, pairs=[(2, 1)], key=KEY, child_argv=argv, cache_dir=cache)
    assert subset == {(1, 2): first[(1, 2)], (2, 1): first[(2, 1)]}
    assert len(runs(tmp_path)) == 3


def test_other_box_recomputes(tmp_path):
    argv = fake_child(tmp_path, OK_BODY)
    check_p2p(n_gpus=2, key=KEY, child_argv=argv, cache_dir=tmp_path / "c")
    other = dict(KEY, driver="NVML (driver 560.35.03)")
    assert fingerprint_of(other) != fingerprint_of(KEY)
    check_p2p(n_gpus=2, key=other, child_argv=argv, cache_dir=tmp_path / "c")
    assert runs(tmp_path) == ["0-1", "0-1"]
    assert len(list((tmp_path / "c").iterdir())) == 2
    visible = dict(KEY, cuda_visible_devices="1,0")
    assert fingerprint_of(visible) != fingerprint_of(KEY)


def test_a_changed_kernel_command_line_or_driver_misses_the_cache(tmp_path, monkeypatch):
    """box_key reads /proc/cmdline (IOMMU/ACS switches) and the kernel module's version line: a
    change to either, with the same GPUs and NVML driver string, must test P2P again."""
    from types import SimpleNamespace

    gpus = [SimpleNamespace(name=n, pci_bus_id=b) for n, b in KEY["gpus"]]
    monkeypatch.setattr(
        p2p.topo_nvml, "read_nvml_topology", lambda nvml=None: SimpleNamespace(gpus=gpus, source=KEY["driver"])
    )
    cmdline, module = tmp_path / "cmdline", tmp_path / "version"
    monkeypatch.setattr(p2p, "CMDLINE_PATH", str(cmdline), raising=False)
    monkeypatch.setattr(p2p, "NVIDIA_VERSION_PATH", str(module), raising=False)
    cmdline.write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro\n")
    module.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\nGCC version\n")
    argv = fake_child(tmp_path, OK_BODY)
    cache = tmp_path / "c"

    def check() -> None:
        check_p2p(n_gpus=2, key=p2p.box_key(), child_argv=argv, cache_dir=cache)

    check()
    check()
    assert runs(tmp_path) == ["0-1"]  # same box: the cached "ok" is used
    cmdline.write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro intel_iommu=on pcie_acs_override=downstream\n")
    check()
    assert runs(tmp_path) == ["0-1", "0-1"]  # IOMMU/ACS changed: tested again
    module.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  560.35.03  Fri Aug 16 2024\n")
    check()
    assert runs(tmp_path) == ["0-1", "0-1", "0-1"]  # driver module changed: tested again
    check()
    assert len(runs(tmp_path)) == 3


@pytest.mark.parametrize(
    "content", ["not json", "[]", '{"schema_version": 1}', "\x00\xff", "WRONG_BOX", "OLD_SCHEMA", "BAD_ROWS"]
)
def test_unusable_cache_file_recomputes(tmp_path, content):
    argv = fake_child(tmp_path, OK_BODY)
    path = cache_path(KEY, tmp_path / "c")
    path.parent.mkdir()
    good = {
        "schema_version": 1,
        "fingerprint": fingerprint_of(KEY),
        "box": KEY,
        "results": [
            {"src": 0, "dst": 1, "ok": True, "reason": "cached"},
            {"src": 1, "dst": 0, "ok": True, "reason": "c"},
        ],
    }
    if content == "WRONG_BOX":
        content = json.dumps(dict(good, box=dict(KEY, driver="other")))
    elif content == "OLD_SCHEMA":
        content = json.dumps(dict(good, schema_version=0))
    elif content == "BAD_ROWS":
        content = json.dumps(dict(good, results=[{"src": "0", "dst": 1, "ok": True, "reason": "x"}]))
    path.write_text(content, errors="surrogateescape")
    result = check_p2p(n_gpus=2, key=KEY, child_argv=argv, cache_dir=tmp_path / "c")
    assert runs(tmp_path) == ["0-1"]
    assert result[(0, 1)] == P2PResult(True, "fine 0->1")
    assert read_cache(path, KEY) == result  # rewritten, valid


def test_refresh_and_env_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTVERIFY_CACHE_DIR", str(tmp_path / "envcache"))
    argv = fake_child(tmp_path, OK_BODY)
    check_p2p(n_gpus=2, key=KEY, child_argv=argv)
    assert (tmp_path / "envcache" / f"p2p-{fingerprint_of(KEY)}.json").exists()
    check_p2p(n_gpus=2, key=KEY, child_argv=argv)
    check_p2p(n_gpus=2, key=KEY, child_argv=argv, refresh=True)
    assert runs(tmp_path) == ["0-1", "0-1"]


def test_write_cache_round_trip_and_default_dir(tmp_path, monkeypatch):
    results = {
        (0, 1): P2PResult(False, "read back zeros"),
        (1, 0): P2PResult(True, "ok"),
        (0, 2): P2PResult(False, "timeout: x", timed_out=True),
    }
    write_cache(tmp_path / "d" / "p.json", KEY, results)
    assert read_cache(tmp_path / "d" / "p.json", KEY) == {p: results[p] for p in ((0, 1), (1, 0))}  # no timeout
    assert read_cache(tmp_path / "d" / "p.json", dict(KEY, driver=None)) == {}
    assert read_cache(tmp_path / "missing.json", KEY) == {}
    monkeypatch.delenv("FASTVERIFY_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "fastverify"


# --- child handling ---------------------------------------------------------------------------------


def test_hang_is_killed_with_its_process_group(tmp_path):
    body = f"""
import subprocess
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({str(tmp_path / "grandchild.pid")!r}, "w").write(str(grandchild.pid))
time.sleep(600)
"""
    argv = fake_child(tmp_path, body)
    start = time.monotonic()
    result = check_p2p(n_gpus=2, key=KEY, child_argv=argv, cache_dir=tmp_path / "c", timeout_s=2)
    assert time.monotonic() - start < 30
    assert set(result) == {(0, 1), (1, 0)}
    for r in result.values():
        assert r.ok is False and r.reason.startswith("timeout") and r.timed_out and r.status == "timeout"
    pid = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    assert not alive(pid)


def test_ctrl_c_cancels_queued_pairs_and_stops_the_running_children(tmp_path):
    """Six pairs of 3 s each, four at a time: SIGINT at 1 s must return within ~2 s (not after the
    queued pairs ran), raise KeyboardInterrupt, and leave no pair child running."""
    import signal

    pids = tmp_path / "pids"
    pids.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from fastverify.topo.p2p import check_p2p
        BODY = ("import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); "
                "time.sleep(3)")
        def argv(i, j, out):
            return [sys.executable, "-c", BODY, {str(pids)!r}]
        try:
            check_p2p(n_gpus=4, key={{"box": "t"}}, child_argv=argv, cache_dir={str(tmp_path / "c")!r},
                      timeout_s=60, max_parallel=4)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0)
    """)
    )
    proc = subprocess.Popen([sys.executable, str(driver)], env=subprocess_env())
    deadline = time.monotonic() + 20
    while len(list(pids.iterdir())) < 4 and time.monotonic() < deadline:  # the first four pairs run
        time.sleep(0.05)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert rc == 130
    assert took < 2.0, f"returned {took:.1f} s after SIGINT"
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 4  # the two queued pairs never started
    assert not [pid for pid in started if alive(pid)]


def test_pairs_run_in_parallel_and_each_has_its_own_timeout(tmp_path):
    argv = fake_child(tmp_path, "time.sleep(600) if (I, J) == (0, 3) else None\n" + OK_BODY)
    start = time.monotonic()
    result = check_p2p(n_gpus=4, key=KEY, child_argv=argv, cache_dir=tmp_path / "c", timeout_s=3, max_parallel=6)
    assert time.monotonic() - start < 30
    assert len(result) == 12
    assert result[(0, 3)].reason.startswith("timeout") and result[(3, 0)].reason.startswith("timeout")
    assert result[(1, 2)] == P2PResult(True, "fine 1->2")


CHILD_FAILURES = [
    (
        "exit",
        "print('warming up'); print('Traceback ...', file=sys.stderr)\nprint('RuntimeError: CUDA error: peer "
        "mapping resources exhausted', file=sys.stderr); sys.exit(3)",
        "check process failed (exit code 3): RuntimeError: CUDA error: peer mapping resources exhausted",
    ),
    (
        "signal",
        "import signal; os.kill(os.getpid(), signal.SIGKILL)",
        "check process failed (killed by signal 9): no output",
    ),
    ("no_file", "pass", "check process wrote no readable result"),
    ("bad_json", "open(OUT, 'w').write('{truncated')", "check process wrote no readable result"),
    ("bad_shape", "json.dump({'results': {'0-1': True}}, open(OUT, 'w'))", "check process wrote no readable result"),
    (
        "bad_row",
        "json.dump({'results': [{'src': I, 'dst': J, 'ok': 'yes', 'reason': ''}]}, open(OUT, 'w'))",
        "check process wrote no readable result",
    ),
]


@pytest.mark.parametrize("name,body,reason", CHILD_FAILURES, ids=[c[0] for c in CHILD_FAILURES])
def test_child_failures(tmp_path, name, body, reason):
    result = check_p2p(n_gpus=2, key=KEY, child_argv=fake_child(tmp_path, body), cache_dir=tmp_path / "c", timeout_s=30)
    assert set(result) == {(0, 1), (1, 0)}
    for r in result.values():
        assert r.ok is False and r.reason.startswith(reason), r.reason
        assert "\n" not in r.reason


def test_child_gives_one_direction_only(tmp_path):
    body = "json.dump({'results': [{'src': J, 'dst': I, 'ok': True, 'reason': 'multi\\nline'}]}, open(OUT, 'w'))"
    result = check_p2p(n_gpus=2, key=KEY, child_argv=fake_child(tmp_path, body), cache_dir=tmp_path / "c")
    assert result[(1, 0)] == P2PResult(True, "multi line")
    assert result[(0, 1)] == P2PResult(False, "check process gave no result for this direction")


def test_child_that_cannot_start(tmp_path):
    result = check_p2p(
        n_gpus=2, key=KEY, child_argv=lambda i, j, out: [str(tmp_path / "no-such-program")], cache_dir=tmp_path / "c"
    )
    assert result[(0, 1)].ok is False and result[(0, 1)].reason.startswith("could not start the check")


def test_bad_pairs(tmp_path):
    argv = fake_child(tmp_path, OK_BODY)
    for pairs in ([(0, 0)], [(0, 2)], [(-1, 0)]):
        with pytest.raises(ValueError, match="not two different GPUs"):
            check_p2p(n_gpus=2, pairs=pairs, key=KEY, child_argv=argv, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="n_gpus"):
        check_p2p(key=KEY, child_argv=argv, cache_dir=tmp_path)


def test_default_child_argv():
    argv = p2p.default_child_argv(100)(2, 5, Path("/tmp/x.json"))
    assert argv[:4] == [sys.executable, "-m", "fastverify.topo.p2p", "pair"]
    assert argv[4:7] == ["2", "5", "/tmp/x.json"] and argv[7] == "--timeout" and float(argv[8]) < 100


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["src", "dst", "ok", "reason", "x"]), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(json_values)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_result_rows_parse_or_value_error(rows):
    try:
        out = results_from_json(rows)
    except ValueError:
        return
    assert all(isinstance(r, P2PResult) for r in out.values())


# --- a timeout is its own status: said as such, never cached, retried -------------------------------

# Hangs on its first run of each pair (no answer within the timeout), answers on later runs.
SLOW_FIRST_BODY = f"""
first = not os.path.exists(os.path.join(os.path.dirname(LOG), f"seen-{{I}}-{{J}}"))
open(os.path.join(os.path.dirname(LOG), f"seen-{{I}}-{{J}}"), "w").close()
if first and (I, J) == (0, 1):
    time.sleep(600)
{OK_BODY}"""


def test_a_timeout_is_not_cached_and_is_retried_next_run(tmp_path):
    argv = fake_child(tmp_path, SLOW_FIRST_BODY)
    cache = tmp_path / "cache"
    first = check_p2p(n_gpus=3, key=KEY, child_argv=argv, cache_dir=cache, timeout_s=3)
    assert [first[p].status for p in ((0, 1), (1, 0))] == ["timeout", "timeout"]
    assert first[(0, 2)] == P2PResult(True, "fine 0->2") and first[(2, 0)].status == "failed"
    doc = json.loads(cache_path(KEY, cache).read_text())
    assert sorted((r["src"], r["dst"]) for r in doc["results"]) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    second = check_p2p(n_gpus=3, key=KEY, child_argv=argv, cache_dir=cache, timeout_s=3)  # no --refresh
    assert sorted(runs(tmp_path)) == ["0-1", "0-1", "0-2", "1-2"]  # only the pair that timed out ran again
    assert second[(0, 1)] == P2PResult(True, "fine 0->1") and second[(1, 0)] == P2PResult(False, "bad 1->0")
    assert read_cache(cache_path(KEY, cache), KEY) == second  # now all cached


def test_a_timeout_cached_by_an_older_fastverify_is_retried(tmp_path):
    """Cache files written before timeouts had their own status hold them as plain failures
    (reason "timeout: ..."): they are not reused either."""
    path = cache_path(KEY, tmp_path / "c")
    path.parent.mkdir()
    old = [
        {
            "src": 0,
            "dst": 1,
            "ok": False,
            "reason": "timeout: no answer within 5 s (P2P access hung or the child stalled)",
        },
        {"src": 1, "dst": 0, "ok": False, "reason": "timeout waiting for GPU 0's buffer"},
    ]
    path.write_text(json.dumps({"schema_version": 1, "fingerprint": fingerprint_of(KEY), "box": KEY, "results": old}))
    result = check_p2p(n_gpus=2, key=KEY, child_argv=fake_child(tmp_path, OK_BODY), cache_dir=tmp_path / "c")
    assert runs(tmp_path) == ["0-1"]
    assert result[(0, 1)] == P2PResult(True, "fine 0->1")


def test_the_check_says_timeouts_as_such(tmp_path, monkeypatch, capsys):
    """`fastverify p2p --output`: the summary line counts passes, failures and timeouts apart, and
    the file marks each timed-out direction."""
    results = {
        (0, 1): P2PResult(True, "ok"),
        (1, 0): P2PResult(False, "read back zeros"),
        (0, 2): P2PResult(False, "timeout: x", timed_out=True),
        (2, 0): P2PResult(False, "timeout: x", True),
        (1, 2): P2PResult(True, "ok"),
        (2, 1): P2PResult(True, "ok"),
    }
    monkeypatch.setattr(p2p, "gpu_count_or_fail", lambda: 3)
    monkeypatch.setattr(
        p2p,
        "gpu_identities",
        lambda: [
            {"cuda": k, "index": k, "pci_bus_id": f"00000000:1{k}:00.0", "uuid": f"GPU-{k}", "name": "x"}
            for k in range(3)
        ],
    )
    monkeypatch.setattr(p2p, "check_p2p", lambda **kw: results)
    out = tmp_path / "p2p.json"
    assert p2p.run_check_command(output=out, timeout_s=120, refresh=False) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        "P2P: 3 of 6 ordered GPU pairs passed, 1 failed, 2 timed out (no answer in time: not a failure, not cached;"
    ) and line.endswith(f"; wrote {out}")
    rows = {(r["src"], r["dst"]): r for r in json.loads(out.read_text())["results"]}
    assert [p for p, r in sorted(rows.items()) if r.get("timed_out")] == [(0, 2), (2, 0)]
    assert rows[(1, 0)]["ok"] is False and "timed_out" not in rows[(1, 0)]


def test_a_side_that_waits_in_vain_reports_a_timeout(tmp_path, monkeypatch):
    """The side process (real code, its buffer stood in for): the peer never publishes, so both of
    its report entries are timeouts, not failures."""
    pytest.importorskip("torch")
    monkeypatch.setattr(p2p, "publish_buffer", lambda torch, me, gpu, workdir: object())
    p2p.run_side("a", "b", 0, 1, tmp_path, 0.3)
    report = json.loads((tmp_path / "a.report.json").read_text())
    for entry in ("access", "own"):
        assert report[entry]["ok"] is False and report[entry]["timed_out"] is True, report
        assert report[entry]["reason"].startswith("timeout waiting for GPU 1")


@pytest.mark.parametrize("seconds", [5, 35])
def test_a_per_pair_timeout_under_a_torch_import_is_refused(seconds, capsys):
    from fastverify.bounds import MIN_P2P_SIDE_S

    assert p2p.main(["check", "--timeout", str(seconds)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --timeout {seconds}: under ") and "import torch" in err and err.count("\n") == 1
    assert 0.9 * p2p.MIN_TIMEOUT_S - 2.0 >= MIN_P2P_SIDE_S  # the least allowed still gives a side its floor


def test_output_over_a_file_that_is_not_a_p2p_check_is_refused_before_the_check(tmp_path):
    """``--output`` writes a new file (an existing one only with --force): an env file there is left
    alone, and the refusal comes before any GPU is touched."""
    env = tmp_path / "box.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    with pytest.raises(UserError, match=r"exists; fastverify never writes over a file: .* --force"):
        p2p.run_check_command(output=env, timeout_s=120.0, refresh=False)
    assert env.read_text() == "NCCL_P2P_LEVEL=SYS\n"
