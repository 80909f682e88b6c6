"""The verify shapes an SGLang server command will run, read from the command itself.

Two readers, one record (:class:`ServerShapes`):

* **SGLang's own parser** (:func:`read_with_sglang`), where SGLang imports in this Python: a child
  process runs ``sglang.srt.server_args.prepare_server_args(argv)`` (0.5.23), so SGLang's own
  resolution applies (automatic draft shapes, ``topk == 1`` forcing ``draft = steps + 1``, the
  adaptive candidates); when that cannot finish (no model files, no GPU), SGLang's raw parser
  (``ServerArgs.add_cli_args`` + ``parse_args``) still reads the flags as given, and the record says
  which ran. A flag SGLang's parser rejects (``--cuda-graph-max-bs`` is ambiguous in 0.5.23) is an
  error naming it.
* **A reader of 0.5.23's flags** (:func:`read_flags`) where SGLang does not import: an argparse
  parser of the flags below, with the sibling flags that make SGLang's prefixes ambiguous, and the
  0.5.23 resolution rules this module states with their source. Tested against SGLang's parser.

Flags read (``srt/arg_groups/fields/parallel.py``, ``spec.py``, ``exec_.py``, ``model.py``):
``--tp-size`` (``--tensor-parallel-size``), ``--speculative-algorithm``, ``--speculative-num-steps``,
``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``, ``--speculative-adaptive``
(``--speculative-adaptive-config``), ``--cuda-graph-max-bs-decode``, ``--cuda-graph-bs-decode``,
``--cuda-graph-backend-decode``, ``--disable-decode-cuda-graph`` / ``--disable-cuda-graph``, ``--dtype``.

Nothing here imports SGLang in the calling process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from fastverify.bounds import MAX_BATCH, MAX_DRAFT_TOKENS
from fastverify.errors import UserError
from fastverify.inputs import read_json

SOURCE_SGLANG = "SGLang's prepare_server_args"
SOURCE_SGLANG_RAW = "SGLang's argument parser (flags as given, not resolved)"
SOURCE_READER = "fastverify's reader of SGLang 0.5.23 flags"
SGLANG_TIMEOUT_S = 180.0
ADAPTIVE_DEFAULT_STEPS = (0, 1, 3, 5, 7)
"""The union of SGLang 0.5.23's default adaptive ``candidate_steps`` (``DEFAULT_ADAPTIVE_CONFIG``,
``srt/speculative/adaptive_spec_params.py``); the verify width is ``max + 1`` (topk 1)."""
DEFAULT_HOST = "127.0.0.1"  # SGLang 0.5.23 arg_groups/fields/serving.py: host, port
DEFAULT_PORT = 30000
NGRAM_DEFAULT_DRAFT_TOKENS = 12  # srt/arg_groups/speculative_hook.py::_handle_ngram (0.5.23)
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")  # _handle_eagle_family (speculative/spec_info.py)
_SERVER_ENTRIES = ("sglang.launch_server", "sglang.cli.serve")


@dataclass(frozen=True)
class ServerShapes:
    """What one SGLang server command says about its verify steps; None where it does not say
    (SGLang then chooses at start-up).

    Attributes
    ----------
    tp : int or None
        Tensor-parallel size.
    algorithm : str or None
        Speculative algorithm (``EAGLE``, ``EAGLE3``, ``NGRAM``, ...); None: no speculative decoding.
    draft_tokens : int or None
        Tokens per request in a verify step; under ``--speculative-adaptive`` the largest SGLang can
        switch to.
    topk, steps : int or None
        EAGLE tree width and draft steps (tree drafts when ``topk > 1``).
    adaptive : bool
    decode_bs : tuple[int, ...]
        Decode CUDA-graph batch sizes listed by the command (``--cuda-graph-bs-decode``).
    decode_max_bs : int or None
        ``--cuda-graph-max-bs-decode``.
    graphs_disabled : bool
        Decode CUDA graphs switched off (every step eager).
    dtype : str or None
        ``--dtype`` as given (``auto``: the checkpoint's).
    host, port : str, int or None
        Where its HTTP server listens (SGLang 0.5.23 ``arg_groups/fields/serving.py``: 127.0.0.1 and
        30000 when not given).
    model : str or None
        ``--model-path``.
    source : str
        Which reader ran (:data:`SOURCE_SGLANG`, :data:`SOURCE_SGLANG_RAW`, :data:`SOURCE_READER`).
    note : str
        Why a fallback reader ran, or ``""``.
    """

    tp: int | None = None
    algorithm: str | None = None
    draft_tokens: int | None = None
    topk: int | None = None
    steps: int | None = None
    adaptive: bool = False
    decode_bs: tuple[int, ...] = ()
    decode_max_bs: int | None = None
    graphs_disabled: bool = False
    dtype: str | None = None
    host: str | None = None
    port: int | None = None
    model: str | None = None
    source: str = SOURCE_READER
    note: str = ""

    @property
    def url(self) -> str:
        """The base URL a client on this machine reaches the server at (a wildcard host, ``0.0.0.0``
        or ``::``, as its loopback address: SGLang's own ``ServerArgs.url`` rule)."""
        host = self.host or DEFAULT_HOST
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port or DEFAULT_PORT}"

    @property
    def max_batch(self) -> int | None:
        """Largest captured decode/verify batch the command names."""
        return max(self.decode_bs) if self.decode_bs else self.decode_max_bs

    @property
    def tokens_per_request(self) -> int | None:
        """Rows per request of a verify step (1 without speculative decoding)."""
        return self.draft_tokens if self.algorithm else 1

    @property
    def max_rows(self) -> int | None:
        """Rows of the widest captured verify all-reduce, when both factors are known (None with
        decode CUDA graphs off: no captured bound)."""
        b, k = self.max_batch, self.tokens_per_request
        return b * k if b and k and not self.graphs_disabled else None

    def covers(self) -> str:
        """``verify steps up to 48 requests x 6 tokens (288 rows)``, or what is unknown; with decode
        CUDA graphs off, every step runs eager at whatever batch the scheduler forms."""
        b, k = self.max_batch, self.tokens_per_request
        ks = f"{k} token{'s' if k != 1 else ''}" if k else "SGLang's automatic draft tokens"
        what = "verify steps" if self.algorithm else "decode steps"
        if self.graphs_disabled:
            return f"{what} of any batch, eager (decode CUDA graphs off), x {ks}"
        bs = f"{b} request{'s' if b != 1 else ''}" if b else "SGLang's automatic largest batch"
        rows = f" ({b * k} rows)" if b and k else ""
        return f"{what} up to {bs} x {ks}{rows}"

    def as_dict(self) -> dict:
        return asdict(self)


def server_args_of(argv: Sequence[str]) -> list[str] | None:
    """The server flags of an SGLang server command (``python -m sglang.launch_server ...``,
    ``sglang serve ...``), None for any other command (a script of the user's)."""
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] in _SERVER_ENTRIES:
            return argv[i + 2 :]
        if os.path.basename(a) == "sglang" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return argv[i + 2 :]
    return None


