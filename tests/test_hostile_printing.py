"""Issue 34, "the printer escapes text from inputs everywhere it prints", and a closed or full
standard output (collect's, whose bundle is its output: tests/test_hostile_remainder.py).

Every text that comes from an input (a bundle's P2P reasons, a deployment record's P2P note and
box, a ``--describe-box`` description, an input file's name) reaches the terminal escaped: no raw
control, C1 or bidi character, and a newline inside it is ``\\n`` on the same line, so it cannot
forge a line of its own. A 300,000-character reason prints in well under a second, shortened with
a marker (rich's highlighter is quadratic on such text). A closed (``>&-``) or full
(``>/dev/full``) stdout is one line on stderr and exit 2 for every command that prints, never a
traceback.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_with_stdout, subprocess_env

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
    assert hit is None, f"raw {hit.group()!r} at {hit.start()}: {text[max(0, hit.start() - 80) : hit.start() + 40]!r}"
    assert not [ln for ln in text.splitlines() if ln.lstrip(" │|-").startswith(FORGED)], text
    assert "\\x1b[2J" in text, text


def test_shown_is_one_escaped_capped_line():
    assert shown(HOSTILE) == (
        "a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil\\u2028z [/bold] [red]"
    )
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
    cp = subprocess.run(
        [sys.executable, "-m", "fastverify", "report", str(bundle)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )  # before: over a minute
    assert cp.returncode == 0, cp.stderr
    line = next(ln for ln in cp.stdout.splitlines() if ln.startswith("    evidence: P2P check"))
    assert "characters left out]" in line and len(line) <= 1000


def _record(tmp_path: Path) -> Path:
    """An env file and its deployment record whose P2P note and GPU name are hostile."""
    env = tmp_path / "box.env"
    env.write_text("NCCL_P2P_LEVEL=SYS\n")
    rec = DeploymentRecord(
        backend=BackendName("nccl"),
        shapes=VerifyShapes(max_batch=8, draft_tokens=4, hidden=4096),
        p2p=P2PFacts(ok=True, source="p2p_check", note=HOSTILE, pairs=2),
        box=BoxFingerprint(gpu_name=HOSTILE, sm=(8, 9), gpu_count=2, tp=2),
        sglang_version="0.5.23",
    )
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
    assert p2p == [
        "P2P: proven (p2p_check: a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil"
        "\\u2028z [/bold] [red])"
    ]
    assert [ln for ln in out.splitlines() if ln.startswith("box: 2 x ")] == [
        "box: 2 x a\\x1b[2J\\x1b]0;title\\x07b\\nP2P: forged\\x0d\\x9b31m\\u202eevil\\u2028z [/bold] [red] (SM89), "
        "driver unknown"
    ]


def _hostile_file(tmp_path: Path, text: str) -> Path:
    """``text`` in a file whose NAME is hostile (a newline and ESC are legal in a Linux file name)."""
    p = tmp_path / "in\x1b[2J\nP2P: forged\u202e.txt"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "argv",
    [["topo", "--nvidia-smi", "{f}"], ["tune", "--predict", "--topology", "{f}", "--model", "kimi-k2", "--tp", "2"]],
)
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
    }


@pytest.mark.parametrize("name", ["doctor", "tune", "topo", "launch", "report", "report --json"])
@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_a_closed_or_full_stdout_is_one_line_and_exit_2(tmp_path, name, stdout):
    argv = [sys.executable, "-m", "fastverify", *_commands(tmp_path)[name]]
    cp, why = run_with_stdout(argv, tmp_path, stdout)
    assert "Traceback" not in cp.stderr, cp.stderr
    assert cp.returncode == 2, cp.stderr
    assert cp.stderr.splitlines()[-1] == f"fastverify: error: cannot write to standard output ({why})"
    assert len(cp.stderr.splitlines()) == 1, cp.stderr  # collect: tests/test_hostile_remainder.py


@pytest.mark.parametrize("stdout", ["closed", "full"])
def test_p2p_without_a_gpu_says_so_in_one_line_whatever_stdout_is(tmp_path, stdout):
    """No GPU here: the one line of the missing GPU, exit 2, never a traceback (on a GPU box the
    check prints its JSON, and a closed or full stdout is the line of the test above)."""
    argv = [sys.executable, "-m", "fastverify", "p2p", "--timeout", "5"]
    kw = (
        {"preexec_fn": lambda: os.close(1)}
        if stdout == "closed"
        else {"stdout": open("/dev/full", "w")}
        if os.path.exists("/dev/full")
        else None
    )  # noqa: SIM115
    if kw is None:
        pytest.skip("no /dev/full here")
    try:
        cp = subprocess.run(
            argv, env=subprocess_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True, timeout=300, **kw
        )
    finally:
        if "stdout" in kw:
            kw["stdout"].close()
    assert "Traceback" not in cp.stderr and cp.returncode == 2, cp.stderr
    assert len(cp.stderr.splitlines()) == 1 and cp.stderr.startswith("fastverify: error: "), cp.stderr


def test_a_reader_that_leaves_ends_the_command_silently():
    """``fastverify ... | head -c 1``: the pipe breaks mid-output. The command stops with SIGPIPE's
    shell code (141) and says nothing, as ``cat`` does; before, a "cannot write" line (or, with no
    guard, a BrokenPipeError traceback)."""
    script = (
        "import sys\nfrom fastverify.errors import print_guarded\n"
        "sys.exit(print_guarded(lambda: [print('x' * 1000) for _ in range(10_000)] and 0))\n"
    )
    cp = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -c "$0" | head -c 1 >/dev/null; echo "${{PIPESTATUS[0]}}"', script],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert cp.stdout.strip() == "141" and cp.stderr == "", (cp.stdout, cp.stderr)


# -- by rule: every print site in fastverify/ shows input text only through the escaping helpers --

ESCAPERS = {"shown", "say", "cell", "printable", "path_text", "one_line"}
"""fastverify.errors/fastverify.console functions whose result is terminal-safe text."""
NUMERIC = {"len", "int", "float", "round"}
NUMERIC_SPEC = set("bcdeEfFgGnoxX%,_")
"""The last character of a format spec that only a number accepts (``{x:.1f}``, ``{n:,d}``)."""
ALLOWED = {
    ("cli.py", "f'fastverify: stopped by {signal.Signals(e.signum).name}\\n'"): "the name of a signal, from the "
    "signal module (SIGTERM)",
    (
        "patch/sitecustomize/sitecustomize.py",
        "f'fastverify patch: import hook could not run the patch ({err})\\n'",
    ): "the import hook inside the SGLang server: an error of fastverify's own patch, kept as short as "
    "possible (no import there but the patch's own)",
}
"""(module, the argument's source) printed without escaping, with the reason. JSON documents
(``json.dumps``, ``orjson.dumps``, ``msgspec.json``) pass by rule: every JSON encoder writes the
C0 controls and the newline as escapes, so a document can neither move the cursor nor forge a line
(it keeps C1 and bidi characters as data: it is for programs)."""
JSON_CALLS = {"orjson.dumps", "json.dumps", "msgspec.json.encode", "msgspec.json.format"}


def _callee(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _print_like(call: ast.Call) -> bool:
    f = call.func
    return (
        (isinstance(f, ast.Name) and f.id == "print")
        or (isinstance(f, ast.Attribute) and f.attr in ("print", "add_row"))
        or _callee(call) in ("sys.stdout.write", "sys.stderr.write")
    )


class _Checker:
    """Is an expression terminal-safe text? A literal; a number (a format spec only numbers take,
    ``len``/``int``/``float``/``round``); a call of an escaper; an f-string, ``+``, ``a if c else
    b``, ``a or b``, a list, ``*``, a comprehension or a literal's ``.join`` of such parts,
    ``map(cell, ...)``, a JSON encoder's output (:data:`ALLOWED`), a ``Text`` of a safe text, a
    ``Table`` (its cells are checked at ``add_row``); a name whose every assignment (and
    ``.append``/``.insert``) in the function is; a call of a function of the same module whose
    every return is."""

    def __init__(self, tree: ast.Module) -> None:
        self.funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.busy: set[str] = set()

    def safe(self, e: ast.AST, scope: ast.AST) -> bool:
        if isinstance(e, ast.Constant):
            return True
        if isinstance(e, ast.JoinedStr):
            return all(self.safe(v, scope) for v in e.values)
        if isinstance(e, ast.FormattedValue):
            spec = e.format_spec
            if (
                spec is not None
                and isinstance(spec, ast.JoinedStr)
                and spec.values
                and isinstance(spec.values[-1], ast.Constant)
                and str(spec.values[-1].value)[-1:] in NUMERIC_SPEC
            ):
                return True
            return self.safe(e.value, scope)
        if isinstance(e, ast.BinOp):
            return self.safe(e.left, scope) and self.safe(e.right, scope)
        if isinstance(e, ast.IfExp):
            return self.safe(e.body, scope) and self.safe(e.orelse, scope)
        if isinstance(e, ast.Name):
            return self._name(e.id, scope)
        if isinstance(e, ast.BoolOp):
            return all(self.safe(v, scope) for v in e.values)
        if isinstance(e, (ast.ListComp, ast.GeneratorExp)):
            return self.safe(e.elt, scope)
        if isinstance(e, (ast.List, ast.Tuple)):
            return all(self.safe(v, scope) for v in e.elts)
        if isinstance(e, ast.Starred):
            return self.safe(e.value, scope)
        if isinstance(e, ast.Call) and _callee(e) == "map" and e.args:
            return isinstance(e.args[0], ast.Name) and e.args[0].id in ESCAPERS
        if isinstance(e, ast.Call):
            return self._call(e, scope)
        return False

    def _call(self, e: ast.Call, scope: ast.AST) -> bool:
        name = _callee(e).rsplit(".", 1)[-1]
        if name in ESCAPERS or name in NUMERIC or _callee(e) in JSON_CALLS or name == "Table":
            return True
        if name == "Text":
            return all(self.safe(a, scope) for a in e.args[:1])
        if name == "join" and isinstance(e.func, ast.Attribute) and isinstance(e.func.value, ast.Constant):
            return all(self.safe(a, scope) for a in e.args)
        if name == "decode" and isinstance(e.func, ast.Attribute):
            return self.safe(e.func.value, scope)
        fn = self.funcs.get(name) if isinstance(e.func, ast.Name) else None
        if fn is None or name in self.busy:
            return False
        self.busy.add(name)
        try:
            rets = [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]
            return bool(rets) and all(self.safe(r, fn) for r in rets)
        finally:
            self.busy.discard(name)

    def _name(self, name: str, scope: ast.AST) -> bool:
        values = [
            n.value
            for n in ast.walk(scope)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        ]
        values += [
            n.value
            for n in ast.walk(scope)
            if isinstance(n, ast.AnnAssign)
            and n.value is not None
            and isinstance(n.target, ast.Name)
            and n.target.id == name
        ]
        values += [
            n.args[-1]
            for n in ast.walk(scope)
            if isinstance(n, ast.Call)
            and n.args
            and _callee(n) in (f"{name}.append", f"{name}.extend", f"{name}.insert")
        ]
        if name in self.busy or not values:
            return False
        self.busy.add(name)
        try:
            return all(self.safe(v, scope) for v in values)
        finally:
            self.busy.discard(name)


def _print_sites():
    """(module, line, callee, source of the call, [unsafe arguments]) of each print-like call."""
    root = Path(__file__).resolve().parent.parent / "fastverify"
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        check = _Checker(tree)
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _print_like(node)):
                continue
            scope = min(
                (s for s in scopes if s.lineno <= node.lineno <= s.end_lineno),
                key=lambda s: s.end_lineno - s.lineno,
                default=tree,
            )
            args = list(node.args) + [k.value for k in node.keywords if k.arg in (None, "sep", "end")]
            bad = [ast.unparse(a) for a in args if not check.safe(a, scope)]
            yield path.relative_to(root).as_posix(), node.lineno, _callee(node), bad


def test_every_print_site_escapes_text_from_inputs():
    """Each argument of a ``print``, ``console.print``, ``Table.add_row`` or ``sys.stdout/stderr.write``
    in fastverify/ is terminal-safe by the rule of :class:`_Checker`, or the call is in
    :data:`ALLOWED` with its reason."""
    found = [
        f"fastverify/{mod}:{line}: {callee}({', '.join(bad)})"
        for mod, line, callee, bad in _print_sites()
        if any((mod, b) not in ALLOWED for b in bad)
    ]
    assert not found, "print sites that may print raw input text:\n" + "\n".join(found)


def test_the_allow_list_names_only_sites_that_exist_and_need_it():
    sites = {(mod, b) for mod, _, _, bad in _print_sites() for b in bad}
    assert set(ALLOWED) <= sites, set(ALLOWED) - sites


@pytest.mark.parametrize("closed", ["1", "2"])
def test_a_file_opened_after_a_closed_stdout_or_stderr_never_takes_its_number(tmp_path, closed):
    """With ``>&-`` or ``2>&-``, the next file a command opens would get descriptor 1 or 2, and
    output or progress meant for the terminal would land in it; print_guarded puts /dev/null there
    first."""
    script = (
        "import os, sys\nfrom fastverify.errors import print_guarded\n"
        f"def cmd():\n    fd = os.open({str(tmp_path / 'f')!r}, os.O_WRONLY | os.O_CREAT)\n"
        f"    open({str(tmp_path / 'fd')!r}, 'w').write(str(fd))\n    return 0\n"
        "sys.exit(print_guarded(cmd))\n"
    )
    cp = subprocess.run(
        ["bash", "-c", f'"{sys.executable}" -c "$0" {closed}>&-', script], env=subprocess_env(), timeout=60
    )
    assert cp.returncode == 0 and int((tmp_path / "fd").read_text()) > 2
