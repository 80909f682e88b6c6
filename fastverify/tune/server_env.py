"""The environment an SGLang server's start-up imposes, so that ``tune``'s trials run in it.

SGLang sets NCCL and CUDA variables in its own process before it starts any rank (SGLang 0.5.23
``srt/entrypoints/engine.py::_set_envs_and_config``): ``NCCL_CUMEM_ENABLE=0`` (legacy IPC instead
of NCCL's cuMem P2P, its default since 2.19) unless the user set it, ``NCCL_NVLS_ENABLE=0``,
``CUDA_DEVICE_MAX_CONNECTIONS=8`` always, and more; some depend on the server's arguments
(``--enable-symm-mem``, ``--enable-nccl-nvls``, ``--dcp-size``, KV-cache sharding). A trial timed
without them measures a set-up the server never runs.

Two sources, one answer (:class:`ServerEnv`):

* **SGLang's own function** (:data:`SOURCE_SGLANG`), where SGLang imports in ``python``: a child
  parses the server's flags with ``prepare_server_args``, then, once per set of trial settings,
  runs ``_set_envs_and_config`` over the shell's environment plus those settings and keeps what it
  changed (so the user's and the trial's explicit settings win wherever SGLang lets them).
* **0.5.23's rules as a table** (:data:`SOURCE_TABLE`) where it does not: the rules of that
  function for a single-node server, with the three flags above read from the command.

Per-run values (``SGLANG_RUN_ID``, ``PROMETHEUS_MULTIPROC_DIR``) are left out: they change every
start and say nothing about the all-reduce.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SOURCE_SGLANG = "SGLang's _set_envs_and_config (srt/entrypoints/engine.py), run on the server's arguments"
SOURCE_TABLE = "SGLang 0.5.23 srt/entrypoints/engine.py::_set_envs_and_config, as a table (SGLang does not import)"
TIMEOUT_S = 180.0
PLACEHOLDER_MODEL = "/nonexistent/fastverify-tune-model"
"""``--model-path`` when the server's flags are not given: SGLang's parser requires one, and no rule
of ``_set_envs_and_config`` depends on it (a path that does not exist never reaches the network)."""
PER_RUN = frozenset({"SGLANG_RUN_ID", "PROMETHEUS_MULTIPROC_DIR"})
WATCHED = (
    "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_GRAPH_MIXING_SUPPORT",
    "NCCL_MNNVL_ENABLE",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TRTLLM_ENABLE_PDL",
    "CUTE_DSL_LOG_LEVEL",
    "CUTE_DSL_LOG_TO_CONSOLE",
)
"""The variables SGLang 0.5.23's ``_set_envs_and_config`` sets (less the per-run ones): a trial's
recorded environment names each of them as the trial ran, whoever set it."""


@dataclass(frozen=True)
class ServerEnv:
    """What SGLang's start-up adds to the environment, per set of trial settings.

    Attributes
    ----------
    envs : tuple[dict[str, str], ...]
        One per overlay given to :func:`server_environment`, in order: the variables SGLang sets or
        changes over the shell's environment plus that overlay.
    source : str
        :data:`SOURCE_SGLANG` or :data:`SOURCE_TABLE`.
    note : str
        Why the table was used, or ``""``.
    """

    envs: tuple[dict[str, str], ...]
    source: str
    note: str = ""


_CHILD = r"""
import json, os, sys
argv, overlays, per_run = json.loads(sys.argv[1]), json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))
from sglang.srt.server_args import prepare_server_args
from sglang.srt.entrypoints import engine
sa = prepare_server_args(argv)
note = ""
try:
    sa.resolve_once()  # as the engine does before _set_envs_and_config
except Exception as err:
    note = f"resolve_once did not finish ({type(err).__name__}); the flags as given"
shell = dict(os.environ)
envs = []
for overlay in overlays:
    os.environ.clear(); os.environ.update(shell); os.environ.update(overlay)
    before = dict(os.environ)
    engine._set_envs_and_config(sa)
    envs.append({k: v for k, v in os.environ.items() if before.get(k) != v and k not in per_run})
