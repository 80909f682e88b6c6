"""Issue 34, "the printer escapes text from inputs everywhere it prints", and a closed or full
standard output.

Every text that comes from an input (a bundle's P2P reasons, a deployment record's P2P note and
box, a ``--describe-box`` description, an input file's name) reaches the terminal escaped: no raw
control, C1 or bidi character, and a newline inside it is ``\\n`` on the same line, so it cannot
forge a line of its own. A 300,000-character reason prints in well under a second, shortened with
a marker (rich's highlighter is quadratic on such text). A closed (``>&-``) or full
(``>/dev/full``) stdout is one line on stderr and exit 2 for every command that prints, never a
traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env
from fastverify.cli import main
from fastverify.deploy import BoxFingerprint, DeploymentRecord, P2PFacts, VerifyShapes, encode_record, record_path_for
from fastverify.errors import shown
from fastverify.registry import BackendName
from tests.test_cycle_report import make_bundle

FORGED = "P2P: forged"
HOSTILE = f"a\x1b[2J\x1b]0;title\x07b\n{FORGED}\r\x9b31m\u202eevil\u2028z [/bold] [red]"
"""ESC sequences (clear screen, set the window title), a newline that starts a forged line, a
carriage return, a C1 CSI, a right-to-left override, a line separator, and rich markup."""
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
"""Any character a terminal acts on (C0 but newline, DEL, C1, bidi controls, line separators)."""
TOPO = "        GPU0    GPU1\nGPU0     X      PHB\nGPU1    PHB      X\n"
CMD = ["python", "-m", "sglang.launch_server", "--model-path", "M", "--tp-size", "2"]


def assert_escaped(text: str) -> None:
    """No raw control character, no line that starts with the forged text, and the hostile text
    shown escaped (so it was printed, not dropped)."""
    hit = RAW.search(text)
    assert hit is None, f"raw {hit.group()!r} at {hit.start()}: {text[max(0, hit.start() - 80):hit.start() + 40]!r}"
    assert not [ln for ln in text.splitlines() if ln.lstrip(" │|-").startswith(FORGED)], text
    assert "\\x1b[2J" in text, text


def test_shown_is_one_escaped_capped_line():
    assert shown(HOSTILE) == ("a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil\\u2028z "
                              "[/bold] [red]")
    long = shown("1" * 300_000)
    assert long.startswith("1" * 666 + " … [299,084 characters left out] … ") and long.endswith("1" * 250)
    assert shown("x" * 300_000, limit=None) == "x" * 300_000


def test_report_escapes_the_bundles_p2p_reason(tmp_path, capsys):
    p2p = [{"src": 0, "dst": 1, "ok": False, "reason": HOSTILE}]
    bundle = make_bundle(tmp_path, None, p2p=p2p, nvml={"p2p_read": {"0-1": True}})
    assert main(["report", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert_escaped(out)
    evidence = [ln for ln in out.splitlines() if ln.startswith("    evidence: P2P check")]
    assert len(evidence) == 1 and evidence[0].endswith("\\u202eevil\\u2028z [/bold] [red]")


def test_a_300000_character_reason_prints_at_once_shortened(tmp_path):
    p2p = [{"src": 0, "dst": 1, "ok": False, "reason": "1" * 300_000}]
    bundle = make_bundle(tmp_path, None, p2p=p2p, nvml={"p2p_read": {"0-1": True}})
    cp = subprocess.run([sys.executable, "-m", "fastverify", "report", str(bundle)], env=subprocess_env(),
                        capture_output=True, text=True, timeout=30)  # before: over a minute
    assert cp.returncode == 0, cp.stderr
    line = next(ln for ln in cp.stdout.splitlines() if ln.startswith("    evidence: P2P check"))
    assert "characters left out]" in line and len(line) <= 1000


def _record(tmp_path: Path) -> Path:
    """An env file and its deployment record whose P2P note and GPU name are hostile."""
    env = tmp_path / "box.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(backend=BackendName("nccl"), shapes=VerifyShapes(max_batch=8, draft_tokens=4, hidden=4096),
                           p2p=P2PFacts(ok=True, source="p2p_check", note=HOSTILE, pairs=2),
                           box=BoxFingerprint(gpu_name=HOSTILE, sm=(8, 9), gpu_count=2, tp=2), sglang_version="0.5.23")
    record_path_for(env).write_bytes(encode_record(rec))
    return env


def test_launch_dry_run_escapes_the_record_and_the_described_box(tmp_path, capsys):
    env = _record(tmp_path)
    described = json.dumps({"gpu_name": HOSTILE, "sm": [8, 9], "gpu_count": 2})
    rc = main(["launch", "--env", str(env), "--describe-box", described, "--dry-run", "--", *CMD])
    out, err = capsys.readouterr()
    assert rc in (0, 2), err
    assert_escaped(out)
    assert not RAW.search(err), err
    p2p = [ln for ln in out.splitlines() if ln.startswith("P2P: ")]
    assert p2p == ["P2P: proven (p2p_check: a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil"
                   "\\u2028z [/bold] [red])"]
    assert [ln for ln in out.splitlines() if ln.startswith("box: 2 x ")] == [
        "box: 2 x a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil\\u2028z [/bold] [red] (SM89), "
        "driver unknown"]


def _hostile_file(tmp_path: Path, text: str) -> Path:
    """``text`` in a file whose NAME is hostile (a newline and ESC are legal in a Linux file name)."""
    p = tmp_path / "in\x1b[2J\nP2P: forged\u202e.txt"
    p.write_text(text)
    return p


@pytest.mark.parametrize("argv", [["topo", "--nvidia-smi", "{f}"],
                                  ["tune", "--predict", "--topology", "{f}", "--model", "kimi-k2", "--tp", "2"]])
def test_an_input_files_name_is_escaped(tmp_path, capsys, argv):
    f = _hostile_file(tmp_path, TOPO)
    assert main([a.replace("{f}", str(f)) for a in argv]) == 0
    assert_escaped(capsys.readouterr().out)


def test_doctor_escapes_the_env_files_name(tmp_path, capsys):
    f = _hostile_file(tmp_path, "NOT A SETTING\n")
    main(["doctor", "--quick", "--env-file", str(f)])
    assert_escaped(capsys.readouterr().out)


def _commands(tmp_path: Path) -> dict[str, list[str]]:
    topo = tmp_path / "topo.txt"
    topo.write_text(TOPO)
    env = _record(tmp_path)
    bundle = make_bundle(tmp_path, None, p2p=[{"src": 0, "dst": 1, "ok": True, "reason": ""}])
    return {
        "doctor": ["doctor", "--quick"],
        "tune": ["tune", "--predict", "--topology", str(topo), "--model", "kimi-k2", "--tp", "2"],
        "topo": ["topo", "--nvidia-smi", str(topo)],
        "launch": ["launch", "--env", str(env), "--dry-run", "--", *CMD],
        "report": ["report", str(bundle)],
        "report --json": ["report", str(bundle), "--json"],
        "collect": ["collect", "--budget", "30", "--skip", "doctor", "--output", str(tmp_path / "b.tar.gz")],
    }


@pytest.mark.parametrize("name", ["doctor", "tune", "topo", "launch", "report", "report --json", "collect"])
@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_a_closed_or_full_stdout_is_one_line_and_exit_2(tmp_path, name, stdout):
    argv = [sys.executable, "-m", "fastverify", *_commands(tmp_path)[name]]
    if stdout == "closed":
        cp = subprocess.run(argv, env=subprocess_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.close(1), timeout=300)
        why = "it is closed"
    else:
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full here")
        with open("/dev/full", "w") as full:
            cp = subprocess.run(argv, env=subprocess_env(), cwd=tmp_path, stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=300)
        why = "No space left on device"
    assert "Traceback" not in cp.stderr, cp.stderr
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.splitlines()[-1] == f"fastverify: error: cannot write to standard output ({why})"
    if name != "collect":  # collect says each part on stderr as it goes
        assert len(cp.stderr.splitlines()) == 1, cp.stderr


@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_p2p_without_a_gpu_says_so_in_one_line_whatever_stdout_is(tmp_path, stdout):
    """No GPU here: the one line of the missing GPU, exit 2, never a traceback (on a GPU box the
    check prints its JSON, and a closed or full stdout is the line of the test above)."""
    argv = [sys.executable, "-m", "fastverify", "p2p", "--timeout", "5"]
    kw = ({"preexec_fn": lambda: os.close(1)} if stdout == "closed"
          else {"stdout": open("/dev/full", "w")} if os.path.exists("/dev/full") else None)  # noqa: SIM115
    if kw is None:
        pytest.skip("no /dev/full here")
    try:
        cp = subprocess.run(argv, env=subprocess_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            timeout=300, **kw)
    finally:
        if "stdout" in kw:
            kw["stdout"].close()
    assert "Traceback" not in cp.stderr and cp.returncode == 2, cp.stderr
    assert len(cp.stderr.splitlines()) == 1 and cp.stderr.startswith("fastverify: error: "), cp.stderr


def test_a_reader_that_leaves_ends_the_command_silently():
    """``fastverify ... | head -c 1``: the pipe breaks mid-output. The command stops with SIGPIPE's
    shell code (141) and says nothing, as ``cat`` does; before, a "cannot write" line (or, with no
    guard, a BrokenPipeError traceback)."""
    script = ("import sys\nfrom fastverify.errors import print_guarded\n"
              "sys.exit(print_guarded(lambda: [print('x' * 1000) for _ in range(10_000)] and 0))\n")
    cp = subprocess.run(["bash", "-c", f'"{sys.executable}" -c "$0" | head -c 1 >/dev/null; echo "${{PIPESTATUS[0]}}"',
                         script], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert cp.stdout.strip() == "141" and cp.stderr == "", (cp.stdout, cp.stderr)
