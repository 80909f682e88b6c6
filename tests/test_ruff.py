"""The code is formatted and linted as ``pyproject.toml``'s ``[tool.ruff]`` says (120 columns;
pyflakes, pycodestyle, isort): ``ruff format --check`` and ``ruff check`` over the package, the tests
and the benchmarks find nothing. ruff is a test dependency (``./setup.sh --dev``), so CI runs it with
the tests; elsewhere, without ruff, this skips and says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

PATHS = ("fastverify", "tests", "benchmarks")


def _ruff() -> str:
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ruff is not installed: ./setup.sh --dev installs it, and CI must run it")
        pytest.skip("ruff is not installed (./setup.sh --dev installs it)")
    return found


@pytest.mark.parametrize("args", [("format", "--check"), ("check",)], ids=["format", "lint"])
def test_ruff_finds_nothing(args):
    cp = subprocess.run([_ruff(), *args, *PATHS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, (cp.stdout + cp.stderr)[-4000:]
