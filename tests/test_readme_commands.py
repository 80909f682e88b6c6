"""Every ``.venv/bin/fastverify`` line in the README and in docs/reference.md is one the README benchmark knows
(``benchmarks/bench_readme.py``): either it runs it as written, or it says why it cannot run here.
A README example that names a file nobody can have, or one the benchmark never ran, fails here."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFIX = ".venv/bin/fastverify "
DOCS = ("README.md", "docs/reference.md")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_readme", REPO / "benchmarks" / "bench_readme.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_readme"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def readme_commands(text: str) -> list[str]:
    """The fastverify command lines of the README's bash blocks: continuations joined, ``# comments``
    and what follows `` -- `` (the wrapped server command) dropped, ``a && b`` split."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ", 1)[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith(PREFIX):
                    cmd = part[len(PREFIX) :]
                    if " -- " in f"{cmd} ":
                        cmd = cmd[: (cmd + " ").index(" -- ") + 3].strip()
                    out.append(" ".join(shlex.split(cmd)))
    return out


def test_every_readme_command_is_known_to_the_readme_benchmark():
    bench = _bench()
    known = {" ".join(shlex.split(c.line)): c for c in bench.COMMANDS}
    cmds = [c for doc in DOCS for c in readme_commands((REPO / doc).read_text())]
    assert len(cmds) >= 15
    unknown = [c for c in cmds if c not in known]
    assert not unknown, f"README lines bench_readme.py neither runs nor explains: {unknown}"


def test_runnable_readme_commands_name_only_files_that_exist_or_that_an_earlier_command_writes():
    import pytest

    if not (REPO.parent / "shared").is_dir():
        pytest.skip(f"{REPO.parent / 'shared'} absent: the README's examples read the real inputs there")
    bench = _bench()
    written: set[str] = set()
    for c in bench.COMMANDS:
        if not c.runs:
            assert c.why, c.key
            continue
        args = shlex.split(c.line)
        for flag, value in zip(args, args[1:]):
            if flag in ("--output", "--write-env", "--write-tuner-config"):
                written.add(value)
                assert not value.startswith("nccl_configs/"), f"{c.key}: writes into a tracked folder ({value})"
        for flag, value in zip(args, args[1:]):
            if flag in (
                "--trace",
                "--nvidia-smi",
                "--nccl-log",
                "--perf-table",
                "--topology",
                "--profile",
                "--env-file",
            ) or (flag == "--model" and value.endswith(".json")):
                assert value in written or (REPO / value).exists(), f"{c.key}: {flag} {value} does not exist"


def test_the_extraction_rule_itself():
    text = (
        "```bash\n.venv/bin/fastverify a --x 1   # comment\n"
        ".venv/bin/fastverify b --y \\\n    2 && .venv/bin/fastverify c\n"
        ".venv/bin/fastverify launch --env e -- python -m sglang --tp 8\nnot a command\n```\n"
    )
    assert readme_commands(text) == ["a --x 1", "b --y 2", "c", "launch --env e --"]