def _reader() -> argparse.ArgumentParser:
    # allow_abbrev as SGLang's parser; the -prefill siblings make the same prefixes ambiguous.
    p = argparse.ArgumentParser(prog="sglang serve", add_help=False, allow_abbrev=True)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)  # 0.5.23: tp_size = 1
    p.add_argument("--speculative-algorithm", type=str)
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-adaptive", action="store_true")
    p.add_argument("--speculative-adaptive-config", type=str)
    for phase in ("decode", "prefill"):
        p.add_argument(f"--cuda-graph-max-bs-{phase}", type=int)
        p.add_argument(f"--cuda-graph-bs-{phase}", type=int, nargs="+")
        p.add_argument(f"--cuda-graph-backend-{phase}", choices=("full", "breakable", "disabled"))
        p.add_argument(f"--disable-{phase}-cuda-graph", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--dtype", type=str, default="auto")
    p.add_argument("--host", type=str, default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--model-path", "--model", dest="model_path", type=str)
    return p


class _Refused(Exception):
    pass


def _parse(parser: argparse.ArgumentParser, flags: Sequence[str]) -> argparse.Namespace:
    def error(message: str):
        raise _Refused(message)

    parser.error = error  # type: ignore[method-assign]
    ns, _ = parser.parse_known_args(list(flags))
    return ns


def _adaptive_steps(config_path: str | None) -> tuple[int, ...]:
    """Union of the adaptive config's ``candidate_steps``, read as SGLang 0.5.23 reads it
    (``adaptive_spec_params.py::_load_adaptive_config``): keys that are not digits are skipped;
    every digit key's ``candidate_steps`` must be a non-empty list of non-negative ints; at least
    one digit key. Without a config, SGLang's default union.

    Raises
    ------
    UserError
        The file is unreadable or not JSON, or breaks one of SGLang's rules (its own wording).
    """
    if not config_path:
        return ADAPTIVE_DEFAULT_STEPS

    data = read_json(config_path, what="the adaptive speculative config")
    where = f"{config_path}: not an SGLang adaptive config"
    if not isinstance(data, dict):
        raise UserError(f'{where}: expected an object of batch sizes, e.g. {{"1": {{"candidate_steps": [1, 3, 7]}}}}')
    steps: set[int] = set()
    for key, entry in data.items():
        if not key.isdigit():
            continue
        got = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(got, list) or not got or not all(isinstance(v, int) and v >= 0 for v in got):
            raise UserError(f"{where}: BS {key}: candidate_steps must be a list of non-negative ints, got {got!r}")
        steps.update(got)
    if not steps:
        raise UserError(
            f"{where}: it must contain at least one integer-string BS key, e.g. "
            f'{{"1": {{"candidate_steps": [1, 3, 7]}}}}; got keys {list(data)}'
        )
    if max(steps) + 1 > MAX_DRAFT_TOKENS:
        raise UserError(
            f"{where}: candidate step {max(steps)} means {max(steps) + 1} draft tokens, more than {MAX_DRAFT_TOKENS}"
        )
    return tuple(sorted(steps))


def _adaptive_off(algo: str, topk: int | None) -> str | None:
    """Why SGLang 0.5.23 turns ``--speculative-adaptive`` off for this command (the rules of
    ``adaptive_spec_params.py::adaptive_unsupported_reason`` a command line decides), or None."""
    if algo not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={algo} (only EAGLE/EAGLE3 are supported)"
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    return None


_RANGES = (
    ("tp_size", "--tp-size", 1, 4096),
    ("speculative_num_draft_tokens", "--speculative-num-draft-tokens", 1, MAX_DRAFT_TOKENS),
    ("speculative_eagle_topk", "--speculative-eagle-topk", 1, MAX_DRAFT_TOKENS),
    ("speculative_num_steps", "--speculative-num-steps", 0, MAX_DRAFT_TOKENS),
    ("cuda_graph_max_bs_decode", "--cuda-graph-max-bs-decode", 1, MAX_BATCH),
)


def _check_ranges(ns: argparse.Namespace) -> None:
    """Refuse a value no server can run (fastverify's bounds, :mod:`fastverify.bounds`)."""
    for attr, flag, lo, hi in _RANGES:
        v = getattr(ns, attr, None)
        if v is not None and not lo <= v <= hi:
            raise UserError(f"the SGLang command: {flag} {v}: expected {lo}..{hi}")
    for v in ns.cuda_graph_bs_decode or ():
        if not 1 <= v <= MAX_BATCH:
            raise UserError(f"the SGLang command: --cuda-graph-bs-decode {v}: expected 1..{MAX_BATCH}")


def _resolve(
    ns: argparse.Namespace,
    *,
    source: str,
    note: str = "",
    adaptive_steps: Sequence[int] | None = None,
    adaptive_off: str | None = None,
) -> ServerShapes:
    """The record from a namespace of the flags above, with SGLang 0.5.23's resolution of the
    draft width (``srt/arg_groups/speculative_hook.py``): NGRAM defaults to 12 draft tokens;
    ``--speculative-adaptive`` is dropped where SGLang drops it (:func:`_adaptive_off`, or
    ``adaptive_off``: SGLang's own reason when it was asked), else topk is 1 and the width the
    largest candidate step + 1 (``adaptive_steps``: SGLang's own union, when it was asked); with
    ``topk == 1`` and ``steps`` given the width is ``steps + 1``. Anything else left unresolved is
    SGLang's automatic choice (None).

    SGLang's ``prepare_server_args`` leaves these rules to start-up (0.5.23 resolves the speculative
    defaults in ``ServerArgs`` hooks run by the engine), so both readers apply them.

    Raises
    ------
    UserError
        A value out of range; an EAGLE-family command giving draft tokens or topk without
        ``--speculative-num-steps`` (SGLang 0.5.23 asserts both unset then,
        ``speculative_hook.py::_handle_eagle_family``); a bad adaptive config.
    """
    _check_ranges(ns)
    algo = ns.speculative_algorithm.upper() if ns.speculative_algorithm else None
    draft, topk, steps = ns.speculative_num_draft_tokens, ns.speculative_eagle_topk, ns.speculative_num_steps
    adaptive = bool(ns.speculative_adaptive) and algo is not None
    notes = [note] if note else []
    if adaptive:
        off = adaptive_off or _adaptive_off(algo, topk)
        if off is not None:
            adaptive = False
            notes.append(f"SGLang turns --speculative-adaptive off: {off}")
    if algo in EAGLE_FAMILY and not adaptive and steps is None and (topk is not None or draft is not None):
        raise UserError(
            "the SGLang command: --speculative-num-draft-tokens / --speculative-eagle-topk without "
            "--speculative-num-steps: SGLang 0.5.23 refuses it at start-up (speculative_hook.py "
            "_handle_eagle_family asserts both unset when the steps are); give all three or none"
        )
    if algo == "NGRAM" and draft is None:
        draft = NGRAM_DEFAULT_DRAFT_TOKENS
    elif adaptive:
        topk = 1
        steps_union = adaptive_steps or _adaptive_steps(getattr(ns, "speculative_adaptive_config", None))
        draft = max(steps_union) + 1
    elif topk == 1 and steps is not None:
        draft = steps + 1
    disabled = bool(ns.disable_cuda_graph or ns.disable_decode_cuda_graph or ns.cuda_graph_backend_decode == "disabled")
    return ServerShapes(
        tp=ns.tp_size,
        algorithm=algo,
        draft_tokens=draft,
        topk=topk,
        steps=steps,
        adaptive=adaptive,
        decode_bs=tuple(ns.cuda_graph_bs_decode or ()),
        decode_max_bs=ns.cuda_graph_max_bs_decode,
        graphs_disabled=disabled,
        dtype=ns.dtype,
        host=getattr(ns, "host", None),
        port=getattr(ns, "port", None),
        model=getattr(ns, "model_path", None),
        source=source,
        note="; ".join(notes),
    )


def read_flags(flags: Sequence[str]) -> ServerShapes:
    """:class:`ServerShapes` from server flags with fastverify's reader of 0.5.23's flags.

    Raises
    ------
    UserError
        A flag the reader (like SGLang's parser) rejects: an ambiguous prefix, a non-integer value.
    """
    try:
        ns = _parse(_reader(), flags)
    except _Refused as err:
        raise UserError(f"the SGLang command: {err}") from None
    return _resolve(ns, source=SOURCE_READER)


_CHILD = r"""
import argparse, json, sys
argv = json.loads(sys.argv[1])
from sglang.srt.server_args import ServerArgs, prepare_server_args
keys = ("tp_size", "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "speculative_adaptive", "speculative_adaptive_config",
        "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_backend_decode",
        "disable_decode_cuda_graph", "disable_cuda_graph", "dtype", "host", "port", "model_path")
out = {"resolved": True, "why": ""}
try:
    ns = prepare_server_args(argv)
except SystemExit:
    raise
except BaseException as err:
    out = {"resolved": False, "why": f"{type(err).__name__}: {err}"[:300]}
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    ns, _ = p.parse_known_args(argv)
out["fields"] = {k: getattr(ns, k, None) for k in keys}
if out["fields"]["speculative_adaptive"] and out["fields"]["speculative_algorithm"]:
    from sglang.srt.speculative import adaptive_spec_params as asp
    try:
        out["adaptive_off"] = asp.adaptive_unsupported_reason(ns) if out["resolved"] else None
    except Exception as err:
        out["adaptive_off"] = None
    if not out.get("adaptive_off"):
        try:
            out["adaptive_steps"] = list(asp.resolve_candidate_steps_from_config(
                cfg_path=out["fields"]["speculative_adaptive_config"]))
        except Exception as err:
            out["adaptive_error"] = f"{type(err).__name__}: {err}"[:300]
print("FASTVERIFY_SERVER_ARGS " + json.dumps(out, default=str))
"""


def read_with_sglang(
    flags: Sequence[str],
    python: str | None = None,
    *,
    timeout_s: float = SGLANG_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> ServerShapes:
    """:class:`ServerShapes` from SGLang's own ``prepare_server_args`` in a child ``python``
    (default this interpreter). Where ``prepare_server_args`` fails after SGLang's parser accepted
    the flags, the flags as SGLang's parser read them (:data:`SOURCE_SGLANG_RAW`); where the child
    cannot run at all, :func:`read_flags`. The record says which, and why.

    Raises
    ------
    UserError
        SGLang's parser rejects the command (its own message, e.g. an ambiguous option).
    """
    cmd = [python or sys.executable, "-c", _CHILD, json.dumps(list(flags))]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return _fallback(flags, f"SGLang's parser took over {timeout_s:.0f} s")
    except OSError as err:
        return _fallback(flags, f"SGLang's parser did not start ({err.strerror or err})")
    line = next((ln for ln in cp.stdout.splitlines()[::-1] if ln.startswith("FASTVERIFY_SERVER_ARGS ")), None)
    if line is None:
        err = next((ln for ln in cp.stderr.splitlines()[::-1] if "error:" in ln), None)
        if cp.returncode == 2 and err is not None:  # argparse refused a flag
            raise UserError(f"the SGLang command: SGLang's parser says: {err.split('error:', 1)[1].strip()}")
        last = (cp.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return _fallback(flags, f"SGLang's parser exited {cp.returncode} ({last})")
    got = json.loads(line.split(" ", 1)[1])
    if got.get("adaptive_error"):
        raise UserError(f"the SGLang command: SGLang refuses the adaptive config: {got['adaptive_error']}")
    ns = argparse.Namespace(**got["fields"])
    ns.disable_cuda_graph, ns.disable_decode_cuda_graph = (
        bool(ns.disable_cuda_graph),
        bool(ns.disable_decode_cuda_graph),
    )
    if got.get("resolved"):
        return _resolve(
            ns, source=SOURCE_SGLANG, adaptive_steps=got.get("adaptive_steps"), adaptive_off=got.get("adaptive_off")
        )
    return _resolve(
        ns,
        source=SOURCE_SGLANG_RAW,
        note=f"prepare_server_args did not finish ({got['why']})",
        adaptive_steps=got.get("adaptive_steps"),
    )


def _fallback(flags: Sequence[str], why: str) -> ServerShapes:
    """:func:`read_flags`, with why SGLang's parser could not be used before its own note."""
    shapes = read_flags(flags)
    return replace(shapes, note="; ".join(n for n in (why, shapes.note) if n))


def read_command(argv: Sequence[str], *, sglang_found: bool, python: str | None = None) -> ServerShapes | None:
    """The shapes of an SGLang server command, None for another command. SGLang's parser when
    ``sglang_found`` (it imports in this Python), else :func:`read_flags`."""
    flags = server_args_of(argv)
    if flags is None:
        return None
    if sglang_found:
        return read_with_sglang(flags, python)
    return read_flags(flags)
