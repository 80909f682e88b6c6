"""Every SGLang flag fastverify names (README commands and prose, every subcommand's --help, the
aliases its CLI accepts) is one SGLang 0.5.23's own parser accepts, as spelled: an exact option
string of ``ServerArgs.add_cli_args`` (no prefix that argparse would have to expand), and every
README ``sglang.launch_server`` command passes ``prepare_server_args``."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from fastverify.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
# "SGLang's `--x`", "SGLang's --x", "(SGLang's --x)", "= SGLang's --x": prose that attributes a flag to SGLang
_SGLANG_NAMED = re.compile(r"SGLang(?:'s| 0\.5\.23's)?(?: own)? `?(--[a-z0-9][a-z0-9-]*)")
SGLANG_ALIASES = ("--tp-size", "--speculative-num-draft-tokens", "--cuda-graph-max-bs-decode")


def _help_texts() -> dict[str, str]:
    """Each subcommand's --help, formatted wide (argparse's textwrap breaks lines at hyphens)."""
    out = {}
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "10000"  # argparse's HelpFormatter reads the width from here
    try:
        for name in COMMANDS:
            sub = build_parser(name)._subparsers._group_actions[0].choices[name]  # noqa: SLF001 - argparse's tree
            out[name] = sub.format_help()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return out


def _launch_commands(text: str) -> list[list[str]]:
    """The SGLang server argv of every README line that starts one, as written (``...`` included)."""
    cmds = []
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if "sglang.launch_server" not in line or line.lstrip().startswith(("#", "|", "-")) and "--" not in line:
            continue
        code = line.split("#", 1)[0]
        try:
            words = shlex.split(code)
        except ValueError:
            continue
        if "sglang.launch_server" not in words:
            continue
        argv = words[words.index("sglang.launch_server") + 1 :]
        cmds.append(argv)
    return cmds


def _named_flags() -> dict[str, set[str]]:
    """flag -> where fastverify names it as SGLang's."""
    where: dict[str, set[str]] = {}
    readme = (REPO / "README.md").read_text()
    for flag in _SGLANG_NAMED.findall(readme):
        where.setdefault(flag, set()).add("README")
    for argv in _launch_commands(readme):
        for w in argv:
            if w.startswith("--"):
                where.setdefault(w.split("=", 1)[0], set()).add("README launch command")
    for name, text in _help_texts().items():
        for flag in _SGLANG_NAMED.findall(" ".join(text.split())):
            where.setdefault(flag, set()).add(f"{name} --help")
    for flag in SGLANG_ALIASES:
        where.setdefault(flag, set()).add("fastverify alias")
    return where


def test_fastverify_accepts_sglangs_names_as_aliases():
    p = build_parser("tune")
    a = p.parse_args(
        [
            "tune",
            "--predict",
            "--tp-size",
            "8",
            "--speculative-num-draft-tokens",
            "6",
            "--cuda-graph-max-bs-decode",
            "32",
        ]
    )
    assert (a.tp, a.draft_tokens, a.max_batch) == (8, 6, 32)
    a = build_parser("profile").parse_args(["profile", "--tp-size", "4", "--speculative-num-draft-tokens", "3"])
    assert (a.tp, a.draft_tokens) == (4, 3)
    a = build_parser("topo").parse_args(["topo", "--nvidia-smi", "t.txt"])
    assert a.topology == Path("t.txt")


def test_the_flags_named_for_sglang_are_found_in_readme_and_help():
    where = _named_flags()
    # the collector itself works: the README's launch example and the aliases are among them
    assert {"--tp-size", "--speculative-algorithm", "--cuda-graph-max-bs-decode"} <= set(where), sorted(where)
    assert "--cuda-graph-max-bs" not in where, where.get("--cuda-graph-max-bs")


_CHILD = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs, prepare_server_args
flags, commands = json.loads(sys.argv[1])
p = argparse.ArgumentParser(allow_abbrev=False)
ServerArgs.add_cli_args(p)
known = set(p._option_string_actions)
res = {"unknown": sorted(f for f in flags if f not in known), "commands": []}
for argv in commands:
    try:
        sa = prepare_server_args(argv)
        res["commands"].append([argv, None, sa.tp_size, sa.speculative_algorithm])
    except SystemExit as e:
        res["commands"].append([argv, f"parser exit {e.code}", None, None])
    except Exception as e:
        res["commands"].append([argv, f"{type(e).__name__}: {e}"[:300], None, None])
print("RESULT " + json.dumps(res))
"""


def test_sglangs_own_parser_accepts_every_flag_fastverify_names():
    py = os.environ.get("FASTVERIFY_SGLANG_PYTHON")
    if not py or not Path(py).is_file():
        pytest.skip("FASTVERIFY_SGLANG_PYTHON not set (make the SGLang venv with .ci/sglang-venv.sh)")
    where = _named_flags()
    commands = []
    for argv in _launch_commands((REPO / "README.md").read_text()):
        if "--model-path" in argv:
            i = argv.index("--model-path")
            argv = argv[:i] + argv[i + 2 :]
        commands.append(["--model-path", "/nonexistent", *(w for w in argv if w not in ("...", "…"))])
    assert commands, "the README starts an SGLang server somewhere"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cp = subprocess.run(
        [py, "-c", _CHILD, json.dumps([sorted(where), commands])], capture_output=True, text=True, timeout=600, env=env
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    res = json.loads(next(ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["unknown"] == [], {f: sorted(where[f]) for f in res["unknown"]}
    for argv, error, _tp, _algo in res["commands"]:
        # the parser must accept the command; a model that cannot load (/nonexistent) is past the parser
        assert error is None or not error.startswith("parser exit"), (argv, error)
