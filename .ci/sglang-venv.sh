#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment holding the REAL SGLang 0.5.23 with all of its
# dependencies (torch included; its pin clashes with fastverify's own .venv), plus fastverify
# installed editable without dependencies. Used by tests/test_patch_real_sglang.py through
# FASTVERIFY_SGLANG_PYTHON. CPU-only machines are fine (the CUDA torch wheel imports on CPU).
#
#   .ci/sglang-venv.sh [DIR]      default DIR: $HOME/.cache/fastverify/sglang-0.5.23-venv
#
# Idempotent: an existing DIR whose python imports sglang (and fastverify) is reused. The LAST line
# of stdout is the venv's python path; progress goes to stderr. Exits non-zero, with a message, when
# the install fails. Needs network on first use (about 11 GB, a few minutes).
set -euo pipefail
SGLANG_VERSION="0.5.23"
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$HOME/.cache/fastverify/sglang-${SGLANG_VERSION}-venv}"
py="$dir/bin/python"
PYTHON="${PYTHON:-python3}"

say() { echo "sglang-venv: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

have_sglang() {
    [ -x "$py" ] && "$py" - "$SGLANG_VERSION" >/dev/null 2>&1 <<'PY'
import sys, importlib.metadata as md
import sglang  # noqa: F401
sys.exit(0 if md.version("sglang") == sys.argv[1] else 1)
PY
}

if have_sglang; then
    say "reusing $dir (sglang $SGLANG_VERSION imports)"
else
    if [ ! -x "$py" ]; then
        say "creating venv at $dir with $("$PYTHON" -V 2>&1)"
        mkdir -p "$(dirname "$dir")"
        "$PYTHON" -m venv "$dir" || die "could not create a venv at $dir with $PYTHON"
    fi
    "$py" -m pip install -q --upgrade pip >&2 || die "pip upgrade failed in $dir"
    say "pip install sglang==$SGLANG_VERSION (all dependencies; ~11 GB, minutes)"
    t0=$(date +%s)
    "$py" -m pip install --progress-bar off "sglang==$SGLANG_VERSION" >&2 \
        || die "pip install sglang==$SGLANG_VERSION failed in $dir (network? disk space?)"
    say "sglang installed in $(( $(date +%s) - t0 )) s; venv size $(du -sh "$dir" 2>/dev/null | cut -f1)"
    have_sglang || die "sglang==$SGLANG_VERSION installed but 'import sglang' fails in $dir: $("$py" -c 'import sglang' 2>&1 | tail -n 1)"
fi

# fastverify itself, editable and without dependencies (so the SGLang torch pin is untouched), and
# its own runtime dependencies only where missing (none of them pulls torch).
# (checked from / so that the working directory's fastverify does not count)
if ! (cd / && "$py" -c "import fastverify, sys; sys.exit(0 if fastverify.__file__.startswith('$repo/') else 1)") >/dev/null 2>&1; then
    say "pip install --no-deps -e $repo"
    "$py" -m pip install -q --no-deps -e "$repo" >&2 || die "pip install --no-deps -e $repo failed"
fi
missing=$("$py" - <<'PY'
import importlib.util
mods = {"numpy": "numpy", "orjson": "orjson", "msgspec": "msgspec", "isal": "isal", "rich": "rich",
        "matplotlib": "matplotlib", "pynvml": "nvidia-ml-py"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
    say "installing fastverify's missing dependencies: $missing"
    # none of these depends on torch, so SGLang's torch pin is left as it is
    "$py" -m pip install -q $missing >&2 || die "could not install $missing"
fi
(cd / && "$py" -c "import fastverify.patch.install") >/dev/null 2>&1 \
    || die "fastverify.patch.install does not import in $dir: $(cd / && "$py" -c 'import fastverify.patch.install' 2>&1 | tail -n 1)"
echo "$py"
