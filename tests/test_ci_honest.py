"""CI does not pass by skipping: under ``CI=true`` a failed wheel download or SGLang venv build stops
``.ci/run`` with a message naming the step, and the test run refuses to start without the contract
tests' inputs. Outside CI both stay notices and the tests skip, as before.

``.ci/run`` runs from a copy of the repository's ``.ci`` folder in a scratch folder whose
``setup.sh`` only says it was reached, so no real install or test run can start from here; a
``python3`` first on PATH refuses ``-m pip download`` and ``-m venv`` at once (no network, no 11 GB
SGLang install), and HOME is an empty folder (no cached wheels, no venv).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CI_REQUIRED_ENV, REPO_ROOT, subprocess_env

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="runs the bash CI script")

SETUP_REACHED = "setup.sh reached (test stand-in)"
FAKE_PYTHON3 = f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && {{ [ "$2 $3" = "pip download" ] || [ "$2" = "venv" ]; }}; then
    echo "python3 stand-in: refusing $2 (test)" >&2
    exit 1
fi
exec {sys.executable} "$@"
"""


@pytest.fixture
def ci_copy(tmp_path):
    """(script, env): ``.ci/run`` in a scratch repository, and its environment (see the module docstring)."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / ".ci", repo / ".ci")
    (repo / "setup.sh").write_text(f"#!/usr/bin/env bash\necho '{SETUP_REACHED}'\nexit 7\n")
    (repo / "setup.sh").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHON", "FASTVERIFY_WHEEL_CACHE", *CI_REQUIRED_ENV)}
    env.update(HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return repo / ".ci" / "run", env


def _run(script, env, **extra):
    return subprocess.run(["bash", str(script)], env={**env, **extra}, capture_output=True, text=True, timeout=120)


def test_in_ci_a_failed_wheel_download_fails_the_run_before_anything_else(ci_copy):
    script, env = ci_copy
    proc = _run(script, env, CI="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "ci: ERROR: the wheel download (pip download flashinfer-python==0.7.4 sglang==0.5.23" in proc.stderr
    assert "would skip; CI=true makes that a failure" in proc.stderr
    assert "sglang-venv" not in out and SETUP_REACHED not in out  # stopped at the first step


def test_in_ci_a_failed_sglang_venv_fails_the_run(ci_copy, tmp_path):
    script, env = ci_copy
    wheels = tmp_path / "wheels"  # both wheels cached: the failed download alone loses nothing
    wheels.mkdir()
    for name in ("flashinfer_python-0.7.4-py3-none-any.whl", "sglang-0.5.23-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    proc = _run(script, env, CI="true", FASTVERIFY_WHEEL_CACHE=str(wheels))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"using the wheels already in {wheels}" in proc.stdout
    assert "ci: ERROR: the SGLang 0.5.23 venv build (.ci/sglang-venv.sh) failed" in proc.stderr
    assert "the real-SGLang patch tests would skip" in proc.stderr
    assert SETUP_REACHED not in proc.stdout


def test_outside_ci_both_failures_are_notices_and_the_tests_still_run(ci_copy):
    script, env = ci_copy
    proc = _run(script, env)
    assert proc.returncode == 7, proc.stdout + proc.stderr  # the stand-in setup.sh's own exit code
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ci: the wheel download (pip download")
    assert lines[0].endswith("failed; the backend signature and contract tests that read the wheels' source skip")
    assert lines[1] == "ci: the SGLang 0.5.23 venv build (.ci/sglang-venv.sh) failed; the real-SGLang patch tests skip"
    assert lines[2] == SETUP_REACHED


def test_the_script_ends_with_the_readme_command():
    last = (REPO_ROOT / ".ci" / "run").read_text().rstrip("\n").splitlines()[-1]
    readme = (REPO_ROOT / "README.md").read_text()
    assert last == "./setup.sh --dev && .venv/bin/python -m pytest -q" and f"\n{last}\n" in readme


def _pytest_collect(env):
    """``pytest --collect-only`` of this file in a subprocess: nothing in it runs, whatever happens."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", str(Path(__file__))],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_in_ci_the_test_run_refuses_to_start_without_the_sglang_venv(tmp_path):
    present = tmp_path / "present"
    present.write_bytes(b"")
    env = subprocess_env()
    env.update({name: str(present) for name in CI_REQUIRED_ENV}, CI="true")
    del env["FASTVERIFY_SGLANG_PYTHON"]
    proc = _pytest_collect(env)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error: nothing collected or run
    [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line == (
        "ERROR: CI=true but FASTVERIFY_SGLANG_PYTHON is unset: the contract tests that need it would "
        "skip; run .ci/run, which fetches the wheels and builds the SGLang venv"
    )


def test_in_ci_a_wheel_path_that_names_no_file_is_refused_and_all_present_passes(tmp_path):
    present = tmp_path / "present"
    present.write_bytes(b"")
    env = subprocess_env()
    env.update({name: str(present) for name in CI_REQUIRED_ENV}, CI="true")
    assert _pytest_collect(env).returncode == 0  # all three there: CI runs as usual
    env["FASTVERIFY_FLASHINFER_WHEEL"] = str(tmp_path / "gone.whl")
    proc = _pytest_collect(env)
    assert proc.returncode == 4 and f"FASTVERIFY_FLASHINFER_WHEEL={tmp_path / 'gone.whl'} is not a file" in proc.stderr
    env.pop("CI")  # a developer's machine: nothing changes
    assert _pytest_collect(env).returncode == 0


def test_the_script_runs_ruff_before_the_tests():
    lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    fmt = lines.index(".venv/bin/ruff format --check fastverify tests benchmarks")
    lint = lines.index(".venv/bin/ruff check fastverify tests benchmarks")
    assert fmt < lint < len(lines) - 1 and lines[-1].endswith(".venv/bin/python -m pytest -q")