print("FASTVERIFY_SERVER_ENV " + json.dumps({"envs": envs, "note": note}))
"""


def _flags(flags: Sequence[str] | None, tp: int) -> list[str]:
    """The server's flags, or the smallest command SGLang's parser takes for a ``tp``-way server."""
    if flags:
        return list(flags)
    return ["--model-path", PLACEHOLDER_MODEL, "--tp-size", str(tp)]


def server_environment(
    flags: Sequence[str] | None,
    overlays: Sequence[Mapping[str, str]],
    *,
    tp: int,
    python: str | None = None,
    shell: Mapping[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
) -> ServerEnv:
    """What SGLang's start-up sets over ``shell`` (default this process's environment) plus each
    overlay (a trial's own settings), for the server started with ``flags`` (None: a plain
    ``tp``-way server). SGLang's own function in a child ``python`` (default this interpreter,
    where SGLang imports), else the 0.5.23 table (:func:`table_env`)."""
    shell = dict(os.environ if shell is None else shell)
    overlays = [dict(o) for o in overlays]
    if python is None and importlib.util.find_spec("sglang") is None:
        return _table(
            flags,
            overlays,
            shell,
            "SGLang is not installed in this Python: the flags were read only for "
            "--enable-symm-mem, --enable-nccl-nvls and --dcp-size, not checked",
        )
    # no network, no package-version gate (a check, not a setting); the shell's own values win
    env = {"HF_HUB_OFFLINE": "1", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", **shell}
    cmd = [
        python or sys.executable,
        "-c",
        _CHILD,
        json.dumps(_flags(flags, tp)),
        json.dumps(overlays),
        json.dumps(sorted(PER_RUN)),
    ]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        return _table(flags, overlays, shell, f"SGLang took over {timeout_s:.0f} s to start")
    except OSError as err:
        return _table(flags, overlays, shell, f"SGLang's Python did not start ({err.strerror or err})")
    line = next((ln for ln in cp.stdout.splitlines()[::-1] if ln.startswith("FASTVERIFY_SERVER_ENV ")), None)
    if line is None:
        last = (cp.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return _table(flags, overlays, shell, f"SGLang's _set_envs_and_config did not run ({last})")
    got = json.loads(line.split(" ", 1)[1])
    return ServerEnv(envs=tuple(got["envs"]), source=SOURCE_SGLANG, note=got.get("note", ""))


def _table(flags, overlays, shell, why: str) -> ServerEnv:
    return ServerEnv(envs=tuple(table_env(flags, {**shell, **o}) for o in overlays), source=SOURCE_TABLE, note=why)


def table_env(flags: Sequence[str] | None, env: Mapping[str, str]) -> dict[str, str]:
    """SGLang 0.5.23's ``_set_envs_and_config`` rules (``srt/entrypoints/engine.py``) for a
    single-node server without KV-cache sharding, over ``env``: the variables it would set or
    change. ``--enable-symm-mem`` forces ``NCCL_CUMEM_ENABLE=1`` and ``NCCL_NVLS_ENABLE=1``;
    ``--enable-nccl-nvls`` forces ``NCCL_NVLS_ENABLE=1``; otherwise both are ``0`` unless already
    set; ``--dcp-size`` > 1 sets ``NCCL_GRAPH_MIXING_SUPPORT=0`` unless set;
    ``CUDA_DEVICE_MAX_CONNECTIONS=8`` always; ``TRTLLM_ENABLE_PDL=1`` unless ``0``;
    ``CUTE_DSL_LOG_LEVEL=30`` and ``CUTE_DSL_LOG_TO_CONSOLE=1`` unless set."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--enable-symm-mem", action="store_true")
    p.add_argument("--enable-nccl-nvls", action="store_true")
    p.add_argument("--dcp-size", "--decode-context-parallel-size", type=int, default=1)
    try:
        ns, _ = p.parse_known_args(list(flags or ()))
    except SystemExit:  # a bad --dcp-size: SGLang's parser will say so at start-up
        ns = argparse.Namespace(enable_symm_mem=False, enable_nccl_nvls=False, dcp_size=1)
    out: dict[str, str] = {}
    if "NCCL_CUMEM_ENABLE" not in env or ns.enable_symm_mem:
        out["NCCL_CUMEM_ENABLE"] = str(int(ns.enable_symm_mem))
    if "NCCL_NVLS_ENABLE" not in env or ns.enable_nccl_nvls or ns.enable_symm_mem:
        out["NCCL_NVLS_ENABLE"] = str(int(ns.enable_nccl_nvls or ns.enable_symm_mem))
    if ("NCCL_GRAPH_MIXING_SUPPORT" not in env or ns.enable_symm_mem) and ns.dcp_size > 1:
        out["NCCL_GRAPH_MIXING_SUPPORT"] = "0"
    out["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    if env.get("TRTLLM_ENABLE_PDL", "1") != "0":
        out["TRTLLM_ENABLE_PDL"] = "1"
    if env.get("CUTE_DSL_LOG_LEVEL") is None:
        out["CUTE_DSL_LOG_LEVEL"] = "30"
    if env.get("CUTE_DSL_LOG_TO_CONSOLE") is None:
        out["CUTE_DSL_LOG_TO_CONSOLE"] = "1"
    return {k: v for k, v in out.items() if env.get(k) != v}


def tp_of(flags: Sequence[str]) -> int | None:
    """The tensor-parallel size the server flags name (``--tp-size`` / ``--tp`` /
    ``--tensor-parallel-size``, SGLang 0.5.23's spellings), None when they name none or not a number."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp", default=None)
    ns, _ = p.parse_known_args(list(flags))
    try:
        return int(ns.tp) if ns.tp is not None else None
    except ValueError:
        return None


def recorded_environment(env: Mapping[str, str], *keys: str) -> dict[str, str]:
    """A trial's environment as recorded in the journal and ``tune --json``: every ``NCCL_*``
    variable, the :data:`WATCHED` ones and ``keys``, with the value the trial ran with (absent: unset)."""
    names = {k for k in env if k.startswith("NCCL_")} | set(WATCHED) | set(keys)
    return {k: env[k] for k in sorted(names) if k in env}
