#!/usr/bin/env bash
# Set up fastverify in ./.venv (created with --system-site-packages, so an existing torch is reused
# and never replaced). Installs a torch only when none can be imported: the pinned CPU build
# (FASTVERIFY_TORCH_SPEC overrides it, e.g. for a CUDA build on a GPU box).
#   ./setup.sh          runtime dependencies
#   ./setup.sh --dev    plus test dependencies (pytest, hypothesis, ruff)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras="live"
if [[ "${1:-}" == "--dev" ]]; then extras="live,test"; fi
if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup.sh: no torch found; installing ${FASTVERIFY_TORCH_SPEC:-torch==2.13.0}" >&2
    "$VPY" -m pip install -q "${FASTVERIFY_TORCH_SPEC:-torch==2.13.0}"
fi
"$VPY" -m pip install -q -e ".[${extras}]"
